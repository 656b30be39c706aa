"""Placement over engine replicas (server/engine/placement.py), on its own: the KV ledger per
replica, prefix affinity, M and its announcements, resends around failed replicas, and a
replica that is gone leaving once it holds nothing. The Ray adapter and the remote backend
both run on it (tests/api/test_ray_adapter.py, tests/api/test_replica_view.py)."""

from __future__ import annotations

import pytest

from server.engine.base import EngineStats
from server.engine.placement import NoReplica, ReplicaPlacement


def placement(*capacities: int) -> tuple[ReplicaPlacement, list[int]]:
    p = ReplicaPlacement()
    for i, m in enumerate(capacities):
        p.join(f"r{i}", m)
    heard: list[int] = []
    p.add_capacity_listener(heard.append)
    assert p.started() == sum(capacities)
    return p, heard


def test_place_prefers_the_agents_replica_then_the_most_room() -> None:
    p, _ = placement(1000, 2000)
    a, b = p.replicas["r0"], p.replicas["r1"]
    assert p.place("q1", "agent", 500) and b.reserved == 500  # the most room
    assert p.place("q2", "agent", 600) and b.reserved == 1100  # affinity beats room
    assert p.place("q3", "other", 900) and a.reserved == 900
    assert not p.place("q4", "agent", 1000)  # 100 + 900 free: no single replica holds it
    p.release("q2")
    assert b.reserved == 500
    p.release("q2")  # twice is harmless
    assert b.reserved == 500
    assert p.place("q4", "agent", 1000) and b.reserved == 1500


def test_affinity_gives_way_when_the_agents_replica_is_full_or_down() -> None:
    p, _ = placement(1000, 1000)
    assert p.place("q1", "agent", 800)
    [home] = [r for r in p.replicas.values() if r.reserved == 800]
    assert p.place("q2", "agent", 500)  # no room at home: the other one
    assert home.reserved == 800
    p.set_serving(home, False, "test")
    assert p.place("q3", "agent", 100) and home.reserved == 800


def test_claim_takes_the_placement_then_routes_around_failed_replicas() -> None:
    p, _ = placement(1000, 2000)
    a, b = p.replicas["r0"], p.replicas["r1"]
    assert p.place("q", "agent", 300)
    slot, held = p.claim("q", 300)
    assert (slot, held, slot.in_flight) == (b, 300, 1)
    p.unclaim(slot, held)
    assert (b.reserved, b.in_flight) == (0, 0)
    retry, held = p.claim("q", 300, [b])  # the placement is used up: the most room elsewhere
    assert retry is a and a.reserved == 300 and a.in_flight == 1
    p.unclaim(retry, held)
    with pytest.raises(NoReplica, match="no engine replica is serving"):
        p.claim("q", 300, [a, b])
    assert all(r.reserved == 0 and r.in_flight == 0 for r in p.replicas.values())


def test_a_placement_on_a_replica_that_died_since_is_moved() -> None:
    p, _ = placement(1000, 1000)
    assert p.place("q", "agent", 400)
    [dead] = [r for r in p.replicas.values() if r.reserved == 400]
    p.set_serving(dead, False, "it died")
    assert dead.id in p.replicas  # it still holds the reservation
    slot, held = p.claim("q", 400)
    assert slot is not dead and slot.reserved == 400
    assert dead.id not in p.replicas  # once it holds nothing it leaves
    p.unclaim(slot, held)


def test_m_is_the_sum_of_the_serving_replicas_and_each_change_is_announced_once() -> None:
    p, heard = placement(1000, 2000)
    a = p.replicas["r0"]
    p.set_serving(a, False, "test")
    assert p.announce() == 2000 and p.announce() == 2000
    assert heard == [2000] and "r0" not in p.replicas  # it held nothing: it left
    p.join("r0", 1000)
    p.announce()
    assert heard == [2000, 3000] and p.capacity == 3000
    p.keep_only(["r0"], "stopped reporting")
    p.announce()
    assert heard == [2000, 3000, 1000]
    p.keep_only([], "stopped reporting")  # none left: M keeps its last value, unannounced
    assert p.announce() == 0 and heard == [2000, 3000, 1000]


def test_a_replica_that_leaves_with_requests_in_flight_stays_listed_until_they_end() -> None:
    p, heard = placement(1000, 1000)
    assert p.place("q", "agent", 100)
    slot, held = p.claim("q", 100)
    p.keep_only([r for r in p.replicas if r != slot.id], "stopped reporting")
    p.announce()
    assert heard == [1000]
    listed = {r["id"]: r for r in p.describe()}
    assert listed[slot.id]["state"] == "down" and listed[slot.id]["requests_in_flight"] == 1
    p.place("q2", "other", 1000)
    assert slot.reserved == held  # nothing more is placed on a replica that is down
    p.unclaim(slot, held)
    assert slot.id not in p.replicas


def test_the_replicas_describe_themselves_and_their_sum() -> None:
    p, _ = placement(1000, 3000)
    p.replicas["r0"].stats = EngineStats(kv_usage=0.5, running=2, preemptions_total=1, steps_total=10)
    p.replicas["r1"].stats = EngineStats(kv_usage=0.1, running=1, waiting=3, steps_total=5,
                                         iteration_time_s=0.02)
    p.replicas["r1"].detail["pid"] = 42
    assert p.place("q", "agent", 700)
    rows = {r["id"]: r for r in p.describe()}
    assert rows["r1"] == {"id": "r1", "state": "serving", "healthy": True, "kv_capacity_tokens": 3000,
                          "reserved_tokens": 700, "requests_in_flight": 0, "kv_usage": 0.1,
                          "running": 1, "waiting": 3, "pid": 42}
    s = p.stats()
    assert s.kv_usage == pytest.approx((0.5 * 1000 + 0.1 * 3000) / 4000)
    assert (s.running, s.waiting, s.preemptions_total, s.steps_total, s.iteration_time_s) == (3, 3, 1, 15, 0.02)


def test_each_change_of_m_is_on_record_with_the_replica_count() -> None:
    p, _ = placement(1000, 1000)
    p.set_serving(p.replicas["r1"], False, "scaled down")
    p.announce()
    p.join("r2", 1000)
    p.announce()
    assert [(c["replicas"], c["M"]) for c in p.changes] == [(2, 2000), (1, 1000), (2, 2000)]
