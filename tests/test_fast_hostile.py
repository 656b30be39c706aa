"""A hostile tenant (issue 19), on the real app over the fake engine: what one tenant does
must not move another tenant's promises."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.fake_engine import FakeEngine, FakeServer

KEYS = {"alice": "key-alice", "bob": "key-bob"}


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    engine = FakeEngine(kv_capacity_tokens=8192, max_model_len=1024)
    with FakeServer(tmp_path_factory.mktemp("hostile"), engine=engine,
                    api_keys={key: tenant for tenant, key in KEYS.items()}) as srv:
        yield srv


def _as(srv: FakeServer, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=30,
                        headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def _run_agent(c: httpx.Client, agent_type: str, prompt: str, tokens: int) -> dict:
    rec = c.post("/v1/agents", json={"type": agent_type, "prompt": prompt}).json()
    r = c.post("/v1/completions", headers={"X-Justitia-Agent": rec["id"]},
               json={"prompt": prompt, "max_tokens": tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return c.post(f"/v1/agents/{rec['id']}/finish").json()


def test_one_tenants_agents_do_not_move_another_tenants_cost_estimates(two_tenants) -> None:
    """alice finishing large agents of a type bob uses multiplied bob's predicted cost for
    the same prompt (and so his fair finish and deadline) by 1,953."""
    with _as(two_tenants, "alice") as alice, _as(two_tenants, "bob") as bob:
        prompt = "look up the capital"
        before = bob.post("/v1/agents", json={"type": "bob_type", "prompt": prompt}).json()
        for _ in range(10):
            _run_agent(alice, "bob_type", prompt * 20, 600)
        after = bob.post("/v1/agents", json={"type": "bob_type", "prompt": prompt}).json()
        assert after["predicted_cost"] == pytest.approx(before["predicted_cost"])
        assert after["cost_source"] == "cold_start"
        # alice's own estimate did learn from her agents.
        hers = alice.post("/v1/agents", json={"type": "bob_type", "prompt": prompt}).json()
        assert hers["predicted_cost"] != pytest.approx(before["predicted_cost"])


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("depth", [40, 600, 900, 995, 5000])
def test_deeply_nested_json_is_a_400_not_a_500(two_tenants, depth) -> None:
    with _as(two_tenants, "alice") as alice:
        agent = ('{"type": "deep", "prompt": "x", "metadata": {"k": ' + _nested(depth) + "}}")
        r = alice.post("/v1/agents", content=agent, headers={"content-type": "application/json"})
        assert r.status_code == 400, (depth, r.status_code, r.text[:200])
        # Past ~990 levels Python's JSON parser itself gives up: still a 400.
        assert "nested deeper than 32" in r.text or "parsing the body" in r.text
        completion = ('{"prompt": "x", "max_tokens": 1, "metadata": {"k": ' + _nested(depth)
                      + "}}")
        r = alice.post("/v1/completions", content=completion,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, (depth, r.status_code, r.text[:200])
    # Shallow metadata still works.
    with _as(two_tenants, "bob") as bob:
        ok = bob.post("/v1/agents", json={"type": "deep", "prompt": "x",
                                          "metadata": {"k": [[1, [2]], {"a": {"b": 1}}]}})
        assert ok.status_code == 201
