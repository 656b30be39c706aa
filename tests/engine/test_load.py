"""A smaller run of benchmarks/load_test.py in the suite: hundreds of agents and thousands of
requests at once through the real server lose nothing, and the scheduler's accounting is back
to zero afterwards. (The full 1,000-agent / 10,000-request run with memory across rounds is
the benchmark; its figures are in docs/reliability.md.)"""

from __future__ import annotations

import asyncio

import httpx

from benchmarks.load_test import one_round
from tests.support.waiting import all_agents


def test_two_thousand_requests_lose_nothing(vllm_client: httpx.Client, vllm_server) -> None:
    agents, per_agent = 200, 10
    before = {a["id"] for a in all_agents(vllm_client)}
    # other tests' agents may still be open on this shared server: only requests must drain
    stats = asyncio.run(one_round(vllm_server.url, agents, per_agent, concurrency=64, max_tokens=2,
                                  settled_keys=("pending_requests", "running_requests",
                                                "reserved_kv")))
    assert stats.failures == {} and stats.requests_ok == agents * per_agent
    snap = stats.after
    assert snap["pending_requests"] == snap["running_requests"] == snap["reserved_kv"] == 0
    mine = [a for a in all_agents(vllm_client)
            if a["id"] not in before and a["type"].startswith("load")]
    assert len(mine) == agents
    assert all(a["state"] == "finished" and a["requests_done"] == per_agent for a in mine)
