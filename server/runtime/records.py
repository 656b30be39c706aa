"""An agent's record as the API returns it: its entry joined with the scheduler's view.

A live agent's view is the dispatcher's now; an ended agent keeps the view it had when it
ended (`AgentEntry.final_view`), since the dispatcher has forgotten it.
"""

from __future__ import annotations

from dataclasses import asdict

from server.runtime.agents import AgentEntry, AgentRecord
from server.scheduler import AgentView


def agent_record(entry: AgentEntry, view: AgentView, now: float | None = None) -> AgentRecord:
    """The record of `entry` with the scheduler's `view` of it (the one place the two
    meet); `now` (the scheduler's clock) times a pause in progress."""
    paused_for = (max(0.0, now - entry.paused_mono)
                  if entry.paused_mono is not None and now is not None else None)
    jct = entry.finished_at - entry.submitted_at if entry.state == "finished" and entry.finished_at else None
    return AgentRecord(
        id=entry.id,
        type=entry.type,
        tenant=entry.tenant,
        state=entry.state,
        predicted_cost=entry.predicted_cost,
        predicted_cost_p90=entry.cost_interval[1] if entry.cost_interval else None,
        consumed_cost=entry.consumed_kv_cost,
        requests_in_flight=entry.in_flight,
        submitted_at=entry.submitted_at,
        finished_at=entry.finished_at,
        paused_at=entry.paused_at,
        paused_for_s=paused_for,
        # an ended agent is in no pause (its last view may have been taken in one)
        tool=None if entry.terminal else view.tool,
        pause_remaining_s=None if entry.terminal else view.pause_remaining_s,
        first_eta_s=entry.first_eta_s,
        first_eta_interval_s=list(entry.first_eta_interval_s) if entry.first_eta_interval_s else None,
        session=entry.session,
        error=entry.error,
        cost_source=entry.cost_source,
        jct_s=jct,
        metadata=entry.meta(),
        metadata_dropped=entry.metadata_dropped,
        virtual_finish=view.virtual_finish,
        charged_cost=view.charged_cost,
        requests_total=view.requests_total,
        requests_done=view.requests_done,
        fair_finish_s=view.fair_finish_s,
        eta_s=view.eta_s,
        eta_interval_s=list(view.eta_interval_s) if view.eta_interval_s is not None else None,
        delay_bound_s=view.delay_bound_s,
        delay_bound_terms=asdict(view.bound),
        deadline_s=view.deadline_s,
        promise=view.promise,
        promise_reason=view.promise_reason,
        promise_assumes=view.promise_assumes,
        tool_allowance_s=view.tool_allowance_s,
        paused_s=view.paused_s,
        expected_cost=view.expected_cost,
    )
