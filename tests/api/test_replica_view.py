"""An engine with replicas, as the server and the dashboard show it: GET /v1/admin/replicas and
the dashboard's stream list each replica (id, state, KV capacity, reserved tokens, requests in
flight), M is their sum and follows a replica going down and coming back, and requests run
on the replica the placement chose. The engine is `ReplicatedFakeEngine` (fake engines on
the real placement code); the same on Ray with vLLM replicas is tests/engine/test_ray.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.clients import local_client
from tests.support.fake_engine import FakeServer
from tests.support.replicated_fake import ReplicatedFakeEngine
from tests.support.waiting import wait_until

KV = 2048  # per replica


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    engine = ReplicatedFakeEngine(2, kv_capacity_tokens=KV, max_model_len=1024, step_s=0.01)
    with FakeServer(tmp_path_factory.mktemp("replicas"), engine=engine) as srv:
        yield srv


def replicas_in_frames(c: httpx.Client, until, timeout_s: float = 20.0) -> list[dict]:
    """The replica list of the dashboard's KV samples, until `until(replicas)` holds."""
    deadline = time.monotonic() + timeout_s
    with c.stream("GET", "/v1/scheduler/events") as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                for point in json.loads(line[6:]).get("kv", []):
                    if until(point.get("replicas", [])):
                        return point["replicas"]
            assert time.monotonic() < deadline, "no dashboard sample showed the replicas as expected"
    raise AssertionError("the stream ended")


def test_the_replicas_are_listed_with_m_their_sum(server: FakeServer) -> None:
    with local_client(base_url=server.url, timeout=30) as c:
        listed = c.get("/v1/admin/replicas").json()
        assert listed["kv_capacity_tokens"] == 2 * KV == c.get("/v1/scheduler").json()["M"]
        rows = {r["id"]: r for r in listed["replicas"]}
        assert set(rows) == {"fake-0", "fake-1"}
        for r in rows.values():
            assert (r["state"], r["kv_capacity_tokens"], r["requests_in_flight"]) == ("serving", KV, 0)
        page = c.get("/dashboard").text
        assert 'id="replicas-panel"' in page and "in flight" in page


def test_the_dashboard_shows_a_request_in_flight_on_its_replica(server: FakeServer) -> None:
    engine: ReplicatedFakeEngine = server.engine
    with local_client(base_url=server.url, timeout=60) as c:
        agent = c.post("/v1/agents", json={"type": "replica_view", "prompt": "x"}).json()["id"]
        body = {"prompt": "a long answer", "max_tokens": 600, "ignore_eos": True, "agent_id": agent}
        done: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: done.append(c.post("/v1/completions", json=body)))
        worker.start()
        busy = replicas_in_frames(c, lambda rs: any(r["in_flight"] == 1 for r in rs))
        [running] = [r for r in busy if r["in_flight"] == 1]
        assert running["state"] == "serving" and running["capacity"] == KV
        assert running["reserved"] >= 600  # its footprint: prompt + max_tokens
        worker.join(60)
        assert done and done[0].status_code == 200, done
        assert list(engine.ran_on.values())[-1] == running["id"]
        idle = replicas_in_frames(c, lambda rs: rs and all(r["in_flight"] == 0 and r["reserved"] == 0 for r in rs))
        assert {r["id"] for r in idle} == {"fake-0", "fake-1"}


def test_the_time_model_has_one_fit_per_replica_that_ran(server: FakeServer) -> None:
    """Each replica's steps feed a time model of its own, under the replica's id."""
    engine: ReplicatedFakeEngine = server.engine
    with local_client(base_url=server.url, timeout=60) as c:
        body = {"prompt": "a few steps", "max_tokens": 40, "ignore_eos": True}
        assert c.post("/v1/completions", json=body).status_code == 200
        ran = engine.ran_on[list(engine.ran_on)[-1]]
        engines = c.get("/v1/scheduler").json()["time_model"]["engines"]
        assert ran in engines and set(engines) <= {"fake-0", "fake-1"}
        assert engines[ran]["samples"] >= 32  # 40 steps at least; a fit counts them every 32


def test_a_replica_down_leaves_m_and_the_list_and_comes_back(server: FakeServer) -> None:
    engine: ReplicatedFakeEngine = server.engine
    with local_client(base_url=server.url, timeout=30) as c:
        engine.set_replica("fake-1", False)
        wait_until(lambda: c.get("/v1/scheduler").json()["M"] == KV)
        assert [r["id"] for r in c.get("/v1/admin/replicas").json()["replicas"]] == ["fake-0"]
        agent = c.post("/v1/agents", json={"type": "replica_view", "prompt": "x"}).json()["id"]
        r = c.post("/v1/completions", json={"prompt": "on the one left", "max_tokens": 8, "agent_id": agent})
        assert r.status_code == 200 and list(engine.ran_on.values())[-1] == "fake-0"
        engine.set_replica("fake-1", True)
        wait_until(lambda: c.get("/v1/scheduler").json()["M"] == 2 * KV)
        shown = replicas_in_frames(c, lambda rs: len(rs) == 2)
        assert {(r["id"], r["state"]) for r in shown} == {("fake-0", "serving"), ("fake-1", "serving")}
