"""The agent API and live scheduling, a contract suite: every test runs on the fake engine
and on vLLM (the `server` fixture's two parameters), through the same HTTP calls. What only
the fake can show exactly (token-exact costs, a fresh server's first promise) is in
test_api.py; what only vLLM has (a trained predictor's announcement) in
tests/engine/test_agents_api.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.runtime.metrics import metric_value
from server.scheduler import kv_cost
from tests.support.agents import (
    RECORD_FIELDS,
    complete,
    core_views,
    promise_clauses,
    register,
    scheduler_idle,
)
from tests.support.clients import local_client
from tests.support.fake_engine import FakeServer
from tests.support.servers import ENGINE_KV_TOKENS
from tests.support.streams import BackgroundStream, sse_json
from tests.support.waiting import all_agents, wait_until


def test_eta_and_bound_are_the_cores_for_the_same_registrations(client: httpx.Client) -> None:
    """The promises the server makes (fair finish, ETA, bound, deadline) are what the
    scheduler core, as the simulator drives it, computes for the same agents registered at
    the same moments with the server's M, tau and bound limits."""
    costs = [4e5, 1.5e6, 1e5, 8e5]
    # The bound is stated against the largest agent cost seen so far: one cancelled agent
    # of the largest cost here fixes it for the registrations that follow.
    primer = register(client, type_="eta_primer", predicted_cost=max(costs))
    client.delete(f"/v1/agents/{primer['id']}")
    wait_until(lambda: client.get("/v1/scheduler").json()["backlog"] == 0, limit_s=120)
    assert client.post("/v1/admin/pause").json() == {"paused": True}
    try:
        before = client.get("/v1/scheduler").json()
        recs = [register(client, type_=f"eta_agent{i}", predicted_cost=c)
                for i, c in enumerate(costs)]
        after = client.get("/v1/scheduler").json()
    finally:
        client.post("/v1/admin/resume")
    assert before["limits"] == after["limits"] and before["tau"] == after["tau"]
    for rec, view in zip(recs, core_views(after, recs, costs), strict=True):
        # agents without a request are not in the GPS reference: each is projected alone
        for key in ("fair_finish_s", "delay_bound_s"):
            assert rec[key] == pytest.approx(getattr(view, key), rel=0.02, abs=0.01), key
        # the server may know more (arrivals the core did not see): never fewer reasons
        assert promise_clauses(view.promise_reason) <= promise_clauses(rec["promise_reason"])
        assert rec["promise"] == view.promise or rec["promise"] == "widened"
        # ETAs and deadlines also count the work the server saw arrive (measured off the
        # request path): never less than the core's without it
        assert rec["deadline_s"] >= view.deadline_s - 0.01
        assert rec["eta_s"] > 0
    assert recs[2]["fair_finish_s"] < recs[0]["fair_finish_s"]  # the smallest finishes first
    for rec in recs:
        client.delete(f"/v1/agents/{rec['id']}")


def test_register_returns_a_complete_record(client: httpx.Client) -> None:
    rec = register(client, prompt="verify: the river flows through three countries")
    assert RECORD_FIELDS <= rec.keys()
    assert rec["state"] == "queued"
    assert rec["predicted_cost"] > 0
    assert rec["virtual_finish"] > 0
    assert rec["fair_finish_s"] > 0 and rec["eta_s"] > 0 and rec["delay_bound_s"] > 0
    # the deadline was promised at registration: at least the ETA (a calibrated multiple of
    # it, never past the worst case of the GPS finish plus the bound, stretched by the work
    # expected to arrive ahead), saying what it rests on; the ETA is projected at the read
    assert rec["eta_s"] - 0.5 <= rec["deadline_s"] < 1e6
    assert rec["promise_assumes"] is None or isinstance(rec["promise_assumes"], str)
    assert rec["promise"] in ("firm", "widened") and isinstance(rec["promise_reason"], str)
    assert rec["finished_at"] is None
    assert client.get(f"/v1/agents/{rec['id']}").json()["id"] == rec["id"]
    assert rec["id"] in {a["id"] for a in all_agents(client)}
    client.delete(f"/v1/agents/{rec['id']}")


