"""An agent's lifecycle: its states, the transitions between them, and the one function
that validates and applies a transition.

    queued ──(first request admitted)──▶ running ⇄ paused ──▶ finished / failed (its code raised)
       │                                      │
       └──────────────┬───────────────────────┴──▶ cancelled (DELETE) / expired (lease ran out)

A running agent whose last request in flight ends is `paused` (between its stages: a tool
call, a user's think time) until it sends another, which makes it `running` again. A paused
agent may end like a running one (its finish call, a cancel, its lease running out).

An agent may also end while still queued (finished with no request admitted, cancelled,
expired). The four end states are final: nothing leaves them. The live scheduler
(server/runtime/live.py) changes an agent's state only through `transition`, so a second end (a
cancel racing a finish) is refused here, in one place, instead of being applied twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.runtime.agents import TERMINAL, AgentStatus

if TYPE_CHECKING:
    from server.runtime.agents import AgentEntry

# The states each state may move to.
TRANSITIONS: dict[AgentStatus, frozenset[AgentStatus]] = {
    AgentStatus.QUEUED: frozenset({AgentStatus.RUNNING, *TERMINAL}),
    AgentStatus.RUNNING: frozenset({AgentStatus.PAUSED, *TERMINAL}),
    AgentStatus.PAUSED: frozenset({AgentStatus.RUNNING, *TERMINAL}),
    **{end: frozenset() for end in AgentStatus if end in TERMINAL},  # in a stable order
}
# The ends under an agent's running requests: they are aborted, their outputs dropped.
ABANDONED: frozenset[AgentStatus] = frozenset({AgentStatus.CANCELLED, AgentStatus.EXPIRED})


class AgentNotFound(LookupError):
    pass


class AgentConflict(Exception):
    """The agent's state does not allow the call (finished, cancelled, requests in flight)."""


class IllegalTransition(AgentConflict):
    """A transition the lifecycle does not have (e.g. from an end state)."""


def transition(entry: AgentEntry, to: AgentStatus, *, wall: float, now: float) -> None:
    """Move `entry` to state `to`, or raise IllegalTransition and leave it as it was.

    An end state also stamps the end: `finished_at` (unix seconds, `wall`) and the last
    activity (the scheduler's clock, `now`), from which its retention is counted. `paused`
    stamps the pause's start; leaving it clears it.
    """
    if to not in TRANSITIONS[entry.state]:
        raise IllegalTransition(f"agent {entry.id} is {entry.state}; it cannot become {to}")
    entry.state = to
    if to is AgentStatus.PAUSED:
        entry.paused_at, entry.paused_mono = wall, now
    else:
        entry.paused_at = entry.paused_mono = None
    if to in TERMINAL:
        entry.finished_at = wall
        entry.last_activity_mono = now
