"""Pauses: the time an agent spends outside the engine between its stages (a tool call, a
user's think time), learned per agent type from what the scheduler sees.

An agent is *paused* from the moment its last request in flight finishes until it submits
its next one: it keeps its place in virtual time (it stays registered, in the GPS reference)
with nothing queued. Its ETA expects the mean pause of its type before each stage it has not
started, and the deadline promised at registration allows the type's 90th-percentile pause
before each: a promise that ignored tool time would be broken by every agent that calls a
tool. A type never seen pausing takes the pauses of every type; before any pause has been
seen, none is expected (the promise says so when the agent declares more than one stage).

Pure: callers pass the times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state import AgentState

# The most recent pauses kept per type (and over all types).
WINDOW = 200


class PauseStats:
    """Pauses seen, per agent type and over all types: mean and 90th percentile."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        self._by_type: dict[str | None, deque[float]] = {}
        self._all: deque[float] = deque(maxlen=window)

    def stage_started(self, agent: AgentState, now: float) -> None:
        """The agent submits a request: back from a pause, its next stage starts (the pause
        is observed); its first request starts its first stage."""
        if agent.idle_since is not None:
            self.observe(agent.agent_type, now - agent.idle_since)
            agent.idle_since = None
            agent.stages_started += 1
        elif agent.stages_started == 0:
            agent.stages_started = 1

    def observe(self, agent_type: str | None, pause_s: float) -> None:
        if not pause_s >= 0.0:
            return
        self._by_type.setdefault(agent_type, deque(maxlen=self._window)).append(pause_s)
        self._all.append(pause_s)

    def _seen(self, agent_type: str | None) -> Iterable[float]:
        own = self._by_type.get(agent_type)
        return own if own else self._all

    def seen(self, agent_type: str | None) -> list[float]:
        """The pauses the type's estimates use (its own, else every type's)."""
        return list(self._seen(agent_type))

    @property
    def any_seen(self) -> bool:
        return bool(self._all)

    def max_s(self) -> float:
        """The longest recent pause of any type (0.0: none seen, or none that lasted)."""
        return max(self._all, default=0.0)

    def mean_s(self, agent_type: str | None) -> float:
        seen = list(self._seen(agent_type))
        return sum(seen) / len(seen) if seen else 0.0

    def p90_s(self, agent_type: str | None) -> float:
        seen = sorted(self._seen(agent_type))
        return seen[min(len(seen) - 1, int(0.9 * len(seen)))] if seen else 0.0


def stages_left(declared_stages: int, started: int) -> int:
    """Stage boundaries still ahead of an agent (each may hold a pause): its declared
    stages past the ones it has started (0 when it declared none)."""
    return max(0, declared_stages - max(1, started))