def test_agent_lifecycle_accounts_every_request(client: httpx.Client) -> None:
    rec = register(client, type_="lifecycle_agent")
    sizes = [(5, 8), (9, 3), (20, 12)]
    prompt_tokens = []
    for words, n in sizes:
        r = complete(client, rec["id"], n, prompt="word " * words)
        assert r.status_code == 200, r.text
        prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
    mid = client.get(f"/v1/agents/{rec['id']}").json()
    assert mid["state"] == "paused"  # running, between its requests
    assert mid["requests_total"] == mid["requests_done"] == 3
    expected = sum(kv_cost(p, d) for p, (_, d) in zip(prompt_tokens, sizes, strict=True))
    assert mid["consumed_cost"] == pytest.approx(expected)

    done = client.post(f"/v1/agents/{rec['id']}/finish").json()
    assert done["state"] == "finished"
    assert done["finished_at"] >= done["submitted_at"]
    assert done["jct_s"] == pytest.approx(done["finished_at"] - done["submitted_at"])

    samples = client.get("/v1/history", params={"agent_type": "lifecycle_agent"}).json()["samples"]
    [mine] = [s for s in samples if s["agent_id"] == rec["id"]]
    assert mine["cost"] == pytest.approx(expected)
    assert mine["features"]["n_requests"] == 3
    assert mine["features"]["output_tokens"] == sum(d for _, d in sizes)


def test_unknown_and_closed_agents_are_refused(client: httpx.Client) -> None:
    r = complete(client, "agt-doesnotexist", 2)
    assert r.status_code == 404 and "agt-doesnotexist" in r.json()["detail"]
    assert client.get("/v1/agents/agt-doesnotexist").status_code == 404
    assert client.post("/v1/agents/agt-doesnotexist/finish").status_code == 404
    assert client.delete("/v1/agents/agt-doesnotexist").status_code == 404

    rec = register(client)
    assert client.post(f"/v1/agents/{rec['id']}/finish").status_code == 200
    r = complete(client, rec["id"], 2)
    assert r.status_code == 409 and "finished" in r.json()["detail"]
    assert client.post(f"/v1/agents/{rec['id']}/finish").status_code == 409
    assert client.delete(f"/v1/agents/{rec['id']}").status_code == 409


def test_bad_registrations_are_400(client: httpx.Client) -> None:
    for body in ({"prompt": "no type"}, {"type": "", "prompt": "x"},
                 {"type": "has space", "prompt": "x"}, {"type": "t", "prompt": 5},
                 {"type": "t", "lease_s": -1}, {"type": "t", "predicted_cost": -5}):
        r = client.post("/v1/agents", json=body)
        assert r.status_code == 400, (body, r.text)
        assert isinstance(r.json()["detail"], str)


def test_header_and_body_agent_ids_must_agree(client: httpx.Client) -> None:
    a, b = register(client), register(client)
    r = client.post("/v1/completions", headers={"X-Justitia-Agent": a["id"]},
                         json={"prompt": "x", "max_tokens": 2, "agent_id": b["id"]})
    assert r.status_code == 400
    r = client.post("/v1/completions",
                         json={"prompt": "x", "max_tokens": 2, "agent_id": b["id"]})
    assert r.status_code == 200
    assert client.get(f"/v1/agents/{b['id']}").json()["requests_done"] == 1
    assert client.get(f"/v1/agents/{a['id']}").json()["requests_done"] == 0
    for x in (a, b):
        client.delete(f"/v1/agents/{x['id']}")


def test_untagged_request_becomes_a_finished_default_agent(client: httpx.Client) -> None:
    before = {a["id"] for a in all_agents(client)}
    r = complete(client, None, 4)
    assert r.status_code == 200, r.text
    new = [a for a in all_agents(client) if a["id"] not in before]
    assert len(new) == 1
    assert new[0]["type"] == "default" and new[0]["state"] == "finished"
    assert new[0]["requests_done"] == 1
    assert new[0]["consumed_cost"] == pytest.approx(kv_cost(r.json()["usage"]["prompt_tokens"], 4))


