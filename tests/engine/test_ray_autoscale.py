"""Ray Serve scales the engine replicas on the scheduler's demand: 1 -> 2 under a burst, back
to 1 in the lull after it, and M follows each step.

A local Ray cluster on loopback of this module's own (one cluster at a time on this machine:
tests/engine/test_ray.py starts and stops its own), one `justitia serve --ray ADDRESS
--replicas 1 --min-replicas 1 --max-replicas 2` on it with real vLLM replicas.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

KV_PER_REPLICA = 2048
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def cluster() -> Iterator:
    from server.engine.ray_cluster import LocalCluster

    with LocalCluster() as c:
        yield c


@pytest.fixture(scope="module")
def scaled_server(cluster, justitia_home: str) -> Iterator:
    from server.launcher import EmbeddedServer

    args = ["--ray", cluster.address, "--replicas", "1", "--min-replicas", "1", "--max-replicas", "2",
            "--kv-tokens", str(KV_PER_REPLICA), "--max-model-len", str(MAX_MODEL_LEN),
            "--data-dir", tempfile.mkdtemp(prefix="justitia-ray-scale-")]
    with EmbeddedServer(args, env={"JUSTITIA_HOME": justitia_home, "RAY_AUTH_MODE": "disabled"},
                        startup_timeout=900) as srv:
        yield srv


def m_of(url: str) -> int:
    return int(httpx.get(url + "/v1/scheduler", timeout=30).json()["M"])


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1.0)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")


def test_replicas_scale_up_under_a_burst_and_down_in_the_lull(scaled_server) -> None:
    url = scaled_server.url
    assert m_of(url) == KV_PER_REPLICA
    stop = threading.Event()
    outcomes: list[tuple[int, str]] = []

    def burst(k: int) -> None:
        # one agent per worker, requests back to back: the queued footprints are the
        # scheduler's demand, well over one replica's 2,048 KV tokens
        with httpx.Client(base_url=url, timeout=900) as c:
            agent = c.post("/v1/agents", json={"type": "burst", "prompt": f"burst {k}"}).json()["id"]
            while not stop.is_set():
                r = c.post("/v1/completions", headers={"X-Justitia-Agent": agent},
                           json={"prompt": f"burst request of worker {k}", "max_tokens": 400, "ignore_eos": True})
                outcomes.append((r.status_code, r.text[:200]))
            c.post(f"/v1/agents/{agent}/finish")

    workers = [threading.Thread(target=burst, args=(k,)) for k in range(10)]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: m_of(url) == 2 * KV_PER_REPLICA, 900, "Ray did not add a replica under the burst")
    finally:
        stop.set()
        for w in workers:
            w.join(900)
    assert outcomes and all(status == 200 for status, _ in outcomes), [o for o in outcomes if o[0] != 200][:3]
    listed = httpx.get(url + "/v1/admin/replicas", timeout=30).json()["replicas"]
    assert sum(r["state"] == "serving" for r in listed) == 2
    # The lull: nothing queued, nothing running; Ray stops one replica and M follows.
    wait_for(lambda: m_of(url) == KV_PER_REPLICA, 600, "Ray did not remove a replica in the lull")
    changes = httpx.get(url + "/v1/admin/replicas", timeout=30).json()["capacity_changes"]
    steps = [(c["replicas"], c["M"]) for c in changes]
    compressed = [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]]
    assert compressed == [(1, KV_PER_REPLICA), (2, 2 * KV_PER_REPLICA), (1, KV_PER_REPLICA)], steps
    # and the one left serves
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"prompt": "after the lull", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200, r.text
