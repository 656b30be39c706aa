"""Prefix sharing on the live server, fast tier (FakeEngine, which reports prefix-cache hits
for leading blocks an earlier prompt had): the server hashes prompts' whole blocks, counts a
common head once in admission and charges, and exports what the engine found cached."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from server.runtime.metrics import metric_value
from tests.support.clients import local_client
from tests.support.fake_engine import FakeEngine, FakeServer

HEAD = [10 + (i % 200) for i in range(256)]  # two hashing units of 128 every prompt starts with


def _completion(c: httpx.Client, agent: str, tail: int, max_tokens: int = 20) -> dict:
    r = c.post("/v1/completions", headers={"X-Justitia-Agent": agent},
               json={"prompt": HEAD + [300 + tail] * 20, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _agent(c: httpx.Client) -> str:
    r = c.post("/v1/agents", json={"type": "mapper", "prompt": "x", "predicted_cost": 1e5})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_prefix_hits_and_shared_kv_are_exported(tmp_path) -> None:
    engine = FakeEngine(step_s=0.01)
    with FakeServer(tmp_path, engine=engine) as srv, local_client(base_url=srv.url, timeout=30) as c:
        agent = _agent(c)
        _completion(c, agent, 0)
        # a parallel map over prompts with a common head: running together, they share it
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda k: _completion(c, agent, k, 60), range(1, 4)))
        text = c.get("/metrics").text
        snap = c.get("/v1/scheduler").json()
    assert metric_value(text, "justitia_prefix_cached_tokens") == 3 * 256
    assert metric_value(text, "justitia_prefix_prompt_tokens") == 4 * 276
    assert metric_value(text, "justitia_prefix_hit_rate") == snap["prefix_hit_rate"] == (3 * 256) / (4 * 276)
    # every request after the first that ran beside another holder of the head reserved it once
    assert metric_value(text, "justitia_kv_saved_tokens") == snap["kv_saved_total"] >= 256
    assert snap["reserved_kv"] == 0 and snap["kv_shared"] == 0


def test_the_nocache_ablation_hashes_nothing_and_reserves_every_prompt(tmp_path) -> None:
    with FakeServer(tmp_path, policy="justitia-nocache") as srv, \
            local_client(base_url=srv.url, timeout=30) as c:
        agent = _agent(c)
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda k: _completion(c, agent, k, 60), range(3)))
        snap = c.get("/v1/scheduler").json()
        text = c.get("/metrics").text
    assert snap["policy"] == "justitia-nocache"
    assert snap["kv_saved_total"] == 0
    # the engine still shares (vLLM's cache does not ask the scheduler): hits are reported
    assert metric_value(text, "justitia_prefix_cached_tokens") >= 256