def test_smaller_tag_is_admitted_first_under_contention(client: httpx.Client) -> None:
    """With admission paused, four blocker requests (footprint p + max_tokens = 1000 tokens,
    rounded to 1024 = a quarter of the KV cache), then a large agent's request, then a small
    agent's, all queue. On resume the blockers fill the cache. The shortest blocker ends
    first and frees room for exactly one request: the small agent (smaller virtual finish
    tag) must get it although it arrived last, and finish before the large one, which only
    gets the small one's room. Engine steps advance every running request in lockstep, so
    the order does not depend on timing."""
    blocker_cost = kv_cost(800, 200) + 3 * kv_cost(100, 900)  # exactly what it will use
    blocker = register(client, prompt="blocker", predicted_cost=blocker_cost)
    big = register(client, prompt="long document", predicted_cost=20 * blocker_cost)
    small = register(client, prompt="short", predicted_cost=2 * blocker_cost)
    assert blocker["virtual_finish"] < small["virtual_finish"] < big["virtual_finish"]
    finished: list[str] = []
    lock = threading.Lock()

    def run(agent: dict, name: str, p: int, d: int) -> None:
        r = complete(client, agent["id"], d, prompt=[5 + len(name)] * p)
        assert r.status_code == 200, r.text
        with lock:
            finished.append(name)

    def queued(agent: dict, n: int):
        # Each agent's own count, not the global backlog: the order of arrival is the point.
        return lambda: client.get(f"/v1/agents/{agent['id']}").json()["requests_total"] == n

    def state() -> dict:
        return {"scheduler": client.get("/v1/scheduler").json(), "finished": finished}

    wait_until(lambda: scheduler_idle(client), show=state)
    assert client.post("/v1/admin/pause").json() == {"paused": True}
    try:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(run, blocker, f"blocker{d}", 1000 - d, d)
                       for d in (200, 900, 900, 900)]
            wait_until(queued(blocker, 4), show=state)
            futures.append(pool.submit(run, big, "big", 900, 100))
            wait_until(queued(big, 1), show=state)
            futures.append(pool.submit(run, small, "small", 900, 100))
            wait_until(queued(small, 1), show=state)
            snap = client.get("/v1/scheduler").json()
            assert snap["pending_requests"] == 6 and snap["running_requests"] == 0, snap
            client.post("/v1/admin/resume")
            for f in futures:
                f.result(timeout=300)
    finally:
        client.post("/v1/admin/resume")
    order = (finished.index("blocker200"), finished.index("small"), finished.index("big"))
    assert order[0] < order[1] < order[2], state()
    for a in (blocker, big, small):
        client.post(f"/v1/agents/{a['id']}/finish")
    wait_until(lambda: scheduler_idle(client))


def test_justitia_keeps_the_engine_free_of_preemptions(client: httpx.Client, server) -> None:
    """Accurate footprints (ignore_eos: d = max_tokens) and non-preemptive admission: many
    agents over-subscribe the KV cache several times, and vLLM never has to preempt."""
    before = metric_value(client.get("/metrics").text, "justitia_engine_preemptions")
    agents = [register(client, prompt=f"agent {i} " * (i + 1)) for i in range(6)]

    def run(agent: dict) -> int:
        total = 0
        for _ in range(2):
            r = complete(client, agent["id"], 150, prompt=[7] * 300)
            assert r.status_code == 200, r.text
            total += r.json()["usage"]["completion_tokens"]
        return total

    with ThreadPoolExecutor(12) as pool:
        totals = list(pool.map(run, agents + agents))
    assert totals == [300] * 12
    after = metric_value(client.get("/metrics").text, "justitia_engine_preemptions")
    assert after == before
    if isinstance(server, FakeServer):  # the fake also shows that they did share the engine
        assert server.engine.peak_running > 1
    for a in agents:
        assert client.post(f"/v1/agents/{a['id']}/finish").json()["requests_done"] == 4
    wait_until(lambda: scheduler_idle(client))


def test_cancel_fails_queued_requests_and_aborts_running_ones(client: httpx.Client, server) -> None:
    rec = register(client)
    # queued: admission paused, three requests wait; cancelling fails each with 409
    results: list[httpx.Response] = []

    def run() -> None:
        results.append(complete(client, rec["id"], 50, prompt=[5] * 20))

    client.post("/v1/admin/pause")
    try:
        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: client.get(f"/v1/agents/{rec['id']}").json()["requests_total"] == 3)
        r = client.delete(f"/v1/agents/{rec['id']}")
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        for t in threads:
            t.join(60)
    finally:
        client.post("/v1/admin/resume")
    assert [x.status_code for x in results] == [409, 409, 409]
    assert "cancelled" in results[0].json()["detail"]

    # running: a streaming request has produced its first token when the agent is cancelled;
    # the engine aborts it long before its 2000 tokens
    # (an idle engine can produce all 2,000 tokens before the cancel lands: then it is tried
    # again, and the early finishes are reported if every attempt loses the race)
    finishes = []
    for _ in range(3):
        rec = register(client)
        chunks: list[dict] = []
        with local_client(base_url=server.url, timeout=60) as c:
            body = {"prompt": [6] * 10, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body,
                          headers={"X-Justitia-Agent": rec["id"]}) as stream:
                for chunk in sse_json(stream):
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        assert client.delete(f"/v1/agents/{rec['id']}").status_code == 200
        if "error" in chunks[-1]:
            break
        finishes.append(chunks[-1])
    assert "error" in chunks[-1], finishes
    assert "cancelled" in chunks[-1]["error"]["message"], chunks[-2:]
    reasons = [ch["choices"][0]["finish_reason"] for ch in chunks if "choices" in ch]
    assert reasons[-1] == "abort", reasons[-3:]  # the engine aborted it before its 2000 tokens
    wait_until(lambda: scheduler_idle(client))
    wait_until(lambda: client.get("/v1/scheduler").json()["engine"]["running"] == 0, 30)


