"""Faults on the in-process engine: the engine process dying, the server restarting, a
client reading slowly. Each test runs its own server (the shared one must stay healthy)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import psutil
import pytest

from justitia_sdk import AsyncClient, agent, current_agent, llm
from tests.streams import BackgroundStream, sse_json
from tests.waiting import wait_until


def engine_core(server) -> psutil.Process:
    children = psutil.Process(server.process.pid).children(recursive=True)
    cores = [c for c in children if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline())]
    assert cores or children, "the server has no engine process"
    return (cores or children)[0]


def test_engine_death_fails_requests_cleanly(justitia_home: str) -> None:
    """The EngineCore process is killed under a streaming request: the stream ends with an
    error, the server reports itself unhealthy, and new requests are refused at once with a
    503 that says why: nothing hangs."""
    from server.launcher import EmbeddedServer

    with EmbeddedServer(["--kv-tokens", "4096", "--max-model-len", "2048"],
                        env={"JUSTITIA_HOME": justitia_home}) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        stream = BackgroundStream(lambda: c.stream(
            "POST", "/v1/completions",
            json={"prompt": [5] * 10, "max_tokens": 2000, "ignore_eos": True, "stream": True}))
        seen = stream.events
        wait_until(lambda: seen)
        engine_core(srv).kill()
        stream.join(60)
        if "error" not in seen[-1]:
            pytest.skip("the 2000 tokens were generated before the engine was killed")
        assert "engine" in seen[-1]["error"]["message"]
        wait_until(lambda: c.get("/healthz").status_code == 503, limit_s=30)
        assert c.get("/readyz").status_code == 503
        started = time.monotonic()
        r = c.post("/v1/completions", json={"prompt": "after", "max_tokens": 4})
        assert r.status_code == 503 and "engine" in r.json()["detail"]
        assert time.monotonic() - started < 10
        r = c.post("/v1/agents", json={"type": "late", "prompt": "x"})
        assert r.status_code in (201, 503)


@agent("restart_agent")
async def two_steps(gate: threading.Event) -> int:
    await llm("before the restart", max_tokens=2, ignore_eos=True)
    await asyncio.to_thread(gate.wait)
    await llm("after the restart", max_tokens=3, ignore_eos=True)
    run = current_agent()
    assert run is not None
    return run.reregistrations


def test_restart_keeps_history_and_agents_re_register(justitia_home: str, tmp_path) -> None:
    """Finished agents survive a restart in the history. An agent running across the restart
    gets a clear 404 for its old id from raw HTTP; through the SDK it registers again and
    carries on (the refused request ran nothing, so resending it is safe)."""
    from server.launcher import EmbeddedServer, free_port

    port = free_port()
    args = ["--kv-tokens", "4096", "--max-model-len", "2048", "--data-dir", str(tmp_path)]
    env = {"JUSTITIA_HOME": justitia_home}
    srv = EmbeddedServer(args, port=port, env=env).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            done = c.post("/v1/agents", json={"type": "survivor", "prompt": "x"}).json()
            assert c.post("/v1/completions", headers={"X-Justitia-Agent": done["id"]},
                          json={"prompt": "x", "max_tokens": 3}).status_code == 200
            assert c.post(f"/v1/agents/{done['id']}/finish").status_code == 200

        gate = threading.Event()
        outcome: dict = {}

        async def run_agent() -> None:
            async with AsyncClient(srv.url, max_retries=8) as client:
                outcome["result"] = await client.run(two_steps, gate)

        t = threading.Thread(target=lambda: asyncio.run(run_agent()))
        t.start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            running = wait_until(lambda: [a for a in c.get("/v1/agents").json()["agents"]
                                          if a["type"] == "restart_agent" and a["requests_done"] == 1])
        old_id = running[0]["id"]
        srv.stop()
        srv = EmbeddedServer(args, port=port, env=env).start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/completions", headers={"X-Justitia-Agent": old_id},
                       json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 404 and old_id in r.json()["detail"]
            gate.set()
            t.join(120)
            assert outcome["result"] == 1
            agents = c.get("/v1/agents").json()["agents"]
            again = [a for a in agents if a["type"] == "restart_agent"]
            assert len(again) == 1 and again[0]["id"] != old_id
            assert again[0]["state"] == "finished" and again[0]["requests_done"] == 1
            history = c.get("/v1/history", params={"agent_type": "survivor"}).json()["samples"]
            assert [s["agent_id"] for s in history] == [done["id"]]
    finally:
        gate.set()
        srv.stop()


def test_a_slow_reader_holds_up_nobody(client: httpx.Client, server) -> None:
    """A streaming client stops reading after its first chunk and only reads on once other
    agents' requests have completed: they must not wait for it (if the server stalled on
    the slow reader, they would hang), and it still gets its whole output."""
    slow_chunks: list[dict] = []
    paused, others_done = threading.Event(), threading.Event()

    def slow() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c, c.stream(
                "POST", "/v1/completions",
                json={"prompt": [3] * 10, "max_tokens": 1500, "ignore_eos": True,
                      "stream": True}) as s:
            events = sse_json(s)
            slow_chunks.append(next(events))
            paused.set()
            others_done.wait(120)
            slow_chunks.extend(events)

    t = threading.Thread(target=slow)
    t.start()
    try:
        assert paused.wait(60)
        for _ in range(3):
            r = client.post("/v1/completions", json={"prompt": "quick", "max_tokens": 8,
                                                     "ignore_eos": True}, timeout=60)
            assert r.status_code == 200
    finally:
        others_done.set()
        t.join(120)
    assert slow_chunks[-1]["usage"]["completion_tokens"] == 1500
    assert slow_chunks[-1]["choices"][0]["finish_reason"] == "length"
