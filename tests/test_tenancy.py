"""Tenancy on a server with API keys: every agent is visible and usable only by its tenant."""

from __future__ import annotations

import httpx
import pytest

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-9876543210"}


@pytest.fixture(scope="module")
def keyed_server(justitia_home: str):
    from server.launcher import EmbeddedServer

    args = ["--kv-tokens", "2048", "--max-model-len", "512"]
    for tenant, key in KEYS.items():
        args += ["--api-key", f"{tenant}={key}"]
    srv = EmbeddedServer(args, env={"JUSTITIA_HOME": justitia_home}).start()
    yield srv
    srv.stop()


def as_tenant(srv, tenant: str | None, key: str | None = None) -> httpx.Client:
    headers = {}
    if tenant is not None:
        headers["Authorization"] = f"Bearer {key or KEYS[tenant]}"
    return httpx.Client(base_url=srv.url, headers=headers, timeout=60)


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


def test_tenants_cannot_see_or_touch_each_others_agents(keyed_server) -> None:
    with as_tenant(keyed_server, "alice") as alice, as_tenant(keyed_server, "bob") as bob:
        rec = alice.post("/v1/agents", json={"type": "secret_agent",
                                             "prompt": "alice's private prompt"}).json()
        assert rec["tenant"] == "alice"
        aid = rec["id"]
        # bob learns nothing: not its record, not its existence, not its prompt
        assert bob.get(f"/v1/agents/{aid}").status_code == 404
        assert bob.get(f"/v1/agents/{aid}/events").status_code == 404
        assert aid not in {a["id"] for a in bob.get("/v1/agents").json()["agents"]}
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