def test_client_disconnect_aborts_its_request(client: httpx.Client, server) -> None:
    early: list[str] = []
    for _ in range(3):
        rec = register(client)
        try:
            r = httpx.post(server.url + "/v1/completions", headers={"X-Justitia-Agent": rec["id"]},
                           json={"prompt": [5] * 10, "max_tokens": 2000, "ignore_eos": True},
                           timeout=httpx.Timeout(120, read=0.2))
        except httpx.ReadTimeout:
            break  # the client gave up while the request ran
        # An answer before the client's timeout (seen once in CI, cause not recorded): keep
        # it for the failure message and try again.
        early.append(f"{r.status_code}: {r.text[:300]}")
        client.post(f"/v1/agents/{rec['id']}/finish")
    else:
        pytest.fail(f"the request was always answered before the client's timeout: {early}")
    # The request is gone from the scheduler and the engine long before its 2,000 tokens.
    wait_until(lambda: client.get(f"/v1/agents/{rec['id']}").json()["requests_in_flight"] == 0, 20)
    done = client.get(f"/v1/agents/{rec['id']}").json()
    assert done["requests_done"] == 1
    hist_cost = done["consumed_cost"]
    assert hist_cost < kv_cost(10, 2000)
    wait_until(lambda: scheduler_idle(client))
    client.post(f"/v1/agents/{rec['id']}/finish")


def test_events_stream_follows_the_agent_to_its_end(client: httpx.Client,
                                                    server) -> None:
    rec = register(client)
    stream = BackgroundStream(lambda: httpx.stream(
        "GET", f"{server.url}/v1/agents/{rec['id']}/events", timeout=30))
    events = stream.events
    wait_until(lambda: events, limit_s=20)
    assert complete(client, rec["id"], 3).status_code == 200
    client.post(f"/v1/agents/{rec['id']}/finish")
    stream.join(20)
    assert stream.error is None and stream.content_type.startswith("text/event-stream")
    assert events[0]["state"] == "queued" and events[-1]["state"] == "finished"
    assert max(e["requests_done"] for e in events) == 1
    assert client.get("/v1/agents/agt-none/events").status_code == 404


def test_idle_agent_expires_after_its_lease(client: httpx.Client) -> None:
    rec = register(client, lease_s=0.5)
    assert complete(client, rec["id"], 2).status_code == 200
    wait_until(lambda: client.get(f"/v1/agents/{rec['id']}").json()["state"] == "expired",
               limit_s=20)
    r = complete(client, rec["id"], 2)
    assert r.status_code == 409 and "expired" in r.json()["detail"]


def test_scheduler_snapshot_and_metrics(client: httpx.Client) -> None:
    assert complete(client, None, 3).status_code == 200
    snap = client.get("/v1/scheduler").json()
    assert snap["policy"] == "justitia" and snap["paused"] is False
    assert snap["M"] == ENGINE_KV_TOKENS
    assert snap["tau"] > 0 and snap["V"] >= 0
    assert {"kv_usage", "running", "waiting", "preemptions_total", "dtype"} <= snap["engine"].keys()
    text = client.get("/metrics").text
    assert metric_value(text, "justitia_kv_capacity_tokens") == ENGINE_KV_TOKENS
    assert metric_value(text, "justitia_agents", {"state": "finished"}) >= 1


def test_record_says_where_its_cost_came_from(client: httpx.Client) -> None:
    """The default server has no trained predictor: a type's cost is the cold start's,
    unless the caller declares it; an untagged OpenAI request is charged its own size."""
    from justitia_sdk._models import AgentRecord

    declared = register(client, type_="cost_declared", predicted_cost=12345.0)
    assert declared["cost_source"] == "declared" and declared["predicted_cost"] == 12345.0
    guessed = register(client, type_="cost_unseen_type")
    assert guessed["cost_source"] == "cold_start"
    assert client.get(f"/v1/agents/{guessed['id']}").json()["cost_source"] == "cold_start"
    assert AgentRecord.model_validate(guessed).cost_source == "cold_start"
    # a guess: the promise allows for its p90, and says so; a declared cost is taken as is
    assert guessed["predicted_cost_p90"] > 3 * guessed["predicted_cost"]
    assert guessed["promise"] == "widened" and "p90" in guessed["promise_reason"]
    assert declared["predicted_cost_p90"] is None and "p90" not in declared["promise_reason"]
    for rec in (declared, guessed):
        client.delete(f"/v1/agents/{rec['id']}")
    before = {a["id"] for a in all_agents(client)}
    assert complete(client, None, 4).status_code == 200
    new = [a for a in all_agents(client) if a["id"] not in before]
    assert [a["cost_source"] for a in new] == ["request"]


