"""What a batch reports when things go wrong, on the real app over the fake engine: a server
that is gone (never there, or killed mid-batch) fails every pending input at once with one
error; `retries=` repeats only what can succeed; a retried input keeps its first start and
promise; the batch's stats, summary, table and the `batch` metadata of its registrations."""

from __future__ import annotations

import subprocess
import threading

import httpx
import pytest

from justitia_sdk import APIError, AsyncClient, ServerGoneError, agent, llm
from justitia_sdk._handle import deadline_of
from tests.support.waiting import wait_until

pytestmark = pytest.mark.anyio


@agent("outcome_tiny")
async def tiny(i: int) -> str:
    return await llm(f"say {i}", max_tokens=2)


@agent("outcome_sized")
async def sized(tokens: int) -> str:
    return await llm(f"count {tokens}", max_tokens=tokens, ignore_eos=True)


@agent("outcome_too_long")
async def too_long(words: int) -> str:
    return await llm("word " * words, max_tokens=2)


class Flaky(Exception):
    pass


_flaky_runs: dict[int, int] = {}


@agent("outcome_flaky")
async def flaky(i: int) -> str:
    import anyio

    _flaky_runs[i] = _flaky_runs.get(i, 0) + 1
    text = await llm(f"try {i}", max_tokens=2)
    if _flaky_runs[i] == 1:
        await anyio.sleep(0.3)  # the first run takes a while, then fails
        raise Flaky(f"first run of {i}")
    return text


# -- a server that is gone -------------------------------------------------------------------


def _one_error_for_all(handles) -> ServerGoneError:
    errors = {id(h.error): h.error for h in handles}
    assert len(errors) == 1, [repr(h.error) for h in handles]
    [error] = errors.values()
    assert isinstance(error, ServerGoneError)
    return error


async def test_a_batch_against_no_server_fails_every_input_at_once() -> None:
    """Nothing listens at the URL: the first runs find it out within `server_gone_s`, and
    the batch fails all 40 inputs with one error; the 36 waiting for a slot are never
    tried, and `retries=` adds no attempt."""
    from server.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncClient(url, server_gone_s=0.5) as client:
        batch = await client.submit_many(tiny, range(40), concurrency=4, retries=3,
                                         progress=False)
        assert client.server_gone
    assert [h.status for h in batch] == ["failed"] * 40
    error = _one_error_for_all(batch)
    assert batch.server_error is error and "is gone" in str(error) and url in str(error)
    assert sum(h.attempts for h in batch) <= 4  # one run each of the first wave, no retry
    assert sum(h.attempts == 0 for h in batch) >= 36
    stats = batch.stats()
    assert (stats.failed, stats.pending, stats.running, stats.finished) == (40, 0, 0, 0)
    assert "the server is gone" in batch.summary()
    with pytest.raises(ServerGoneError):
        batch.results()


