"""Admission: requests wait here, not in the engine, until the dispatcher admits them.

Each submitted request holds a `Ticket`; after every event (a request submitted, a request
finished, an agent cancelled, the engine back) `pump` asks the dispatcher which requests
to admit now, and their tickets open. The per-tenant count of waiting requests (the
`max_queued` quotas) is kept here, where tickets are made and opened.

No requests are admitted while admission is paused (drain, maintenance) or while the
engine is being restarted: they stay queued, in policy order, until it is back.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.base import Placement
from server.runtime.limits import Quotas
from server.scheduler import Dispatcher, RequestSpec

if TYPE_CHECKING:
    from server.runtime.agents import AgentEntry
    from server.runtime.retain import LiveRetention as Retention


@dataclass
class Ticket:
    request_id: str
    agent: AgentEntry
    prompt_tokens: int
    submitted: float
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    admitted: float | None = None
    error: Exception | None = None

    @property
    def waiting(self) -> bool:
        return not self.opened.is_set()


class Admission:
    def __init__(
        self,
        dispatcher: Dispatcher,
        quotas: Quotas,
        max_num_seqs: int,
        now: Callable[[], float],
        *,
        placement: Placement | None = None,
        engine_recovering: Callable[[], bool] = lambda: False,
    ) -> None:
        self.dispatcher = dispatcher
        self.quotas = quotas
        self.max_num_seqs = max_num_seqs
        self._now = now
        self._placement = placement
        self._engine_recovering = engine_recovering
        self.paused = False
        # Kept contexts of paused agents (server/runtime/retain.py): they give way before
        # admission when the head does not fit, and hear what admission took.
        self.retention: Retention | None = None
        self._tickets: dict[str, Ticket] = {}
        self._queued: collections.Counter[str] = collections.Counter()

    def submit(self, entry: AgentEntry, spec: RequestSpec, now: float) -> Ticket:
        """Queue a request of `entry`: its ticket opens when it is admitted (or fails).
        QuotaExceeded when the tenant has too many requests waiting already."""
        self.quotas.check_queued(entry.tenant, self._queued[entry.tenant])
        ticket = Ticket(spec.request_id, entry, spec.prompt_tokens, submitted=now)
        self._tickets[spec.request_id] = ticket
        self._queued[entry.tenant] += 1
        self.dispatcher.submit(spec, now)
        return ticket

    def open(self, ticket: Ticket, error: Exception | None = None) -> None:
        """The request stops waiting: admitted, or failed with `error`."""
        ticket.error = error
        self._queued[ticket.agent.tenant] -= 1
        ticket.opened.set()

    def settle(self, ticket: Ticket) -> None:
        """The request is over, however it ended: forget its ticket and its placement."""
        self._tickets.pop(ticket.request_id, None)
        if ticket.waiting:  # its consumer went away before admission
            self._queued[ticket.agent.tenant] -= 1
            ticket.opened.set()
        if self._placement is not None:
            self._placement.release(ticket.request_id)  # a placement it never used

    def fail_waiting(self, error: Exception, agent: AgentEntry | None = None) -> None:
        """Fail the requests still waiting (those of `agent`, or all) with `error`."""
        for ticket in list(self._tickets.values()):
            if agent is not None and ticket.agent is not agent:
                continue
            if ticket.admitted is None and ticket.waiting:
                self.open(ticket, error=error)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.pump()

    def pump(self) -> None:
        """Admit what the policy allows now and open those tickets."""
        if self.paused or self._engine_recovering():
            return
        d = self.dispatcher
        slots = self.max_num_seqs - d.ledger.running_count
        if slots <= 0 or d.ledger.pending_count == 0:
            return
        now = self._now()
        if self.retention is not None and self.retention.make_way(now):
            # the contexts that gave way were charged at their release, after `now`: the
            # virtual clock has moved past it, and admitting at `now` would run it backwards
            now = self._now()
        admitted = d.admit(now, engine_free_slots=slots, place=self._place_fn())
        if self.retention is not None and admitted:
            self.retention.admitted(sum(r.footprint for s in admitted if (r := d.requests.get(s.request_id))))
        for spec in admitted:
            ticket = self._tickets.get(spec.request_id)
            if ticket is not None:
                ticket.admitted = now
                self.open(ticket)

    def _place_fn(self) -> Callable[[RequestSpec, int], bool] | None:
        """With several replicas, a request needs one replica with room for all of it."""
        placement = self._placement
        if placement is None:
            return None

        def place(spec: RequestSpec, footprint: int) -> bool:
            return placement.place(spec.request_id, spec.agent_id, footprint)

        return place
