"""Justitia on Ray Serve: a local Ray cluster on loopback, two real vLLM engine replicas.

One cluster for the module (started here, stopped here: its processes are this module's
children, so nothing else on the machine is touched), one `justitia serve --ray ADDRESS
--replicas 2` on it. The fast tier never imports Ray (tests/api/test_ray_adapter.py).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

# Starting Ray and two engines takes minutes on a busy 2-core machine: a budget above the
# engine tier's default for the module's tests (the first one starts them).
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

REPLICAS = 2
KV_TOKENS = 8192  # M: 4,096 per replica
MAX_MODEL_LEN = 1024
@pytest.fixture(scope="module")
def cluster() -> Iterator:
    """A local Ray cluster on loopback (no token, a small object store), stopped at the end
    with every process of it (server/engine/ray_cluster.py)."""
    from server.engine.ray_cluster import LocalCluster

    with LocalCluster() as c:
        yield c


@pytest.fixture(scope="module")
def ray_server(cluster, justitia_home: str) -> Iterator:
    from server.launcher import EmbeddedServer

    args = ["--ray", cluster.address, "--replicas", str(REPLICAS), "--kv-tokens", str(KV_TOKENS),
            "--max-model-len", str(MAX_MODEL_LEN), "--data-dir", tempfile.mkdtemp(prefix="justitia-ray-")]
    with EmbeddedServer(args, env={"JUSTITIA_HOME": justitia_home, "RAY_AUTH_MODE": "disabled"},
                        startup_timeout=900) as srv:
        yield srv


def snapshot(url: str) -> dict:
    return httpx.get(url + "/v1/scheduler", timeout=30).json()


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")


def test_agents_run_on_the_replicas_with_m_their_sum(ray_server) -> None:
    url = ray_server.url
    assert snapshot(url)["M"] == KV_TOKENS
    with httpx.Client(base_url=url, timeout=300) as c:
        agent = c.post("/v1/agents", json={"type": "ray-test", "prompt": "x"}).json()
        headers = {"X-Justitia-Agent": agent["id"]}
        import concurrent.futures

        def one(i: int) -> dict:
            r = c.post("/v1/completions", headers=headers, json={
                "prompt": f"request {i} of an agent on Ray", "max_tokens": 48, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(one, range(6)))
        assert all(o["usage"]["completion_tokens"] == 48 for o in outs)
        done = c.post(f"/v1/agents/{agent['id']}/finish").json()
        assert done["state"] == "finished" and done["requests_done"] == 6
    snap = snapshot(url)
    assert snap["reserved_kv"] == 0 and snap["running_requests"] == 0
    # The replicas' steps reached the scheduler's time model: one model per replica that ran
    # a step, named by its id (reports come twice a second; a fit counts its samples once it
    # refits, every 32 steps, and each replica that ran these requests stepped 48 times at least)
    replicas = {r["id"] for r in httpx.get(url + "/v1/admin/replicas", timeout=30).json()["replicas"]}

    def fitted() -> dict:
        engines = snapshot(url)["time_model"]["engines"]
        return {name: m for name, m in engines.items() if m["samples"] > 0}

    wait_for(lambda: fitted(), 10, "no step sample of the replicas reached the time model")
    engines = fitted()
    assert set(engines) <= replicas, (engines.keys(), replicas)
    assert set(snapshot(url)["time_model"]["engines"]) <= replicas


def test_an_abandoned_request_is_aborted_on_its_replica(ray_server) -> None:
    url = ray_server.url
    body = {"prompt": "a long answer nobody waits for", "max_tokens": MAX_MODEL_LEN - 64,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks += 1
                if chunks >= 3:
                    break  # the client leaves mid-stream
    # The replica's engine frees the request (its reports reach the scheduler every 0.5 s);
    # left running, it would take many seconds more to produce ~960 tokens.
    wait_for(lambda: snapshot(url)["engine"]["running"] == 0 and snapshot(url)["reserved_kv"] == 0,
             20, "the abandoned request was not aborted on its replica")


def test_a_killed_replica_leaves_m_and_comes_back_and_no_request_hangs(ray_server, cluster) -> None:
    import concurrent.futures

    from server.engine.ray_cluster import engine_replicas

    url = ray_server.url
    replicas = engine_replicas(cluster.process.pid)
    assert len(replicas) == REPLICAS

    def one(i: int) -> tuple[int, str]:
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "prompt": f"request {i} while a replica dies", "max_tokens": 400, "ignore_eos": True})
        return r.status_code, r.text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(3)
        victim = replicas[0]
        for proc in [victim, *victim.children(recursive=True)]:  # as a crashed node loses them
            proc.kill()
        outcomes = [f.result(timeout=600) for f in futures]  # none hangs
    for status, text in outcomes:
        # finished, or failed with an error that names the cause
        assert status == 200 or ("replica" in text and "died" in text), (status, text)
    wait_for(lambda: snapshot(url)["M"] == KV_TOKENS // REPLICAS, 30, "M did not lose the dead replica")
    wait_for(lambda: snapshot(url)["M"] == KV_TOKENS, 600, "M did not regain the replaced replica")
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"prompt": "after the replacement", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_a_killed_scheduler_comes_back_onto_the_running_replicas(ray_server, cluster) -> None:
    """The scheduler's process is killed (SIGKILL) while an SDK batch runs: the engine
    replicas, Ray Serve's, outlive it; a new scheduler started the same way (what a
    supervisor does) finds the running application and schedules onto it, and the batch
    carries on (the SDK registers its running agents again and resends what failed)."""
    import anyio

    from justitia_sdk import AsyncClient, agent, llm, parallel_map
    from server.engine.ray_cluster import engine_replicas
    from server.launcher import EmbeddedServer

    url = ray_server.url
    before = {p.pid for p in engine_replicas(cluster.process.pid)}
    assert len(before) == REPLICAS

    @agent("ray_survivor")
    async def two_steps(i: int) -> int:
        parts = await parallel_map(lambda k: llm(f"agent {i} part {k}", max_tokens=48, ignore_eos=True), range(2))
        return len(parts)

    state: dict = {}

    async def run_batch() -> None:
        async with AsyncClient(url, server_gone_s=600) as client:
            state["batch"] = await client.submit_many(two_steps, range(24), retries=2, progress=False)

    runner = threading.Thread(target=lambda: anyio.run(run_batch), daemon=True)
    runner.start()
    wait_for(lambda: sum(a["state"] == "finished" for a in httpx.get(
        url + "/v1/agents", params={"limit": 1000}, timeout=30).json()["agents"]) >= 4, 600,
        "the batch did not get going")
    ray_server.process.kill()
    ray_server.process.wait(30)
    started = time.monotonic()
    again = EmbeddedServer(ray_server.args, port=ray_server.port, env=ray_server.env, startup_timeout=600)
    with again:
        reattached_s = time.monotonic() - started
        assert snapshot(url)["M"] == KV_TOKENS
        assert {p.pid for p in engine_replicas(cluster.process.pid)} == before  # the same replicas
        listed = httpx.get(url + "/v1/admin/replicas", timeout=30).json()["replicas"]
        assert len(listed) == REPLICAS and all(r["state"] == "serving" for r in listed)
        runner.join(900)
        batch = state["batch"]
        errors = [h.error for h in batch if h.error is not None]
        assert all(h.ok or h.error is not None for h in batch)  # none lost: finished or failed, with why
        assert sum(h.ok for h in batch) == len(batch), errors[:3]
    print(f"scheduler back on the running replicas in {reattached_s:.0f} s")
