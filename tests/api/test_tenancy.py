"""Tenancy on a server with API keys: every agent is visible and usable only by its tenant.
A contract suite: the same calls on the fake engine and on vLLM (`keyed_server`'s params)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.support.clients import local_client
from tests.support.servers import ENGINES, either_server
from tests.support.waiting import all_agents

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-9876543210",
        "admin": "key-admin-5555555555"}


@pytest.fixture(scope="module", params=ENGINES)
def keyed_server(request: pytest.FixtureRequest):
    with either_server(request, kv_tokens=2048, max_model_len=512, keys=KEYS) as srv:
        yield srv


def as_tenant(srv, tenant: str | None, key: str | None = None) -> httpx.Client:
    headers = {}
    if tenant is not None:
        headers["Authorization"] = f"Bearer {key or KEYS[tenant]}"
    return local_client(base_url=srv.url, headers=headers, timeout=60)


def test_calls_without_a_valid_key_are_401(keyed_server) -> None:
    with as_tenant(keyed_server, None) as anon, as_tenant(keyed_server, "alice", "wrong") as bad:
        for c in (anon, bad):
            for method, path in (("GET", "/v1/agents"), ("POST", "/v1/completions"),
                                 ("GET", "/v1/models"), ("GET", "/v1/scheduler")):
                r = c.request(method, path, json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 401, (path, r.text)
                assert "key" in r.json()["detail"]
        # Operations stay open for probes.
        assert anon.get("/healthz").status_code == 200


def test_the_openai_client_says_why_a_key_is_refused(keyed_server) -> None:
    import openai

    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0)
    for call in (lambda: bad.models.list(),
                 lambda: bad.completions.create(model="m", prompt="hi", max_tokens=2)):
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert "key" in caught.value.message and caught.value.code == "invalid_api_key"
        assert caught.value.type == "authentication_error"
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEYS["alice"], max_retries=0)
    assert good.models.list().data


def test_tenants_cannot_see_or_touch_each_others_agents(keyed_server) -> None:
    with as_tenant(keyed_server, "alice") as alice, as_tenant(keyed_server, "bob") as bob:
        rec = alice.post("/v1/agents", json={"type": "secret_agent",
                                             "prompt": "alice's private prompt"}).json()
        assert rec["tenant"] == "alice"
        aid = rec["id"]
        # bob learns nothing: not its record, not its existence, not its prompt
        assert bob.get(f"/v1/agents/{aid}").status_code == 404
        assert bob.get(f"/v1/agents/{aid}/events").status_code == 404
        assert aid not in {a["id"] for a in all_agents(bob)}
        # nor use, finish or cancel it
        r = bob.post("/v1/completions", headers={"X-Justitia-Agent": aid},
                     json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        assert bob.post(f"/v1/agents/{aid}/finish").status_code == 404
        assert bob.delete(f"/v1/agents/{aid}").status_code == 404
        assert alice.get(f"/v1/agents/{aid}").json()["state"] == "queued"
        # the scheduler snapshot hides other tenants' ids
        assert aid not in bob.get("/v1/scheduler").text
        # alice's own calls work, and her history stays hers
        assert alice.post("/v1/completions", headers={"X-Justitia-Agent": aid},
                          json={"prompt": "hi there", "max_tokens": 2}).status_code == 200
        assert alice.post(f"/v1/agents/{aid}/finish").json()["state"] == "finished"
        assert any(s["agent_id"] == aid for s in alice.get("/v1/history").json()["samples"])
        assert "alice's private prompt" not in bob.get("/v1/history").text


def _register(c: httpx.Client, agent_type: str, prompt: str) -> str:
    r = c.post("/v1/agents", json={"type": agent_type, "prompt": prompt})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_history_and_listings_stay_with_their_tenant(keyed_server) -> None:
    with as_tenant(keyed_server, "alice") as alice, as_tenant(keyed_server, "bob") as bob:
        aid = _register(alice, "ledger_audit", "alice's ledger prompt")
        assert alice.post("/v1/completions", headers={"X-Justitia-Agent": aid},
                          json={"prompt": "audit it", "max_tokens": 2}).status_code == 200
        assert alice.post(f"/v1/agents/{aid}/finish").status_code == 200
        # An untagged request becomes a one-request agent of alice's, with its prompt.
        untagged = alice.post("/v1/completions", json={"prompt": "alice untagged secret",
                                                       "max_tokens": 2})
        assert untagged.status_code == 200
        mine = alice.get("/v1/history").json()["samples"]
        assert aid in {s["agent_id"] for s in mine}
        assert any(s["prompt"] == "alice untagged secret" for s in mine)
        for query in ("", "?agent_type=ledger_audit", "?agent_type=default"):
            text = bob.get(f"/v1/history{query}").text
            assert aid not in text and "alice" not in text, query
        listed = bob.get("/v1/agents").text + bob.get("/v1/agents?state=finished").text
        assert aid not in listed and "alice" not in listed


def _first_event(c: httpx.Client, agent_id: str) -> tuple[int, dict | None]:
    """The status of the events call, and the first record it streams (None if refused)."""
    with c.stream("GET", f"/v1/agents/{agent_id}/events", timeout=10) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        for line in r.iter_lines():
            if line.startswith("data: "):
                return 200, json.loads(line[len("data: "):])
    raise AssertionError("the stream ended without an event")


def test_event_streams_only_for_the_owner(keyed_server) -> None:
    with as_tenant(keyed_server, "alice") as alice, as_tenant(keyed_server, "bob") as bob:
        aid = _register(alice, "watched", "alice's watched prompt")
        status, record = _first_event(alice, aid)
        assert status == 200 and record["id"] == aid and record["tenant"] == "alice"
        status, body = _first_event(bob, aid)
        assert status == 404 and "watched" not in json.dumps(body)
        assert alice.post(f"/v1/agents/{aid}/finish").status_code == 200
        # Ended agents stay readable by their owner only.
        assert _first_event(alice, aid)[1]["state"] == "finished"
        assert _first_event(bob, aid)[0] == 404
        assert bob.get(f"/v1/agents/{aid}").status_code == 404


def test_the_scheduler_queue_hides_other_tenants_agents(keyed_server) -> None:
    with as_tenant(keyed_server, "alice") as alice, as_tenant(keyed_server, "bob") as bob, \
            as_tenant(keyed_server, "admin") as admin:
        aid = _register(alice, "queued_work", "alice's queued prompt")
        results: list[httpx.Response] = []
        assert admin.post("/v1/admin/pause").status_code == 200
        try:
            # Paused, alice's request waits in the scheduler's queue.
            worker = threading.Thread(target=lambda: results.append(alice.post(
                "/v1/completions", headers={"X-Justitia-Agent": aid},
                json={"prompt": "wait for me", "max_tokens": 2})))
            worker.start()
            deadline = time.monotonic() + 30
            while aid not in alice.get("/v1/scheduler").text:
                assert time.monotonic() < deadline, "alice's request never queued"
                time.sleep(0.05)
            snap = bob.get("/v1/scheduler")
            assert snap.status_code == 200
            assert snap.json()["queue"] and all(item["agent_id"] is None
                                                for item in snap.json()["queue"])
            assert aid not in snap.text and "queued_work" not in snap.text
        finally:
            assert admin.post("/v1/admin/resume").status_code == 200
        worker.join(60)
        assert results and results[0].status_code == 200, results


def test_admin_calls_need_the_admin_tenant(keyed_server) -> None:
    calls = [("POST", "/v1/admin/pause", None), ("POST", "/v1/admin/resume", None),
             ("GET", "/v1/admin/replicas", None)]
    with as_tenant(keyed_server, "alice") as alice, as_tenant(keyed_server, "bob") as bob, \
            as_tenant(keyed_server, None) as anon:
        for method, path, body in calls:
            for c in (alice, bob):
                r = c.request(method, path, json=body)
                assert r.status_code == 403 and "admin" in r.json()["detail"], (path, r.text)
            assert anon.request(method, path, json=body).status_code == 401, path
        assert alice.get("/v1/scheduler").json()["paused"] is False
    with as_tenant(keyed_server, "admin") as admin:
        assert admin.post("/v1/admin/pause").json() == {"paused": True}
        assert admin.post("/v1/admin/resume").json() == {"paused": False}
        # This server's engine is in-process: the replica calls apply, and say they do not.
        assert admin.get("/v1/admin/replicas").status_code == 409


def _calls_naming(agent_id: str) -> list[tuple[str, str, dict, dict | None]]:
    """Every call that names an agent: (method, path, headers, body)."""
    return [
        ("POST", "/v1/completions", {"X-Justitia-Agent": agent_id},
         {"prompt": "x", "max_tokens": 2}),
        ("POST", "/v1/completions", {}, {"prompt": "x", "max_tokens": 2, "agent_id": agent_id}),
        ("POST", "/v1/chat/completions", {"X-Justitia-Agent": agent_id},
         {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
        ("GET", f"/v1/agents/{agent_id}", {}, None),
        ("POST", f"/v1/agents/{agent_id}/finish", {}, None),
        ("DELETE", f"/v1/agents/{agent_id}", {}, None),
    ]


def test_errors_reveal_nothing_of_other_tenants(keyed_server) -> None:
    with as_tenant(keyed_server, "alice") as alice, as_tenant(keyed_server, "bob") as bob:
        aid = _register(alice, "confidential_type", "alice's confidential prompt")
        unknown = "agt-0000000000000000"
        for taken, free in zip(_calls_naming(aid), _calls_naming(unknown), strict=True):
            method, path, headers, body = taken
            r = bob.request(method, path, headers=headers, json=body)
            assert r.status_code == 404, (path, r.text)
            for secret in ("confidential", "alice"):
                assert secret not in r.text, (path, r.text)
            # The answer for alice's agent is the answer for an agent that does not exist:
            # bob cannot even learn that the id is taken.
            method, path, headers, body = free
            other = bob.request(method, path, headers=headers, json=body)
            assert other.status_code == 404
            assert r.json()["detail"].replace(aid, unknown) == other.json()["detail"]
        assert alice.get(f"/v1/agents/{aid}").json()["state"] == "queued"
        # A wrong key is not echoed back either.
        with as_tenant(keyed_server, "alice", "key-guess-123") as guess:
            r = guess.get("/v1/agents")
            assert r.status_code == 401 and "key-guess-123" not in r.text


def test_metrics_hold_no_prompts_ids_tenants_or_keys(keyed_server) -> None:
    with as_tenant(keyed_server, "alice") as alice:
        aid = _register(alice, "metered", "alice's metered prompt")
        done = alice.post("/v1/completions", headers={"X-Justitia-Agent": aid},
                          json={"prompt": "metered request text", "max_tokens": 2})
        assert done.status_code == 200
        request_id = done.json()["id"]
        assert alice.post(f"/v1/agents/{aid}/finish").status_code == 200
    with as_tenant(keyed_server, None) as anon:
        text = anon.get("/metrics").text
    assert 'justitia_agents_registered_total{type="metered"}' in text  # counts by type only
    for secret in ("metered prompt", "metered request text", aid, request_id, "alice", "bob",
                   *KEYS.values()):
        assert secret not in text, secret


def test_metrics_keep_a_bounded_number_of_type_labels() -> None:
    from server.runtime.agents import AgentEntry
    from server.runtime.metrics import MAX_TYPE_LABELS, Metrics

    m = Metrics()
    for i in range(MAX_TYPE_LABELS + 50):
        m.agent_registered(AgentEntry(id=f"a{i}", type=f"type{i}", tenant="t", prompt="",
                                      metadata={}, submitted_at=0.0, submitted_mono=0.0,
                                      predicted_cost=1.0))
    text = m.render().decode()
    assert text.count("justitia_agents_registered_total{") == MAX_TYPE_LABELS + 1
    assert 'justitia_agents_registered_total{type="other"} 50.0' in text
