"""Sessions on the fake engine (fast tier): OpenAI requests that carry a session header and
no agent tag join one implicit agent per (tenant, session); header precedence, validation,
tenancy and the idle finish. The engine-tier twin is in test_openai_compat.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.clients import local_client
from tests.support.fake_engine import FakeEngine, FakeServer
from tests.support.waiting import all_agents, wait_until

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-9876543210"}
IDLE_S = 0.6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    engine = FakeEngine(kv_capacity_tokens=2048, max_model_len=512)
    with FakeServer(tmp_path_factory.mktemp("sessions"), engine=engine, session_idle_s=IDLE_S,
                    api_keys={key: tenant for tenant, key in KEYS.items()}) as srv:
        yield srv


def client(server: FakeServer, tenant: str = "alice") -> httpx.Client:
    return local_client(base_url=server.url, timeout=30.0,
                        headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def complete(c: httpx.Client, headers: dict[str, str], max_tokens: int = 4, **body) -> httpx.Response:
    return c.post("/v1/completions", headers=headers,
                  json={"prompt": "fix the failing test", "max_tokens": max_tokens, "ignore_eos": True, **body})


def session_agents(c: httpx.Client, session: str) -> list[dict]:
    return [a for a in all_agents(c) if a.get("session") == session]


def new_session() -> str:
    return f"s-{uuid.uuid4()}"


def test_requests_of_one_session_join_one_agent(server: FakeServer) -> None:
    s = new_session()
    with client(server) as c:
        for _ in range(3):
            r = complete(c, {"session-id": s})
            assert r.status_code == 200, r.text
        (agent,) = session_agents(c, s)
    assert agent["type"] == "session" and agent["session"] == s
    assert agent["requests_total"] == 3 and agent["requests_done"] == 3
    assert agent["state"] == "paused"  # alive (between requests) until idle for --session-idle-s
    # scheduled like any agent: a predicted cost, an ETA and a bound
    assert agent["predicted_cost"] > 0 and agent["delay_bound_s"] > 0 and agent["eta_s"] >= 0
    assert agent["cost_source"] in ("model", "cold_start", "fallback")
    # what it consumed is charged (the over-run rule): its charge covers its real work
    assert agent["consumed_cost"] > 0
    assert agent["charged_cost"] >= min(agent["consumed_cost"], agent["predicted_cost"])


def test_streamed_and_chat_requests_join_the_session_too(server: FakeServer) -> None:
    s = new_session()
    with client(server) as c:
        assert complete(c, {"x-claude-code-session-id": s}).status_code == 200
        chat = c.post("/v1/chat/completions", headers={"x-claude-code-session-id": s},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert chat.status_code == 200, chat.text
        with c.stream("POST", "/v1/completions", headers={"x-claude-code-session-id": s},
                      json={"prompt": "go on", "max_tokens": 3, "stream": True}) as r:
            assert r.status_code == 200
            assert "[DONE]" in r.read().decode()
        (agent,) = session_agents(c, s)
    assert agent["requests_done"] == 3


def test_a_session_of_token_id_prompts_is_predicted_and_served(server: FakeServer) -> None:
    s = new_session()
    with client(server) as c:
        for _ in range(2):
            r = complete(c, {"session-id": s}, prompt=[5, 6, 7, 8])
            assert r.status_code == 200, r.text
        (agent,) = session_agents(c, s)
    assert agent["requests_done"] == 2 and agent["predicted_cost"] > 0


@pytest.mark.parametrize("header", ["X-Session-Id", "session-id", "x-session-affinity", "x-claude-code-session-id",
                                    "x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id"])
def test_every_session_header_names_a_session(server: FakeServer, header: str) -> None:
    s = new_session()
    with client(server) as c:
        assert complete(c, {header: s}).status_code == 200
        assert len(session_agents(c, s)) == 1


def test_the_first_session_header_present_wins(server: FakeServer) -> None:
    first, second, third = new_session(), new_session(), new_session()
    with client(server) as c:
        # DESIGN order: X-Session-Id, session-id, x-session-affinity, ...
        every = {"x-session-affinity": third, "session-id": second, "X-Session-Id": first}
        assert complete(c, every).status_code == 200
        assert complete(c, {"x-llm-d-inference-fairness-id": third, "session-id": second}).status_code == 200
        # an empty header counts as absent
        assert complete(c, {"X-Session-Id": "", "x-session-affinity": third}).status_code == 200
        assert [a["requests_done"] for a in session_agents(c, first)] == [1]
        assert [a["requests_done"] for a in session_agents(c, second)] == [1]
        assert [a["requests_done"] for a in session_agents(c, third)] == [1]


def test_an_agent_tag_wins_over_a_session_header(server: FakeServer) -> None:
    s = new_session()
    with client(server) as c:
        agent = c.post("/v1/agents", json={"type": "tagged", "prompt": "p"}).json()
        assert complete(c, {"X-Justitia-Agent": agent["id"], "session-id": s}).status_code == 200
        assert complete(c, {"session-id": s}, agent_id=agent["id"]).status_code == 200
        assert c.get(f"/v1/agents/{agent['id']}").json()["requests_done"] == 2
        assert session_agents(c, s) == []  # no session agent was made


def test_the_agent_type_header_sets_the_sessions_type(server: FakeServer) -> None:
    s = new_session()
    with client(server) as c:
        h = {"session-id": s, "X-Justitia-Agent-Type": "coding_agent"}
        assert complete(c, h).status_code == 200
        assert complete(c, h).status_code == 200
        (agent,) = session_agents(c, s)
    assert agent["type"] == "coding_agent" and agent["requests_done"] == 2


@pytest.mark.parametrize("headers, needle", [
    ({"session-id": "s", "X-Justitia-Agent-Type": "has space"}, "X-Justitia-Agent-Type"),
    ({"session-id": "x" * 257}, "at most 256"),
    ({"x-session-affinity": "tab\there"}, "printable"),
])
def test_malformed_session_headers_are_400s(server: FakeServer, headers: dict[str, str], needle: str) -> None:
    with client(server) as c:
        r = complete(c, headers)
    assert r.status_code == 400, r.text
    assert needle in r.text


def test_a_session_id_never_joins_another_tenants_agent(server: FakeServer) -> None:
    s = new_session()
    with client(server, "alice") as alice, client(server, "bob") as bob:
        assert complete(alice, {"session-id": s}).status_code == 200
        assert complete(bob, {"session-id": s}).status_code == 200
        assert complete(bob, {"session-id": s}).status_code == 200
        (mine,) = session_agents(alice, s)
        (theirs,) = session_agents(bob, s)
        assert mine["id"] != theirs["id"]
        assert (mine["tenant"], mine["requests_done"]) == ("alice", 1)
        assert (theirs["tenant"], theirs["requests_done"]) == ("bob", 2)
        assert alice.get(f"/v1/agents/{theirs['id']}").status_code == 404


def test_an_idle_session_is_finished_and_a_new_request_starts_a_new_agent(server: FakeServer) -> None:
    s = new_session()
    with client(server) as c:
        assert complete(c, {"session-id": s}).status_code == 200
        (first,) = session_agents(c, s)
        finished = wait_until(lambda: (r := c.get(f"/v1/agents/{first['id']}").json())["state"] == "finished" and r,
                              limit_s=10.0)
        assert finished["requests_done"] == 1 and finished["session"] == s
        # idle means no request in flight and none for IDLE_S: it was not finished early
        assert finished["finished_at"] - finished["submitted_at"] >= IDLE_S
        assert complete(c, {"session-id": s}).status_code == 200
        agents = session_agents(c, s)
    assert len(agents) == 2
    second = next(a for a in agents if a["id"] != first["id"])
    assert second["state"] == "paused" and second["requests_done"] == 1


def test_a_session_with_a_request_in_flight_is_not_finished(tmp_path) -> None:
    # a slow engine: one request of 120 tokens lasts ~2.4 s, eight times the idle setting
    engine = FakeEngine(kv_capacity_tokens=2048, max_model_len=512, step_s=0.02)
    with FakeServer(tmp_path, engine=engine, session_idle_s=0.3) as srv, \
            local_client(base_url=srv.url, timeout=30.0) as c, ThreadPoolExecutor(1) as pool:
        s = new_session()
        long = pool.submit(complete, c, {"session-id": s}, 120)
        (agent,) = wait_until(lambda: session_agents(c, s))
        time.sleep(1.6)  # past the idle setting and at least one housekeeping round
        assert not long.done()
        rec = c.get(f"/v1/agents/{agent['id']}").json()
        assert rec["state"] in ("queued", "running") and rec["requests_in_flight"] == 1
        assert long.result().status_code == 200
        # once idle, it is finished with its one request done
        done = wait_until(lambda: (r := c.get(f"/v1/agents/{agent['id']}").json())["state"] == "finished" and r,
                          limit_s=10.0)
        assert done["requests_done"] == 1


def test_the_sdk_sees_a_session_agents_session(server: FakeServer) -> None:
    from justitia_sdk import Client

    s = new_session()
    with client(server) as c:
        assert complete(c, {"x-session-affinity": s}).status_code == 200
    with Client(server.url, api_key=KEYS["alice"]) as sdk:
        mine = [r for r in sdk.list_agents() if r.session == s]
    assert len(mine) == 1 and mine[0].type == "session" and mine[0].requests_done == 1


def test_the_server_runs_las_with_its_options(tmp_path) -> None:
    # `justitia serve --policy las --las-half-life-s 30 --las-head-wait-weight 0.5`, on the fake engine
    with FakeServer(tmp_path, policy="las", las_half_life_s=30.0, las_head_wait_weight=0.5) as srv, \
            local_client(base_url=srv.url, timeout=30.0) as c, ThreadPoolExecutor(8) as pool:
        policy = srv.app.state.scheduler.dispatcher.policy
        assert (policy.name, policy.half_life_s, policy.head_wait_weight) == ("las", 30.0, 0.5)
        sessions = [new_session() for _ in range(4)]
        outs = list(pool.map(lambda s: complete(c, {"session-id": s}, max_tokens=20), sessions * 2))
        assert all(r.status_code == 200 for r in outs)
        assert c.get("/v1/scheduler").json()["policy"] == "las"
        assert [len(session_agents(c, s)) for s in sessions] == [1] * 4
        assert all(session_agents(c, s)[0]["requests_done"] == 2 for s in sessions)


def test_a_session_that_outgrows_its_prediction_is_charged_for_it(server: FakeServer) -> None:
    # The over-run rule, as for any agent: work beyond the prediction is charged to its tag.
    s = new_session()
    with client(server) as c:
        assert complete(c, {"session-id": s}, max_tokens=1).status_code == 200
        (first,) = session_agents(c, s)
        for _ in range(8):
            if session_agents(c, s)[0]["consumed_cost"] > first["predicted_cost"]:
                break
            assert complete(c, {"session-id": s}, max_tokens=200, prompt="x" * 300).status_code == 200
        (agent,) = session_agents(c, s)
    assert agent["id"] == first["id"] and agent["consumed_cost"] > agent["predicted_cost"]
    assert agent["charged_cost"] >= agent["consumed_cost"] - 1e-6
    assert agent["virtual_finish"] > first["virtual_finish"]
