"""The dashboard's page and its stream (GET /v1/scheduler/events) on the fake engine:
files served, tenancy enforced by the stream, frames that send only what changed, the queue
capped at its top rows. The page itself is tested in a real browser in
tests/engine/test_dashboard_browser.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from server.api.dashboard.frames import MAX_ROWS, TIMES_REFRESH_S
from tests.support.clients import local_client
from tests.support.fake_engine import FakeEngine, FakeServer

KEYS = {"alice": "dash-alice-0123456789", "bob": "dash-bob-9876543210", "admin": "dash-admin-5555555555"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    engine = FakeEngine(kv_capacity_tokens=4096, max_model_len=2048)
    with FakeServer(tmp_path_factory.mktemp("dash"), engine=engine,
                    api_keys={key: tenant for tenant, key in KEYS.items()}) as srv:
        yield srv


def client(srv: FakeServer, tenant: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return local_client(base_url=srv.url, headers=headers, timeout=30)


def frames(c: httpx.Client, count: int, timeout_s: float = 10.0) -> list[dict]:
    """The first `count` frames of the caller's stream."""
    out: list[dict] = []
    deadline = time.monotonic() + timeout_s
    with c.stream("GET", "/v1/scheduler/events") as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) >= count:
                    break
            assert time.monotonic() < deadline, f"only {len(out)} frames in {timeout_s} s"
    return out


def register(c: httpx.Client, agent_type: str, n: int = 1) -> list[str]:
    ids = []
    for _ in range(n):
        r = c.post("/v1/agents", json={"type": agent_type, "prompt": "x", "predicted_cost": 5000.0})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def test_the_page_and_its_files_are_served_without_a_key(keyed: FakeServer) -> None:
    with client(keyed) as anon:
        page = anon.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        # only its own files: no CDN, no inline script, no key leaving for another origin
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert "http" not in page.text.replace('xmlns="http://www.w3.org/2000/svg"', "")
        for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
            r = anon.get(f"/dashboard/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert anon.get("/dashboard/settings.json").json() == {"keys": True}
        missing = anon.get("/dashboard/api.py")
        assert missing.status_code == 404 and "no dashboard file" in missing.json()["detail"]


def test_the_stream_needs_a_valid_key(keyed: FakeServer) -> None:
    with client(keyed) as anon:
        r = anon.get("/v1/scheduler/events")
        assert r.status_code == 401 and "key" in r.json()["detail"]
        r = anon.get("/v1/scheduler/events", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["detail"] == "invalid API key"


def test_a_tenant_sees_only_its_own_agents_and_the_admin_sees_all(keyed: FakeServer) -> None:
    with client(keyed, "alice") as alice, client(keyed, "bob") as bob, client(keyed, "admin") as admin:
        theirs = register(bob, "bob_job", 2)  # first: ahead of alice's in the queue
        mine = register(alice, "alice_job", 3)
        [first] = frames(alice, 1)
        assert first["reset"] is True
        assert set(first["order"]) >= set(mine) and not set(first["order"]) & set(theirs)
        assert set(first["rows"]) == set(first["order"])
        for row in first["rows"].values():
            assert row[1] == "alice_job" and row[2] is None  # no tenant column for tenants
        assert first["info"]["admin"] is False and first["info"]["tenant"] == "alice"
        assert first["counts"]["live"] == len(first["order"])
        # positions are in the whole queue: bob's agents, registered first, come before
        assert sorted(first["rows"][i][0] for i in mine) == [3, 4, 5]
        [bobs] = frames(bob, 1)
        assert set(bobs["order"]) >= set(theirs) and not set(bobs["order"]) & set(mine)
        [everyone] = frames(admin, 1)
        assert set(everyone["order"]) >= set(mine) | set(theirs)
        tenants = {everyone["rows"][i][2] for i in mine + theirs}
        assert tenants == {"alice", "bob"} and everyone["info"]["admin"] is True
        for i in mine + theirs:
            alice.delete(f"/v1/agents/{i}") if i in mine else bob.delete(f"/v1/agents/{i}")


def test_finished_agents_reach_only_their_tenant(keyed: FakeServer) -> None:
    with client(keyed, "alice") as alice, client(keyed, "bob") as bob:
        [a] = register(alice, "alice_job")
        [b] = register(bob, "bob_job")
        for c, agent in ((alice, a), (bob, b)):
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "agent_id": agent})
            assert r.status_code == 200, r.text
            assert c.post(f"/v1/agents/{agent}/finish").status_code == 200
        [first] = frames(alice, 1)
        finished_ids = [f[0] for f in first.get("finished", [])]
        assert a in finished_ids and b not in finished_ids
        row = next(f for f in first["finished"] if f[0] == a)
        assert row[1] == "alice_job" and row[2] > 0 and row[3] is not None and row[4] is not None


def test_frames_send_only_what_changed(keyed: FakeServer) -> None:
    with client(keyed, "alice") as alice:
        ids = register(alice, "quiet_job", 2)
        first, *rest = frames(alice, 5, timeout_s=30)
        assert set(ids) <= set(first["rows"])
        # Nothing happened to the agents since: no new order, and their rows come again only
        # for the drift of their projected times, and not before TIMES_REFRESH_S.
        for frame in rest:
            assert "reset" not in frame and "order" not in frame
            if set(frame.get("rows", {})) & set(ids):
                assert frame["t"] - first["t"] >= TIMES_REFRESH_S - 0.05, frame
                for i in set(frame["rows"]) & set(ids):  # under load a frame may carry some of them
                    assert frame["rows"][i][:9] == first["rows"][i][:9]  # the same agent, later times
        for i in ids:
            alice.delete(f"/v1/agents/{i}")


def test_the_queue_is_capped_at_its_top_rows_with_counts(tmp_path) -> None:
    with FakeServer(tmp_path, engine=FakeEngine()) as srv, local_client(base_url=srv.url, timeout=30) as c:
        n = MAX_ROWS + 50
        register(c, "many", n)
        [first] = frames(c, 1)
        assert len(first["order"]) == MAX_ROWS == len(first["rows"])
        assert first["counts"]["live"] == n and first["counts"]["shown"] == MAX_ROWS
        # in the policy's order: positions 1..200 (justitia: the smallest virtual finish first)
        assert [first["rows"][i][0] for i in first["order"]] == list(range(1, MAX_ROWS + 1))
        tags = [first["rows"][i][8] for i in first["order"]]
        assert tags == sorted(tags)
        # no keys: the caller is the operator and sees the tenant column
        assert first["info"]["admin"] is True and first["rows"][first["order"][0]][2] == "default"
        assert first["kv"] and {"reserved", "used", "capacity", "tokens_per_s"} <= set(first["kv"][-1])


def test_a_paused_agent_is_counted_and_its_row_says_since_when(keyed: FakeServer) -> None:
    with client(keyed, "alice") as alice:
        [a] = register(alice, "tool_job")
        r = alice.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "agent_id": a})
        assert r.status_code == 200, r.text
        [first] = frames(alice, 1)
        row = first["rows"][a]
        assert row[3] == "paused" and first["counts"]["paused"] >= 1
        # when its pause began, on the frames' clock: the page shows t - paused_since
        assert row[13] is not None and 0.0 <= first["t"] - row[13] < 60.0
        alice.delete(f"/v1/agents/{a}")
