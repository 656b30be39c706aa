"""The remote engine's replica pool (server/engine/replicas.py) on its own: placement with
prefix affinity, capacity changes, draining and the retry routing, with replicas described
by hand (no vLLM server; tests/engine/test_replicas.py runs the same against real replicas)."""

from __future__ import annotations

import pytest

from server.engine.base import EngineError, InvalidRequestError
from server.engine.replicas import ReplicaPool


def pool(*capacities: int) -> tuple[ReplicaPool, list[int]]:
    p = ReplicaPool([f"http://r{i}" for i in range(len(capacities))])
    for r, m in zip(p.replicas, capacities, strict=True):
        r.kv_capacity_tokens, r.healthy = m, True
    heard: list[int] = []
    p.add_capacity_listener(heard.append)
    p.started(sum(capacities))
    return p, heard


def test_place_prefers_the_agents_replica_then_the_most_room() -> None:
    p, _ = pool(1000, 2000)
    a, b = p.replicas
    assert p.place("q1", "agent", 500) and b.reserved == 500  # the most room
    assert p.place("q2", "agent", 600) and b.reserved == 1100  # affinity beats room
    assert p.place("q3", "other", 900) and a.reserved == 900
    assert not p.place("q4", "agent", 1000)  # no single replica holds it
    p.release("q2")
    assert b.reserved == 500
    p.release("q2")  # twice is harmless
    assert b.reserved == 500


def test_claim_takes_the_placement_then_routes_around_failed_replicas() -> None:
    p, _ = pool(1000, 2000)
    a, b = p.replicas
    assert p.place("q", "agent", 300)
    replica, held = p.claim("q", 300, [])
    assert (replica, held, replica.in_flight) == (b, 300, 1)
    p.unclaim(replica, held)
    assert (b.reserved, b.in_flight) == (0, 0)
    retry, held = p.claim("q", 300, [b])  # the placement is used up: routed
    assert retry is a and a.reserved == 300
    p.unclaim(retry, held)
    assert not p.others_serving([a, b])
    with pytest.raises(EngineError, match="no replica is answering"):
        p.claim("q", 300, [a, b])


def test_capacity_changes_are_announced_once_each() -> None:
    p, heard = pool(1000, 2000)
    a, b = p.replicas
    p.set_health(a, False)
    p.set_health(a, False)
    assert p.capacity == 2000 and heard == [2000]
    p.set_health(a, True)
    assert heard == [2000, 3000]
    assert a.serving
    p.set_health(a, False)
    p.set_health(b, False)  # none left: M keeps its last value, nothing is announced
    assert heard == [2000, 3000, 2000]


def test_a_removed_replica_drains_then_leaves_and_the_last_one_stays() -> None:
    p, heard = pool(1000, 2000)
    a, b = p.replicas
    replica, held = p.claim("q", 100, [a])
    assert replica is b
    assert p.remove_replica("http://r1/")["draining"]
    assert b in p.replicas and heard == [1000]  # its request still runs
    assert not p.place("q2", "x", 1500)  # a draining replica takes nothing new
    p.unclaim(replica, held)
    assert p.replicas == [a]
    with pytest.raises(InvalidRequestError, match="last one serving"):
        p.remove_replica("http://r0")
    with pytest.raises(LookupError):
        p.remove_replica("http://r9")
