"""Faults on the in-process engine: the engine process dying (and being restarted), the
server dying or restarting, seeded requests under load, a client reading slowly. Tests that
kill something run their own server (the shared one must stay healthy)."""

from __future__ import annotations

import asyncio
import os
import random
import threading

import httpx
import psutil

from justitia_sdk import AsyncClient, agent, current_agent, llm
from tests.support.streams import BackgroundStream, sse_json
from tests.support.waiting import all_agents, wait_until


def engine_core(vllm_server) -> psutil.Process:
    """The server's EngineCore process (vLLM names it VLLM::EngineCore)."""
    children = psutil.Process(vllm_server.process.pid).children(recursive=True)
    cores = [c for c in children if "EngineCore" in c.name()]
    assert len(cores) == 1, f"expected one EngineCore among {[c.name() for c in children]}"
    return cores[0]


def kill_engine_core(vllm_server) -> int:
    core = engine_core(vllm_server)
    core.kill()
    return core.pid


def _thread_cores(pid: int) -> set[int]:
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return cores


def test_the_api_process_and_engine_core_keep_off_the_workers_cores(vllm_server) -> None:
    """vLLM pins its CPU worker to its own cores but not the other processes: the API process
    and the EngineCore must not run there (the OS put them there now and then, and every
    engine step waited: the same schedule ran 12-23% slower from one start to the next)."""
    children = psutil.Process(vllm_server.process.pid).children(recursive=True)
    workers = [c for c in children if "Worker" in c.name()]
    assert workers, f"no vLLM worker among {[c.name() for c in children]}"
    pinned = set().union(*(set(w.cpu_affinity()) for w in workers))
    machine = os.sched_getaffinity(0)
    api, core = _thread_cores(vllm_server.process.pid), _thread_cores(engine_core(vllm_server).pid)
    if machine - pinned:  # another core to run on: neither may touch the worker's
        assert not api & pinned and not core & pinned, (pinned, api, core)
    else:  # a single core: there is nowhere else to go, so both keep it
        assert api == core == machine, (pinned, api, core)


def completion(c: httpx.Client, **body) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})


def test_a_dead_engine_is_restarted_then_the_server_exits_when_restarts_run_out(
        justitia_home: str) -> None:
    """The EngineCore is killed under a running stream while another request waits in the
    queue: the stream ends with an error naming the engine, /readyz says 503 `restarting`
    (/healthz 200, the server heals itself), the queued request waits and completes once
    the engine is back, and new completions are served. Killed again with no restart left
    (`--engine-restarts 1`), the server exits with status 69 and leaves no engine process."""
    from server.api.app import EXIT_ENGINE_FAILED
    from server.launcher import EmbeddedServer

    # One request at a time, so that the second one waits in the scheduler's queue.
    args = ["--kv-tokens", "4096", "--max-model-len", "4096", "--max-num-seqs", "1",
            "--engine-restarts", "1"]
    with EmbeddedServer(args, env={"JUSTITIA_HOME": justitia_home}) as srv, \
            httpx.Client(base_url=srv.url, timeout=180) as c:
        stream = BackgroundStream(lambda: c.stream(
            "POST", "/v1/completions",
            json={"prompt": [5] * 10, "max_tokens": 4000, "ignore_eos": True, "stream": True}))
        seen = stream.events
        wait_until(lambda: seen)
        queued: dict = {}
        waiter = threading.Thread(target=lambda: queued.update(
            r=completion(c, prompt="queued", max_tokens=3, ignore_eos=True)))
        waiter.start()
        wait_until(lambda: c.get("/v1/scheduler").json()["pending_requests"] == 1,
                   show=lambda: (c.get("/v1/scheduler").json(), len(seen), seen[-1]))
        old_pid = kill_engine_core(srv)
        stream.join(60)
        assert "error" in seen[-1], "the 4000 tokens were generated before the kill"
        assert "engine" in seen[-1]["error"]["message"]

        ready = wait_until(lambda: (r := c.get("/readyz")).json()["status"] == "restarting" and r,
                           limit_s=30)
        assert ready.status_code == 503 and "restart 1 of 1" in ready.json()["detail"]
        health = c.get("/healthz")
        assert health.status_code == 200 and health.json()["status"] in ("restarting", "ok")

        wait_until(lambda: c.get("/readyz").status_code == 200, limit_s=180)
        waiter.join(60)
        assert queued["r"].status_code == 200, queued["r"].text
        assert queued["r"].json()["usage"]["completion_tokens"] == 3
        r = completion(c, prompt="after the restart", max_tokens=5, ignore_eos=True)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert c.get("/healthz").json() == {"status": "ok"}
        assert engine_core(srv).pid != old_pid

        children = psutil.Process(srv.process.pid).children(recursive=True)
        kill_engine_core(srv)
        assert srv.process.wait(90) == EXIT_ENGINE_FAILED
        wait_until(lambda: not [p for p in children if _alive(p)], limit_s=30,
                   show=lambda: [(p.pid, p.name()) for p in children if _alive(p)])


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_the_engine_dies_with_a_killed_server(justitia_home: str) -> None:
    """SIGKILL of the API process (no shutdown code runs) still takes its EngineCore and
    worker processes down: they watch it (server/engine/cpu_worker.py).

    Before that, where they run: in the caller's session, in a process group of their own
    (killpg reaches all of them, a terminal's Ctrl-C does not). Linux's autogroup scheduler
    shares the CPU between sessions: in a session of its own, the engine's spinning
    processes starved the caller for seconds while it generated (the flake of the restart
    test above; benchmarks/session_placement.py)."""
    from server.launcher import EmbeddedServer

    with EmbeddedServer(["--kv-tokens", "4096", "--max-model-len", "2048"],
                        env={"JUSTITIA_HOME": justitia_home}) as srv:
        pid = srv.process.pid
        assert os.getsid(pid) == os.getsid(0) and os.getpgid(pid) == pid != os.getpgid(0)
        engine = engine_core(srv)
        assert os.getsid(engine.pid) == os.getsid(0) and os.getpgid(engine.pid) == pid
        children = psutil.Process(srv.process.pid).children(recursive=True)
        assert any("EngineCore" in p.name() for p in children)
        srv.process.kill()
        srv.process.wait(10)
        wait_until(lambda: not [p for p in children if _alive(p)], limit_s=30,
                   show=lambda: [(p.pid, p.name()) for p in children if _alive(p)])


