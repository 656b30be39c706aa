"""How an agent ends: finished or failed by its client, cancelled, expired, or idle.

`AgentEndings` is the one place an agent leaves the live scheduler:

- `finish` and `cancel` (the API): requests of the agent still in flight are aborted, and
  the call returns once the agent's history row is committed, so that an agent the API
  reported ended is in the history even if the process is killed right after;
- `close`: the agent's state changes (one transition, validated), the dispatcher forgets
  it, its kept context is let go, its JCT calibrates the ETA intervals, and the listeners
  hear of its end (history row, predictor feedback, metrics);
- `expire_idle`: the housekeeping's end of agents whose client went quiet: an implicit
  session idle past `session_idle_s` has finished (a session has no finish call), an agent
  silent past its lease has expired.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from server.engine.base import Engine
from server.runtime.admission import Admission
from server.runtime.agent_listeners import AgentListeners, HistoryWriter
from server.runtime.agent_table import AgentTable
from server.runtime.agents import MAX_ERROR_CHARS, AgentEntry, AgentStatus
from server.runtime.lifecycle import AgentConflict, transition
from server.runtime.live_config import LiveConfig
from server.runtime.retain import LiveRetention
from server.scheduler import Dispatcher, RequestStatus

log = logging.getLogger("justitia.live")


def require_live(entry: AgentEntry) -> None:
    """AgentConflict (409) once the agent has ended."""
    if entry.terminal:
        raise AgentConflict(f"agent {entry.id} is {entry.state}")


class AgentEndings:
    """The ends of agents (see the module docstring). Runs on the server's event loop."""

    def __init__(self, dispatcher: Dispatcher, table: AgentTable, admission: Admission, engine: Engine,
                 listeners: AgentListeners, retention: LiveRetention, config: LiveConfig, *,
                 history_writer: HistoryWriter | None, now: Callable[[], float],
                 wall: Callable[[], float], pump: Callable[[], None]) -> None:
        self.dispatcher = dispatcher
        self.table = table
        self.admission = admission
        self.engine = engine
        self.listeners = listeners
        self.retention = retention
        self.config = config
        self.history_writer = history_writer
        self.now = now
        self._wall = wall
        self._pump = pump

    async def finish(self, entry: AgentEntry, error: str | None = None) -> AgentEntry:
        """The agent is done: `finished`, or `failed` when its client reports an `error`
        (its code raised). Requests of it still in flight are orphans (the agent's code
        has returned or raised without them), so they are aborted, as on cancel.
        HistoryUnwritable (503) when its end cannot be made durable (docs/reliability.md)."""
        if self._refused_before(entry):
            return entry
        require_live(entry)
        self._check_history()
        state = AgentStatus.FINISHED if error is None else AgentStatus.FAILED
        if error is not None:
            entry.error = error[:MAX_ERROR_CHARS]
        if entry.in_flight:
            await self._end_with_requests(entry, state)
        else:
            self.close(entry, state)
        await self._durable(entry)
        return entry

    async def cancel(self, entry: AgentEntry) -> AgentEntry:
        """The agent is cancelled: its requests are aborted and its GPS work uncharged."""
        if self._refused_before(entry):
            return entry
        require_live(entry)
        self._check_history()
        await self._end_with_requests(entry, AgentStatus.CANCELLED)
        await self._durable(entry)
        return entry

    def _refused_before(self, entry: AgentEntry) -> bool:
        """An end refused for want of a durable row, asked again: acknowledged once the row
        is written (True), refused again while it waits (HistoryUnwritable)."""
        return self.history_writer is not None and self.history_writer.refused(entry)

    def _check_history(self) -> None:
        if self.history_writer is not None:
            self.history_writer.check_writable()

    async def _durable(self, entry: AgentEntry) -> None:
        """Return once the agent's history row is committed."""
        if self.history_writer is not None:
            await self.history_writer.durable(entry)

    async def _end_with_requests(self, entry: AgentEntry, state: AgentStatus) -> None:
        """End the agent and abort its requests still at the engine."""
        self.retention.forget(entry.id)
        entry.final_view = self.dispatcher.view(entry.id, self.now())
        now = self.now()
        if state in (AgentStatus.FINISHED, AgentStatus.FAILED):
            # Its GPS work stays charged (the agent ran); only its requests go. Closed before
            # the dispatcher forgets it: its JCT is filed under the context it registered in.
            running = [rid for rid, r in self.dispatcher.requests.items()
                       if r.spec.agent_id == entry.id and r.status is RequestStatus.RUNNING]
            self.close(entry, state, forget=False)
            self.dispatcher.finish_agent(entry.id, now)
        else:
            running = self.dispatcher.cancel_agent(entry.id, now)
            self.close(entry, state, forget=False)
        self.admission.fail_waiting(AgentConflict(f"agent {entry.id} was {state}"), agent=entry)
        for request_id in running:
            # The engine ends the request with finish_reason "abort" and frees its KV.
            await self.engine.abort(request_id)
        self._pump()

    def close(self, entry: AgentEntry, state: AgentStatus, forget: bool = True) -> None:
        """End the agent: its state changes (IllegalTransition, before anything else, if it
        had ended), the dispatcher forgets it (unless `forget` is False: the caller did),
        it leaves the live agents, and the listeners hear of it."""
        transition(entry, state, wall=self._wall(), now=self.now())
        self.retention.forget(entry.id, entry.type if state is AgentStatus.FINISHED else None)
        if state is AgentStatus.FINISHED and entry.session is None and entry.first_eta_s is not None \
                and entry.finished_at is not None:
            # What the ETA intervals are calibrated on (a session's end comes after its idle
            # timeout, which no ETA forecasts).
            self.dispatcher.observe_jct(entry.first_eta_s, entry.finished_at - entry.submitted_at, entry.id,
                                        entry.eta_scale)
        if forget:
            entry.final_view = self.dispatcher.view(entry.id, self.now())
            self.dispatcher.finish_agent(entry.id, self.now())
        self.table.ended(entry)
        self.listeners.on_agent_ended(entry)
        # The listeners have taken what they need (the history row is queued with them):
        # an ended agent keeps only what its record shows.
        entry.let_go()
        entry.touch()

    async def expire_idle(self) -> None:
        """End the agents whose client went quiet (see the module docstring)."""
        now = self.now()
        for entry in self.table.open_entries():
            if entry.terminal or entry.in_flight:
                continue
            if entry.session is not None and now - entry.last_activity_mono > self.config.session_idle_s:
                # A session has no finish call: its idleness is its end, a normal one.
                log.info("session agent %s finished after %.0f s idle", entry.id, now - entry.last_activity_mono)
                self.close(entry, AgentStatus.FINISHED)
                continue
            lease = entry.lease_s or self.config.lease_s
            if now - entry.last_activity_mono > lease:
                log.info("agent %s expired after %.0f s without activity", entry.id,
                         now - entry.last_activity_mono)
                await self._end_with_requests(entry, AgentStatus.EXPIRED)
