"""What a newcomer meets first, on the real server: large batches, failed and
cancelled agents, interrupts, results as they complete, timeouts and retries."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import anyio
import httpx
import pytest

from justitia_sdk import AsyncClient, Client, agent, llm, parallel_map
from justitia_sdk._errors import AgentCancelledError, AgentTimeoutError
from tests.support.waiting import all_agents, wait_until

pytestmark = pytest.mark.anyio


@agent("robust_tiny")
async def tiny(i: int) -> str:
    return await llm(f"say {i}", max_tokens=2)


@agent("robust_slow")
async def slow(i: int, tokens: int = 400) -> str:
    return await llm(f"count to {i}", max_tokens=tokens, ignore_eos=True)


class Flaky(Exception):
    pass


_flaky_calls: dict[int, int] = {}


@agent("robust_long")
async def long_run(i: int) -> str:
    """Several long requests one after another: many seconds, whatever the engine's speed."""
    out = ""
    for k in range(6):
        out += await llm(f"go on {i} {k}", max_tokens=1800, ignore_eos=True)
    return out


@agent("robust_flaky")
async def flaky(i: int) -> str:
    _flaky_calls[i] = _flaky_calls.get(i, 0) + 1
    text = await llm(f"try {i}", max_tokens=2)
    if _flaky_calls[i] == 1:
        raise Flaky(f"first try of {i}")
    return text


@agent("robust_partial")
async def partial(n: int) -> list[str]:
    """Fails after some of its requests: a cancelled or failed run's cost is partial."""
    async def one(k: int) -> str:
        if k == n - 1:
            await anyio.sleep(0.2)
            raise Flaky("the last branch failed")
        return await llm(f"branch {k}", max_tokens=4)

    return await parallel_map(one, range(n))


def _history_ids(vllm_server, agent_type: str) -> set[str]:
    body = httpx.get(f"{vllm_server.url}/v1/history", params={"agent_type": agent_type}).json()
    return {s["agent_id"] for s in body["samples"]}


async def test_a_batch_of_150_agents_finishes_with_the_default_settings(vllm_server) -> None:
    """One event stream watches the whole batch: 100 streams, one per agent, would fill a
    100-connection pool, completions could not connect and the batch would deadlock."""
    started = time.monotonic()
    async with AsyncClient(vllm_server.url) as client:
        batch = await client.submit_many(tiny, list(range(150)), progress=True)
    assert [h.status for h in batch].count("finished") == 150, batch.summary()
    assert all(h.record is not None and h.record.state == "finished" for h in batch)
    assert time.monotonic() - started < 180


async def test_a_failed_agent_is_recorded_failed_with_its_error_and_is_no_sample(vllm_server) -> None:
    async with AsyncClient(vllm_server.url) as client:
        batch = await client.submit_many(partial, [4], progress=False)
        record = await client.get_agent(batch[0].id)
    assert batch[0].status == "failed" and isinstance(batch[0].error, Flaky)
    assert record.state == "failed" and record.error == "Flaky: the last branch failed"
    assert record.jct_s is None
    assert batch[0].id not in _history_ids(vllm_server, "robust_partial")


def test_the_finish_call_takes_an_error_and_failed_agents_are_terminal(vllm_client) -> None:
    rec = vllm_client.post("/v1/agents", json={"type": "robust_api", "prompt": "x"}).json()
    r = vllm_client.post(f"/v1/agents/{rec['id']}/finish", json={"error": "E" * 5000})
    assert r.status_code == 200 and r.json()["state"] == "failed"
    assert r.json()["error"] == "E" * 2000
    again = vllm_client.post(f"/v1/agents/{rec['id']}/finish")
    assert again.status_code == 409
    bad = vllm_client.post("/v1/agents", json={"type": "robust_api", "prompt": "x"}).json()
    assert vllm_client.post(f"/v1/agents/{bad['id']}/finish", json={"err": "x"}).status_code in (400, 422)
    listed = all_agents(vllm_client, state="failed")
    assert rec["id"] in {a["id"] for a in listed}


async def test_cancelled_agents_end_cancelled_and_are_no_samples(vllm_server) -> None:
    async with AsyncClient(vllm_server.url) as client:
        inputs = [{"i": k} for k in range(3)]
        async with client.batch(long_run, inputs, progress=False) as batch:
            with anyio.fail_after(60):
                while sum(h.id is not None for h in batch) < 3:
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)  # their requests are in the engine
            batch.cancel()
        ids = [h.id for h in batch if h.id]
        records = [await client.get_agent(i) for i in ids]
    assert ids and all(r.state == "cancelled" for r in records), [(r.state, r.requests_done, r.error) for r in records]
    assert all(isinstance(h.error, AgentCancelledError) and h.status == "cancelled" for h in batch)
    assert not set(ids) & _history_ids(vllm_server, "robust_long")


