"""What a restarted server learns again from its history.

A server that has served traffic knows more than a fresh one: its types' shapes
(server/type_shapes.py) and the episodes of arrivals its ETAs forecast from
(`WorkArrivals`). Live, a server taught by one burst gave the next burst first ETAs off by
0.26 of their JCTs at the median, a fresh one 0.35 (docs/benchmarks.md). Both lived in
memory only, so a restart (a deploy, a crash, a new engine) made the server fresh again.
The history keeps every ended agent with its requests, so both are learned again from it
when the server starts: the shapes of the last agents of each tenant's types, and the
registrations of the last agents replayed into the arrivals at their times on the
scheduler's clock (before its start: negative), as if the server had been up all along.

Untagged requests' one-request agents (type `default`) shape no type, as before the
restart; they are arrivals like any agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.agents import DEFAULT_AGENT_TYPE, RequestLog

if TYPE_CHECKING:
    from server.history import History
    from server.scheduler import Dispatcher
    from server.type_shapes import TypeShapes


@dataclass(frozen=True)
class Recalled:
    """What the history gave back: finished agents, the (tenant, type)s they shape, and
    the registrations replayed into the arrivals."""

    agents: int = 0
    types: int = 0
    registrations: int = 0


@dataclass(frozen=True)
class HistoryReading:
    """The rows a restart reads (blocking: read them off the event loop)."""

    finished: list[tuple[str, str, list[RequestLog]]]  # (tenant, type, requests)
    registrations: list[tuple[float, float]]

    @classmethod
    def read(cls, history: History, per_type: int, registrations: int) -> HistoryReading:
        return cls(history.recent_finished(per_type), history.recent_registrations(registrations))


def recall(reading: HistoryReading, shapes: TypeShapes, dispatcher: Dispatcher, now: float,
           wall_now: float) -> Recalled:
    """Learn the types' shapes and replay the registrations (unix seconds, mapped onto the
    scheduler's clock, whose `now` is `wall_now`)."""
    agents, types = 0, set()
    for tenant, agent_type, requests in reading.finished:
        if agent_type != DEFAULT_AGENT_TYPE and shapes.learn(tenant, agent_type, requests):
            agents += 1
            types.add((tenant, agent_type))
    replayed = dispatcher.recall_registrations(
        [(min(now, now - (wall_now - submitted_at)), cost) for submitted_at, cost in reading.registrations], now)
    return Recalled(agents, len(types), replayed)