def test_an_agent_between_its_requests_is_paused_for_as_long_as_it_waits(client: httpx.Client) -> None:
    """A running agent with no request in flight (a tool call) is `paused`: its record says
    since when and for how long, the metrics count it, its next request makes it running
    again, and it finishes from the pause."""
    rec = register(client, type_="pausing_agent")
    assert complete(client, rec["id"], 4).status_code == 200
    first = client.get(f"/v1/agents/{rec['id']}").json()
    assert first["state"] == "paused" and first["requests_in_flight"] == 0
    assert first["submitted_at"] <= first["paused_at"] and first["paused_for_s"] >= 0.0
    wait_until(lambda: client.get(f"/v1/agents/{rec['id']}").json()["paused_for_s"]
               >= first["paused_for_s"] + 0.3, limit_s=10)
    later = client.get(f"/v1/agents/{rec['id']}").json()
    assert later["paused_at"] == first["paused_at"]  # the same pause, lasting
    paused = metric_value(client.get("/metrics").text, "justitia_agents", {"state": "paused"})
    assert paused is not None and paused >= 1
    assert complete(client, rec["id"], 4).status_code == 200
    second = client.get(f"/v1/agents/{rec['id']}").json()
    assert second["state"] == "paused" and second["paused_at"] >= later["paused_at"] + 0.3
    assert second["paused_for_s"] < later["paused_for_s"]
    done = client.post(f"/v1/agents/{rec['id']}/finish").json()
    assert done["state"] == "finished" and done["paused_at"] is None and done["paused_for_s"] is None


def test_an_announced_tool_call_tells_the_scheduler_its_pause(client: httpx.Client) -> None:
    """POST /pause names the tool call the agent is in (and how long it should take): the
    record shows it and the rest of the pause; POST /resume ends it and its length is learned,
    so the next agent of the type in the same tool is judged from it."""
    rec = register(client, type_="tool_user")
    assert complete(client, rec["id"], 4).status_code == 200
    r = client.post(f"/v1/agents/{rec['id']}/pause", json={"tool": "search", "expected_s": 30.0})
    assert r.status_code == 200, r.text
    inside = r.json()
    assert inside["state"] == "paused" and inside["tool"] == "search"
    assert 29.0 < inside["pause_remaining_s"] <= 30.0  # the declared length, less what passed
    wait_until(lambda: client.get(f"/v1/agents/{rec['id']}").json()["paused_for_s"] >= 0.3, limit_s=10)
    ended = client.post(f"/v1/agents/{rec['id']}/resume").json()
    assert ended["tool"] is None and ended["state"] == "paused"  # back, not sent anything yet
    took = ended["paused_for_s"]
    assert client.post(f"/v1/agents/{rec['id']}/resume").status_code == 200  # nothing to end: a no-op
    client.post(f"/v1/agents/{rec['id']}/finish")

    # the next of its type in the same tool, with no length declared: the call seen (>= 0.3 s)
    other = register(client, type_="tool_user")
    assert complete(client, other["id"], 4).status_code == 200
    seen = client.post(f"/v1/agents/{other['id']}/pause", json={"tool": "search"}).json()
    assert seen["tool"] == "search" and 0.0 < seen["pause_remaining_s"] <= took + 0.05
    done = client.post(f"/v1/agents/{other['id']}/finish").json()
    assert done["tool"] is None and done["pause_remaining_s"] is None
    r = client.post(f"/v1/agents/{other['id']}/pause", json={"tool": "search"})
    assert r.status_code == 409 and "finished" in r.json()["detail"]
    assert client.post(f"/v1/agents/{other['id']}/resume").status_code == 409
    assert client.post("/v1/agents/agt-nope/pause").status_code == 404


def test_bad_tool_announcements_are_400(client: httpx.Client) -> None:
    rec = register(client, type_="tool_user")
    for body in ({"tool": ""}, {"tool": "has space"}, {"expected_s": -1}, {"expected_s": "soon"},
                 {"tool": "t", "unknown": 1}):
        r = client.post(f"/v1/agents/{rec['id']}/pause", json=body)
        assert r.status_code == 400, (body, r.text)
        assert isinstance(r.json()["detail"], str)
    client.delete(f"/v1/agents/{rec['id']}")