_SERVE_FAKE = """
import sys, time
from tests.support.fake_engine import FakeEngine, FakeServer
srv = FakeServer(sys.argv[1], engine=FakeEngine(step_s=0.01)).start(port=int(sys.argv[2]))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.slow
async def test_a_server_killed_mid_batch_fails_the_inputs_not_ended_together(tmp_path) -> None:
    """Killed (kill -9) while a batch runs: the inputs that finished keep their results;
    the running ones and those never started end with the same `ServerGoneError`."""
    import sys

    import anyio

    from server.launcher import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_FAKE, str(tmp_path), str(port)],
                            stdout=subprocess.PIPE, text=True)
    killed = threading.Event()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        # three quick inputs, then long ones (3 s each at 10 ms a token)
        inputs = [2, 2, 2] + [300] * 9

        def kill_once_three_finished() -> None:
            wait_until(lambda: sum(a["state"] == "finished" for a in httpx.get(
                url + "/v1/agents").json()["agents"]) >= 3 and sum(
                a["requests_total"] > 0 and a["state"] in ("running", "paused") for a in httpx.get(
                    url + "/v1/agents").json()["agents"]) >= 1, 30)
            proc.kill()
            proc.wait(10)
            killed.set()

        async with AsyncClient(url, server_gone_s=1.0) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, kill_once_three_finished)
                batch = await client.submit_many(sized, inputs, concurrency=3, retries=2,
                                                 progress=False)
        assert killed.is_set()
        done = [h for h in batch if h.ok]
        assert len(done) >= 3 and all(h.result for h in done)
        rest = [h for h in batch if not h.ok]
        assert len(rest) >= 6
        _one_error_for_all(rest)
        assert all(h.attempts <= 1 for h in rest)  # no input retried against a gone server
        assert any(h.attempts == 0 for h in rest)  # pending inputs were failed, not tried
        stats = batch.stats()
        assert stats.finished == len(done) and stats.failed == len(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# -- what retries repeat -------------------------------------------------------------------------


async def test_a_400_about_the_input_is_not_retried(fake_server) -> None:
    """A prompt too long for the model is refused with 400: the same input would be
    refused again, so `retries=2` runs it once (one registration on the server)."""
    async with AsyncClient(fake_server.url) as client:
        batch = await client.submit_many(too_long, [5000], retries=2, progress=False)
        [h] = batch
        assert isinstance(h.error, APIError) and h.error.status_code == 400
        assert "maximum context length" in str(h.error)
        assert h.attempts == 1 and h.registrations == 1
        on_server = await client.list_agents()
    assert sum(r.type == "outcome_too_long" for r in on_server) == 1


async def test_a_retried_input_keeps_its_first_start_and_promise(fake_server) -> None:
    """The agent's own exception is retried; the handle then reports the whole input: JCT
    from the first run's submission, the first run's ETA and deadline, both runs."""
    _flaky_runs.clear()
    async with AsyncClient(fake_server.url) as client:
        batch = await client.submit_many(flaky, [1], retries=1, progress=False)
        [h] = batch
        assert h.status == "finished" and h.attempts == 2 and h.registrations == 2
        first_id, last_id = h.ids
        assert first_id != last_id and h.first_record is not None and h.record is not None
        assert (h.first_record.id, h.record.id) == (first_id, last_id)
        first = await client.get_agent(first_id)
        last = await client.get_agent(last_id)
    assert first.state == "failed" and last.state == "finished"
    assert last.finished_at is not None and first.submitted_at is not None
    assert last.jct_s is not None
    # JCT from the first submission: the failed first run's time is in it
    assert h.jct_s == pytest.approx(last.finished_at - first.submitted_at)
    assert h.jct_s > last.jct_s + 0.3
    # the promise is the first one given
    assert h.first_eta_s == first.first_eta_s
    assert h.first_deadline_s == deadline_of(h.first_record)
    assert h.kept_promise == (h.jct_s <= h.first_deadline_s + 1e-6)
    assert h.retried and "1 retried" in batch.summary()
    assert "runs/regs" in str([c.header for c in batch.table().columns])


# -- the batch's stats, table and metadata ---------------------------------------------------


async def test_batch_stats_summary_and_the_batch_metadata(fake_server) -> None:
    async with AsyncClient(fake_server.url) as client:
        batch = await client.submit_many(tiny, range(6), concurrency=2, progress=False)
        records = {r.id: r for r in await client.list_agents()}
    stats = batch.stats()
    assert (stats.size, stats.finished, stats.failed, stats.running, stats.pending) == (
        6, 6, 0, 0, 0)
    assert stats.judged == 6 and stats.kept == sum(h.kept_promise for h in batch)
    assert stats.eta_error_median is not None and stats.eta_error_p90 is not None
    assert stats.eta_error_median <= stats.eta_error_p90
    assert batch.eta_s() == 0.0 and stats.eta_s == 0.0
    summary = batch.summary()
    assert "6 finished" in summary and f"promises kept {stats.kept}/6" in summary
    assert "ETA error median" in summary
    for h in batch:
        assert h.id is not None
        assert records[h.id].metadata == {"batch": {"id": batch.id, "size": 6,
                                                    "index": h.index, "concurrency": 2}}
    # the final table: JCT | first ETA | first deadline | kept, for each input
    table = batch.table()
    assert [c.header for c in table.columns][3:] == ["JCT", "1st ETA", "1st deadline", "kept"]
    assert "promises kept" in str(table.caption)
    assert "promises kept" in batch._repr_html_() and "promises kept" in repr(batch)


@agent("outcome_survivor")
async def survivor() -> str:
    first = await llm("one", max_tokens=3)
    return first + await llm("two", max_tokens=300, ignore_eos=True)


@pytest.mark.slow
async def test_an_input_registered_again_after_a_restart_keeps_its_first_promise(
        tmp_path) -> None:
    """The server restarts mid-run and forgets the agent: the SDK registers it again. The
    handle follows it to the new id, and keeps the first registration's start and promise:
    its JCT spans the outage, not just the time since the second registration."""
    import sys

    import anyio

    from server.launcher import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def serve(data_dir) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _SERVE_FAKE, str(data_dir), str(port)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    procs = [serve(tmp_path / "a")]

    def kill_and_restart() -> None:
        wait_until(lambda: any(a["requests_total"] == 2 for a in httpx.get(
            url + "/v1/agents").json()["agents"]), 20)
        procs[0].kill()
        procs[0].wait(10)
        procs.append(serve(tmp_path / "b"))

    try:
        async with AsyncClient(url) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, kill_and_restart)
                batch = await client.submit_many(survivor, [()], progress=False)
            [h] = batch
            assert h.ok and len(procs) == 2
            assert h.attempts == 1 and h.registrations == 2 and h.retried
            first_id, last_id = h.ids
            assert h.first_record is not None and h.first_record.id == first_id
            assert h.id == last_id and h.record is not None and h.record.state == "finished"
            last = await client.get_agent(last_id)  # the restarted server's record
        assert last.jct_s is not None and h.first_record.submitted_at is not None
        assert h.jct_s == pytest.approx(last.finished_at - h.first_record.submitted_at)
        assert h.jct_s > last.jct_s  # the time before the restart counts
        assert h.first_deadline_s == deadline_of(h.first_record)
        assert h.kept_promise == (h.jct_s <= h.first_deadline_s + 1e-6)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