def test_seeded_requests_under_load_are_served_and_reproducible(vllm_server) -> None:
    """20 concurrent completions, half with a `seed`, with prompts long enough that vLLM
    prefills some of them in chunks: all succeed (the CPU engine must not die here with
    `CPU Generator does not use offset`), and each seeded request gives the same text when
    sent again alone (its prompt then comes from the prefix cache in one piece)."""
    rnd = random.Random(7)
    bodies = [{"prompt": [rnd.randrange(3, 500) for _ in range(rnd.randrange(400, 1700))],
               "max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
               **({"seed": 1000 + i} if i % 2 == 0 else {})} for i in range(20)]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=300) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    answers = asyncio.run(send_all())
    assert [r.status_code for r in answers] == [200] * 20, [r.text for r in answers if r.status_code != 200]
    with httpx.Client(base_url=vllm_server.url, timeout=120) as c:
        assert c.get("/readyz").status_code == 200
        for body, answer in zip(bodies, answers, strict=True):
            if "seed" in body:
                again = c.post("/v1/completions", json=body)
                assert again.json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]
        # A different seed draws differently (the seed is really used).
        other = c.post("/v1/completions", json={**bodies[0], "seed": 1})
        assert other.json()["choices"][0]["text"] != answers[0].json()["choices"][0]["text"]


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
            running = wait_until(lambda: [a for a in all_agents(c)
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
            agents = all_agents(c)
            again = [a for a in agents if a["type"] == "restart_agent"]
            assert len(again) == 1 and again[0]["id"] != old_id
            assert again[0]["state"] == "finished" and again[0]["requests_done"] == 1
            history = c.get("/v1/history", params={"agent_type": "survivor"}).json()["samples"]
            assert [s["agent_id"] for s in history] == [done["id"]]
    finally:
        gate.set()
        srv.stop()


def test_a_slow_reader_holds_up_nobody(vllm_client: httpx.Client, vllm_server) -> None:
    """A streaming client stops reading after its first chunk and only reads on once other
    agents' requests have completed: they must not wait for it (if the server stalled on
    the slow reader, they would hang), and it still gets its whole output."""
    slow_chunks: list[dict] = []
    paused, others_done = threading.Event(), threading.Event()

    def slow() -> None:
        with httpx.Client(base_url=vllm_server.url, timeout=120) as c, c.stream(
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
            r = vllm_client.post("/v1/completions", json={"prompt": "quick", "max_tokens": 8,
                                                     "ignore_eos": True}, timeout=60)
            assert r.status_code == 200
    finally:
        others_done.set()
        t.join(120)
    assert slow_chunks[-1]["usage"]["completion_tokens"] == 1500
    assert slow_chunks[-1]["choices"][0]["finish_reason"] == "length"