def test_ctrl_c_in_the_sync_client_cancels_the_batch_on_the_server_and_keeps_results(vllm_server) -> None:
    """Ctrl-C cancels the batch's agents on the server (not left to their lease)."""
    inputs = [{"i": 0, "tokens": 2}, {"i": 1, "tokens": 2}] + [{"i": k} for k in range(2, 12)]
    with Client(vllm_server.url) as client:
        def interrupt_once_two_finished() -> None:
            wait_until(lambda: client.last_batch is not None
                       and sum(h.ok for h in client.last_batch) >= 2, 120)
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

        threading.Thread(target=interrupt_once_two_finished, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            client.submit_many(slow, inputs, progress=False, concurrency=4)
        batch = client.last_batch
        assert batch is not None and len(batch) == 12
        finished = [h for h in batch if h.ok]
        assert len(finished) >= 2 and all(isinstance(h.result, str) for h in finished)
        assert all(h.done for h in batch)
        started = [h.id for h in batch if h.id and not h.ok]
        assert started, [(h.status, h.id, h.error) for h in batch]
        # At once: every one of them is already cancelled on the server.
        states = {client.get_agent(i).state for i in started}
        assert states == {"cancelled"}, states


def test_sync_as_completed_yields_runs_as_they_end(vllm_server) -> None:
    with Client(vllm_server.url) as client:
        seen = []
        for handle in client.as_completed([long_run, slow], [{"i": 0}, {"i": 1, "tokens": 2}],
                                          progress=False):
            seen.append((handle.index, handle.status))
    assert seen == [(1, "finished"), (0, "finished")]


def test_leaving_as_completed_early_cancels_the_rest(vllm_server) -> None:
    with Client(vllm_server.url) as client:
        # The others run for many seconds whatever the engine's speed: they cannot finish
        # between the first result and the cancellation (1,800 tokens once did, in CI).
        inputs = [{"i": 0, "tokens": 2}, {"i": 1}, {"i": 2}]
        for handle in client.as_completed([slow, long_run, long_run], inputs, progress=False):
            assert handle.index == 0
            break
        batch = client.last_batch
        rest = [h for h in batch if h.index != 0]
        assert all(isinstance(h.error, AgentCancelledError) for h in rest), [
            (h.status, h.error) for h in rest]
        # both were registered on the server (they ran for a while), and both ended cancelled there
        assert len(rest) == 2 and all(h.id for h in rest), [(h.index, h.id) for h in rest]
        assert [client.get_agent(h.id).state for h in rest] == ["cancelled", "cancelled"]


async def test_async_batch_context_gives_results_as_they_complete(vllm_server) -> None:
    async with AsyncClient(vllm_server.url) as client:
        order = []
        async with client.batch([long_run, slow], [{"i": 0}, {"i": 1, "tokens": 2}],
                                progress=False) as batch:
            async for handle in batch.as_completed():
                order.append(handle.index)
    assert order == [1, 0] and batch.done


async def test_per_agent_timeout_cancels_the_run_on_the_server(vllm_server) -> None:
    async with AsyncClient(vllm_server.url) as client:
        batch = await client.submit_many([long_run, slow], [{"i": 0}, {"i": 1, "tokens": 2}],
                                         timeout=1.5, progress=False)
        assert batch[1].status == "finished"
        assert batch[0].status == "timed out" and isinstance(batch[0].error, AgentTimeoutError)
        assert isinstance(batch[0].error, TimeoutError)
        record = await client.get_agent(batch[0].id)
    assert record.state == "cancelled"


async def test_retries_run_a_failed_input_again(vllm_server) -> None:
    _flaky_calls.clear()
    async with AsyncClient(vllm_server.url) as client:
        batch = await client.submit_many(flaky, [7, 8], retries=1, progress=False)
        assert [h.status for h in batch] == ["finished", "finished"]
        assert [h.attempts for h in batch] == [2, 2]
        without = await client.submit_many(flaky, [9], progress=False)
    assert without[0].status == "failed" and without[0].attempts == 1


def test_multiplexed_event_stream_sends_each_agents_changes(vllm_client, vllm_server) -> None:
    """GET /v1/agents/events: one stream for many agents (what a batch watches)."""
    a = vllm_client.post("/v1/agents", json={"type": "robust_watch", "prompt": "a"}).json()["id"]
    b = vllm_client.post("/v1/agents", json={"type": "robust_watch", "prompt": "b"}).json()["id"]
    seen: dict[str, list[str]] = {a: [], b: []}

    def read() -> None:
        with httpx.stream("GET", f"{vllm_server.url}/v1/agents/events", params={"ids": f"{a},{b}"},
                          timeout=30) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data:"):
                    rec = json.loads(line[5:])
                    seen[rec["id"]].append(rec["state"])
                    if all(s and s[-1] in ("finished", "cancelled") for s in seen.values()):
                        return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: seen[a] and seen[b], 30)  # the live records come first
    vllm_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                headers={"X-Justitia-Agent": a})
    vllm_client.post(f"/v1/agents/{a}/finish")
    vllm_client.delete(f"/v1/agents/{b}")
    reader.join(30)
    assert not reader.is_alive(), seen
    assert seen[a][0] == "queued" and seen[a][-1] == "finished"
    assert seen[b][-1] == "cancelled"
    assert vllm_client.get("/v1/agents/events", params={"ids": ""}).status_code == 400
    too_many = ",".join(f"agt-{i}" for i in range(1001))
    assert vllm_client.get("/v1/agents/events", params={"ids": too_many}).status_code == 400
