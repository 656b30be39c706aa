"""Placement over engine replicas: the KV ledger per replica, prefix affinity, M and health.

One engine backend may run on several replicas (Ray Serve's engine deployment) or on one
(an external vLLM server): either way the scheduler sees one engine whose KV capacity M is
the sum over the replicas that serve. `ReplicaPlacement` is that view, kept in the
scheduler's process and shared by every backend with replicas:

- capacity: M is the sum of the serving replicas' KV capacities; a replica that stops
  serving leaves M, one that joins (or comes back) adds to it, and capacity listeners hear
  every change of M once (with no replica serving, M keeps its last value: nothing is
  admitted anyway, and the backend says it is recovering);
- placement: a request is admitted only once `place` found one replica with room for its
  whole footprint (the sum of free memory is not enough: a request cannot span replicas),
  preferring the replica that served the agent before, which holds its prompt prefix in
  vLLM's prefix cache; else the replica with the most room;
- running: `claim` hands a request its replica (its placement on the first try, another
  serving replica when it is resent after a failure), `unclaim` gives the tokens back, and
  a replica that is gone leaves the table once it holds nothing.

It does no I/O: the backends feed it (reports, polls, failures) and ask it. A backend
with replicas inherits `PlacedReplicas`, which answers the scheduler's capability calls
(M and its changes, the replica list, place and release) from its `placement`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from server.engine.base import CapacityListener, EngineError, EngineRequest, EngineStats

log = logging.getLogger("justitia.engine.placement")

AFFINITY_ENTRIES = 10_000  # agents remembered for prefix affinity (least recently used go)
CHANGES_KEPT = 1_000  # the latest changes of M, for the operator


class NoReplica(EngineError):
    """No replica serves (outside the ones a request already failed on)."""


class ReplicaFailed(Exception):
    """A replica itself failed (unreachable, a 5xx, its process or actor died, the connection
    lost mid-request), not the request: the backend takes the replica out of M, and resends a
    request that had produced nothing yet where it can."""


def footprint(request: EngineRequest) -> int:
    """The KV tokens a request may hold at most: each of its `n` sequences, prompt and output."""
    s = request.sampling
    return s.n * (len(request.prompt_token_ids) + s.max_tokens)


@dataclass
class ReplicaSlot:
    """What the scheduler knows of one replica."""

    id: str
    kv_capacity_tokens: int = 0
    reserved: int = 0  # footprints of our requests placed here and not yet over
    in_flight: int = 0  # our requests running here
    serving: bool = True
    stats: EngineStats = field(default_factory=EngineStats)
    # Backend facts shown as they are (a process id, a node, a URL).
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def room(self) -> int:
        return self.kv_capacity_tokens - self.reserved

    @property
    def state(self) -> str:
        return "serving" if self.serving else "down"

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "healthy": self.serving,
                "kv_capacity_tokens": self.kv_capacity_tokens, "reserved_tokens": self.reserved,
                "requests_in_flight": self.in_flight, "kv_usage": self.stats.kv_usage,
                "running": self.stats.running, "waiting": self.stats.waiting, **self.detail}


class ReplicaPlacement:
    """The replicas acting as one engine (see the module docstring)."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaSlot] = {}
        self._listeners: list[CapacityListener] = []
        self._announced: int | None = None  # the M the scheduler was last told
        self._placed: dict[str, tuple[ReplicaSlot, int]] = {}
        self._affinity: collections.OrderedDict[str, ReplicaSlot] = collections.OrderedDict()
        # Each M the scheduler was told, with when (Unix time) and over how many replicas.
        self.changes: collections.deque[dict[str, Any]] = collections.deque(maxlen=CHANGES_KEPT)

    # -- membership and capacity ---------------------------------------------------------
    @property
    def capacity(self) -> int:
        """M: the KV tokens of the replicas serving now."""
        return sum(r.kv_capacity_tokens for r in self.replicas.values() if r.serving)

    @property
    def serving(self) -> list[ReplicaSlot]:
        return [r for r in self.replicas.values() if r.serving]

    def add_capacity_listener(self, listener: CapacityListener) -> None:
        """`listener(M)` after every change of M (a replica joined, left, failed, came back)."""
        self._listeners.append(listener)

    def started(self) -> int:
        """The engine told the scheduler this M; later changes are announced."""
        self._announced = self.capacity
        self._note(self._announced)
        return self._announced

    def _note(self, m: int) -> None:
        self.changes.append({"at": round(time.time(), 3), "replicas": len(self.serving), "M": m})

    def join(self, replica_id: str, kv_capacity_tokens: int) -> ReplicaSlot:
        """The replica of this id (a new one joins, serving, with this capacity)."""
        slot = self.replicas.get(replica_id)
        if slot is None:
            slot = self.replicas[replica_id] = ReplicaSlot(replica_id, kv_capacity_tokens)
            log.info("engine replica %s joined (%d KV tokens)", replica_id, kv_capacity_tokens)
        return slot

    def set_serving(self, slot: ReplicaSlot, serving: bool, why: str = "") -> None:
        """A replica stops or resumes serving; a stopped one that holds nothing leaves."""
        if slot.serving != serving:
            if serving:
                log.info("engine replica %s serves again", slot.id)
            else:
                log.warning("engine replica %s is down (%s); its capacity leaves M", slot.id, why)
        slot.serving = serving
        if not serving and slot.in_flight == 0 and slot.reserved == 0 \
                and self.replicas.get(slot.id) is slot:
            del self.replicas[slot.id]

    def keep_only(self, present: Iterable[str], why: str) -> None:
        """Replicas not in `present` are gone (they stopped reporting)."""
        keep = set(present)
        for slot in [r for rid, r in self.replicas.items() if rid not in keep]:
            self.set_serving(slot, False, why)

    def announce(self) -> int:
        """Tell the capacity listeners if M changed since they last heard; M now."""
        m = self.capacity
        if self._announced is None or m <= 0 or m == self._announced:
            return m  # with no replica serving M keeps its last value
        self._announced = m
        self._note(m)
        log.info("KV capacity is now %d tokens over %d replicas", m, len(self.serving))
        for listener in self._listeners:
            listener(m)
        return m

    def describe(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self.replicas.values()]

    def stats(self) -> EngineStats:
        """The replicas' statistics as one engine's (KV usage weighted by capacity)."""
        rs = list(self.replicas.values())
        total = sum(r.kv_capacity_tokens for r in rs) or 1
        return EngineStats(
            kv_usage=sum(r.stats.kv_usage * r.kv_capacity_tokens for r in rs) / total,
            running=sum(r.stats.running for r in rs),
            waiting=sum(r.stats.waiting for r in rs),
            preemptions_total=sum(r.stats.preemptions_total for r in rs),
            iteration_time_s=max((r.stats.iteration_time_s for r in rs if r.stats.iteration_time_s),
                                 default=None),
            steps_total=sum(r.stats.steps_total for r in rs),
        )

    # -- placement and affinity ----------------------------------------------------------
    def place(self, request_id: str, agent_id: str, footprint: int) -> bool:
        """Reserve room for an admitted request on one replica, or say there is none: the
        agent's previous replica first (its prefix is cached there), else the most room."""
        prev = self._affinity.get(agent_id)
        if prev is not None and prev.serving and self.replicas.get(prev.id) is prev \
                and prev.room >= footprint:
            choice = prev
        else:
            fitting = [r for r in self.replicas.values() if r.serving and r.room >= footprint]
            if not fitting:
                return False
            choice = max(fitting, key=lambda r: r.room)
        choice.reserved += footprint
        self._placed[request_id] = (choice, footprint)
        self._affinity[agent_id] = choice
        self._affinity.move_to_end(agent_id)
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return True

    def release(self, request_id: str) -> None:
        """Drop the placement of a request that never started (its client left first)."""
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            self._forget(*placed)

    def _forget(self, slot: ReplicaSlot, held: int) -> None:
        slot.reserved -= held
        if not slot.serving:
            self.set_serving(slot, False)  # leaves once it holds nothing

    def claim(self, request_id: str, footprint: int,
              exclude: Iterable[ReplicaSlot] = ()) -> tuple[ReplicaSlot, int]:
        """The replica a request runs on and the tokens held there for it: its placement on
        the first try (if that replica still serves), else the serving replica with the most
        room outside `exclude` (those that failed it). NoReplica when none is left. Give it
        back with `unclaim`."""
        placed = self._placed.pop(request_id, None)  # used up by the first try
        if placed is not None and placed[0].serving:
            slot, held = placed
        else:
            if placed is not None:
                self._forget(*placed)
            excluded = list(exclude)
            live = [r for r in self.replicas.values() if r.serving and r not in excluded]
            if not live:
                raise NoReplica("no engine replica is serving")
            slot, held = max(live, key=lambda r: r.room), footprint
            slot.reserved += held
        slot.in_flight += 1
        return slot, held

    def unclaim(self, slot: ReplicaSlot, held: int) -> None:
        slot.in_flight -= 1
        self._forget(slot, held)


class PlacedReplicas:
    """The capabilities (server/engine/base.py: `Placement`, `CapacityChanges`,
    `ReplicaList`) of a backend whose replicas its `placement` keeps."""

    placement: ReplicaPlacement

    @property
    def capacity(self) -> int:
        """M: the KV tokens of the replicas serving now."""
        return self.placement.capacity

    def add_capacity_listener(self, listener: CapacityListener) -> None:
        self.placement.add_capacity_listener(listener)

    def capacity_changes(self) -> list[dict[str, Any]]:
        return list(self.placement.changes)

    def describe_replicas(self) -> list[dict[str, Any]]:
        return self.placement.describe()

    def place(self, request_id: str, agent_id: str, footprint: int) -> bool:
        """Reserve room for an admitted request on one replica (`ReplicaPlacement.place`)."""
        return self.placement.place(request_id, agent_id, footprint)

    def release(self, request_id: str) -> None:
        self.placement.release(request_id)
