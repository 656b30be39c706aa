"""What a tenant can make the server hold is bounded (docs/reliability.md, "Memory and disk"):
agents' metadata is kept as compact JSON and limited, ended agents let go of their prompt
and large metadata, the history is bounded in rows and bytes and read in pages bounded in
bytes, and an agent's end that cannot be made durable is refused, not acknowledged."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import httpx
import pytest

from server.runtime.agents import AgentEntry, RequestLog
from server.runtime.history import History
from tests.support.fake_engine import FakeServer
from tests.support.waiting import wait_until

# 21,700 empty objects: 65 KB of JSON, 1.5 MB as Python dicts and a list.
LIST_OF_EMPTY_OBJECTS = [{}] * 21_700
AGENTS = 40
TRACED = 5  # registrations measured with tracemalloc (slow under it)


def _finished(i: int, prompt: str = "", tenant: str = "default", agent_type: str = "hist") -> AgentEntry:
    entry = AgentEntry(id=f"agt-{i:06d}", type=agent_type, tenant=tenant, prompt=prompt,
                       metadata={"i": i}, submitted_at=1000.0 + i, submitted_mono=0.0,
                       predicted_cost=1.0)
    entry.requests = [RequestLog(request_id=f"r{i}", prompt_tokens=10, output_tokens=5,
                                 submitted_s=0.0, admitted_s=0.1, finished_s=0.5,
                                 finish_reason="length")]
    entry.state = "finished"
    entry.finished_at = 1001.0 + i
    return entry


def _run_one_request(c: httpx.Client, agent_id: str) -> None:
    r = c.post("/v1/completions", headers={"X-Justitia-Agent": agent_id},
               json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200, r.text


# -- memory -------------------------------------------------------------------------------

def _deep_size(obj: object, seen: set[int] | None = None) -> int:
    """Bytes of `obj` and of the containers and values it holds (dicts, lists, strings, bytes,
    an object's attributes); callables and other objects count for their own size only."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(_deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__dict__") and not callable(obj) and type(obj).__module__.startswith("server"):
        size += _deep_size(vars(obj), seen)
    return size


@pytest.mark.slow
def test_agents_with_large_metadata_hold_their_json_size_not_24x_it(tmp_path) -> None:
    """A list of 21,700 empty objects is held as compact JSON, the agent's 65 KB, not as
    1.5 MB of dicts (300 such agents: ~470 MB; benchmarks/memory_bounds.py measures 300 in
    a server process)."""
    body = json.dumps({"type": "meta", "prompt": "x", "metadata": {"rows": LIST_OF_EMPTY_OBJECTS}},
                      separators=(",", ":"))
    with FakeServer(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=60,
                                                   headers={"Content-Type": "application/json"}) as c:
        assert c.post("/v1/agents", content=body).status_code == 201  # warm every code path
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(TRACED):
                r = c.post("/v1/agents", content=body)
                assert r.status_code == 201, r.text
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        for _ in range(AGENTS - TRACED - 1):
            assert c.post("/v1/agents", content=body).status_code == 201
        entries = list(srv.app.state.scheduler.agents.values())
        held = sum(_deep_size(e) for e in entries)
        rec = c.get(f"/v1/agents/{entries[-1].id}").json()
        assert rec["metadata"] == {"rows": LIST_OF_EMPTY_OBJECTS}  # all there, read back whole
    assert len(entries) == AGENTS
    # 65 KB of JSON each, and what else an agent holds: well under 100 KB an agent
    assert held < AGENTS * 100_000, f"{AGENTS} agents hold {held / 2**20:.0f} MiB"
    assert grown < TRACED * 200_000, f"{TRACED} agents grew the process by {grown / 2**20:.0f} MiB"


def test_an_ended_agent_lets_go_of_its_prompt_and_large_metadata(tmp_path) -> None:
    with FakeServer(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        big = c.post("/v1/agents", json={"type": "t", "prompt": "p" * 20_000,
                                          "metadata": {"notes": "n" * 5000, "stages": 1}}).json()
        small = c.post("/v1/agents", json={"type": "t", "prompt": "q" * 20_000,
                                            "metadata": {"source": "test"}}).json()
        for rec in (big, small):
            _run_one_request(c, rec["id"])
            assert c.post(f"/v1/agents/{rec['id']}/finish").status_code == 200
        agents = srv.app.state.scheduler.agents
        assert agents[big["id"]].prompt == "" and agents[small["id"]].prompt == ""
        assert agents[big["id"]].metadata_json == b"{}"
        big_rec = c.get(f"/v1/agents/{big['id']}").json()
        assert big_rec["metadata"] == {} and big_rec["metadata_dropped"] is True
        small_rec = c.get(f"/v1/agents/{small['id']}").json()
        assert small_rec["metadata"] == {"source": "test"} and small_rec["metadata_dropped"] is False
        # The history keeps all of it.
        row = srv.app.state.history.get(big["id"])
        assert row["prompt"] == "p" * 20_000 and row["metadata"]["notes"] == "n" * 5000


def test_metadata_over_its_limit_is_a_413_naming_the_limit(tmp_path) -> None:
    keys = {"key-alice": "alice", "key-bob": "bob"}
    with FakeServer(tmp_path, api_keys=keys, max_metadata_bytes=1000,
                    tenant_max_metadata_bytes={"bob": None},
                    tenant_max_agent_bytes={"alice": 50_000}) as srv:
        alice = httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": "Bearer key-alice"})
        bob = httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": "Bearer key-bob"})
        with alice, bob:
            meta = {"notes": "n" * 2000}
            r = alice.post("/v1/agents", json={"type": "t", "metadata": meta})
            assert r.status_code == 413, r.text
            assert "--max-metadata-bytes" in r.json()["detail"] and "1000" in r.json()["detail"]
            assert bob.post("/v1/agents", json={"type": "t", "metadata": meta}).status_code == 201
            assert alice.post("/v1/agents", json={"type": "t", "metadata": {"n": 1}}).status_code == 201
            # An agent larger than the tenant's whole --max-agent-bytes can never fit: 413.
            huge = alice.post("/v1/agents", json={"type": "t", "prompt": "p" * 60_000})
            assert huge.status_code == 413 and "--max-agent-bytes" in huge.json()["detail"]


# -- history ------------------------------------------------------------------------------

def test_the_history_keeps_at_most_its_rows_and_bytes_dropping_the_oldest(tmp_path) -> None:
    rows = History(tmp_path / "rows.sqlite3", max_rows=50)
    for i in range(120):
        rows.record(_finished(i))
    rows.flush()
    kept = [s["agent_id"] for s in rows.samples("hist")]
    assert len(kept) <= 50 and kept[-1] == "agt-000119"
    assert kept == sorted(kept) and rows.count() == rows.rows == len(kept)
    rows.close()

    sized = History(tmp_path / "bytes.sqlite3", max_bytes=200_000)
    for i in range(60):
        sized.record(_finished(i, prompt="p" * 10_000))
    sized.flush()
    kept = [s["agent_id"] for s in sized.samples("hist")]
    assert 10 <= len(kept) <= 20 and kept[-1] == "agt-000059"
    assert sized.bytes <= 200_000
    sized.close()
    reopened = History(tmp_path / "bytes.sqlite3", max_bytes=200_000)
    assert reopened.rows == len(kept) and reopened.bytes <= 200_000
    reopened.close()


def _all_pages(c: httpx.Client, **params: object) -> tuple[list[str], list[int]]:
    ids, sizes, cursor = [], [], None
    while True:
        r = c.get("/v1/history", params={**params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        sizes.append(len(r.content))
        page = r.json()
        ids += [s["agent_id"] for s in page["samples"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return ids, sizes


def test_a_history_page_is_bounded_in_bytes_and_continues_at_its_cursor(tmp_path) -> None:
    with FakeServer(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        history = srv.app.state.history
        for i in range(300):  # 300 rows of a 64 KiB prompt: ~20 MB of samples
            history.record(_finished(i, prompt=f"{i:05d}" + "x" * (64 * 1024 - 5)))
        history.flush()
        first = c.get("/v1/history")
        assert len(first.content) <= 16 << 20 and first.json()["next_cursor"] is not None
        ids, sizes = _all_pages(c)
        assert ids == [f"agt-{i:06d}" for i in range(300)] and max(sizes) <= 16 << 20
        ids, sizes = _all_pages(c, max_bytes=500_000)
        assert ids == [f"agt-{i:06d}" for i in range(300)] and max(sizes) <= 500_000
        assert len(sizes) >= 40
        # A page holds at least one sample, however small the bound; limit still counts.
        one = c.get("/v1/history", params={"max_bytes": 1}).json()
        assert len(one["samples"]) == 1 and one["next_cursor"] is not None
        ids, _ = _all_pages(c, limit=7)
        assert len(ids) == 300


# -- a full disk --------------------------------------------------------------------------

def _fill_disk(history: History) -> None:
    """The database may not grow any more: each write fails as on a full disk."""
    with history._lock:
        pages = history._db.execute("PRAGMA page_count").fetchone()[0]
        history._db.execute(f"PRAGMA max_page_count = {pages}")


def test_a_finish_that_cannot_be_made_durable_is_refused_and_acknowledged_once_written(tmp_path) -> None:
    with FakeServer(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        history = srv.app.state.history
        _fill_disk(history)
        first = c.post("/v1/agents", json={"type": "full", "prompt": "x" * 5000}).json()
        second = c.post("/v1/agents", json={"type": "full", "prompt": "y"}).json()
        for rec in (first, second):
            _run_one_request(c, rec["id"])
        r = c.post(f"/v1/agents/{first['id']}/finish")
        assert r.status_code == 503, r.text
        assert r.json()["detail"].startswith("history cannot be written: ")
        assert "full" in r.json()["detail"]
        ready = c.get("/readyz")
        assert ready.status_code == 503 and "history cannot be written" in ready.json()["detail"]
        # Refused before anything changes: the second agent stays live.
        r = c.delete(f"/v1/agents/{second['id']}")
        assert r.status_code == 503
        assert c.get(f"/v1/agents/{second['id']}").json()["state"] == "paused"
        # Asked again while its row waits: refused again.
        assert c.post(f"/v1/agents/{first['id']}/finish").status_code == 503
        with history._lock:
            history._db.execute("PRAGMA max_page_count = 1073741823")
        wait_until(lambda: c.get("/readyz").status_code == 200, 40)
        again = c.post(f"/v1/agents/{first['id']}/finish")
        assert again.status_code == 200 and again.json()["state"] == "finished"
        assert c.post(f"/v1/agents/{second['id']}/finish").status_code == 200
        assert c.post(f"/v1/agents/{second['id']}/finish").status_code == 409  # acknowledged once
        kept = {s["agent_id"] for s in c.get("/v1/history", params={"agent_type": "full"}).json()["samples"]}
        assert kept == {first["id"], second["id"]}


_SERVER_SCRIPT = textwrap.dedent("""
    import sys, time
    from tests.support.fake_engine import FakeServer
    srv = FakeServer(sys.argv[1], retrain_every=0).start()  # no retraining process
    print(srv.url, flush=True)
    for line in sys.stdin:
        if line.strip() == "full":
            history = srv.app.state.history
            with history._lock:
                pages = history._db.execute("PRAGMA page_count").fetchone()[0]
                history._db.execute(f"PRAGMA max_page_count = {pages}")
            print("full", flush=True)
    time.sleep(3600)
""")


@pytest.mark.slow
def test_a_kill_while_the_disk_is_full_loses_no_acknowledged_finish(tmp_path) -> None:
    data = tmp_path / "data"
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, str(data)], cwd=root,
                            env={**os.environ, "PYTHONPATH": root}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    acknowledged, refused = set(), set()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        url = proc.stdout.readline().strip()
        with httpx.Client(base_url=url, timeout=30) as c:

            def one(i: int) -> None:
                rec = c.post("/v1/agents", json={"type": "kill", "prompt": f"p{i}"}).json()
                _run_one_request(c, rec["id"])
                r = c.post(f"/v1/agents/{rec['id']}/finish")
                assert r.status_code in (200, 503), r.text
                (acknowledged if r.status_code == 200 else refused).add(rec["id"])

            for i in range(10):
                one(i)
            proc.stdin.write("full\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "full"
            for i in range(10, 40):
                one(i)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9, and nothing of it left behind
        proc.wait(30)
    assert len(acknowledged) >= 10 and len(refused) >= 20  # a row may fit in a free page
    history = History(data / "history.sqlite3")
    kept = {s["agent_id"] for s in history.samples("kill")}
    history.close()
    assert acknowledged <= kept, f"{len(acknowledged - kept)} acknowledged finishes lost"


def test_rows_waiting_for_a_retry_are_bounded_keeping_those_a_caller_waits_for(tmp_path) -> None:
    history = History(tmp_path / "h.sqlite3")
    history.max_unwritten_rows = 5
    _fill_disk(history)
    waited = [history.record(_finished(i, prompt="x" * 5000)) for i in range(3)]
    for i in range(3, 20):
        history.record(_finished(i, prompt="x" * 5000), urgent=False)
    history.flush()
    assert all(w.exception() is not None for w in waited)
    assert history.unwritten <= 5 and history.dropped >= 15
    assert all(history.unwritten_agent(f"agt-{i:06d}") for i in range(3))
    with history._lock:
        history._db.execute("PRAGMA max_page_count = 1073741823")
    history.close()  # writes what is kept
    reopened = History(tmp_path / "h.sqlite3")
    assert {f"agt-{i:06d}" for i in range(3)} <= {s["agent_id"] for s in reopened.samples("hist")}
    reopened.close()


# -- the data dir -------------------------------------------------------------------------

def _read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write: a read-only mount as root, else chmod 0500."""
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() != 0:
        target.chmod(0o500)
        return target
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                          capture_output=True)
    if done.returncode != 0:
        # a container's root without CAP_SYS_ADMIN: no read-only mount can be made, and
        # file modes do not stop root, so there is no unwritable directory to test with
        pytest.skip("no read-only directory can be made here (root, but mounting is not permitted)")
    return target


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["read-only", "under-a-file"])
def test_a_data_dir_that_cannot_be_written_stops_the_start_with_one_line(tmp_path, kind) -> None:
    if kind == "read-only":
        data = _read_only_dir(tmp_path)
    else:
        (tmp_path / "file").write_text("not a directory")
        data = tmp_path / "file" / "data"
    try:
        root = str(Path(__file__).resolve().parents[2])
        done = subprocess.run([sys.executable, "-m", "justitia_cli", "serve", "--data-dir", str(data),
                               "--port", "1"], cwd=root, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": root,
                                   "JUSTITIA_HOME": str(tmp_path / "home")})
    finally:
        if kind == "read-only" and os.geteuid() == 0:
            subprocess.run(["umount", str(data)], capture_output=True)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(data) in lines[0] and "cannot be written" in lines[0] and "--data-dir" in lines[0]
    assert "engine" not in done.stderr.lower()
