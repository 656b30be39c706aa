"""An agent's record as the API returns it: its entry joined with the scheduler's view.

A live agent's view is the dispatcher's now; an ended agent keeps the view it had when it
ended (`AgentEntry.final_view`), since the dispatcher has forgotten it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from server.runtime.agents import AgentEntry, AgentRecord
from server.scheduler import Dispatcher


def scheduler_view(dispatcher: Dispatcher, agent_id: str, now: float) -> dict[str, Any]:
    """The scheduler's view of a live agent, as the record's fields."""
    v = dispatcher.view(agent_id, now)
    return {
        "virtual_finish": v.virtual_finish,
        "charged_cost": v.charged_cost,
        "requests_total": v.requests_total,
        "requests_done": v.requests_done,
        "fair_finish_s": v.fair_finish_s,
        "eta_s": v.eta_s,
        "eta_interval_s": v.eta_interval_s,
        "delay_bound_s": v.delay_bound_s,
        "delay_bound_terms": asdict(v.bound),
        "deadline_s": v.deadline_s,
        "promise": v.promise,
        "promise_reason": v.promise_reason,
        "promise_assumes": v.promise_assumes,
        "expected_cost": v.expected_cost,
    }


def agent_record(entry: AgentEntry, view: dict[str, Any], now: float | None = None, *,
                 tool: str | None = None, pause_remaining_s: float | None = None) -> AgentRecord:
    """The record of `entry` with the scheduler's `view` of it; `now` (the scheduler's
    clock) times a pause in progress; `tool` and `pause_remaining_s` are the scheduler's
    view of that pause."""
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
        tool=tool,
        pause_remaining_s=pause_remaining_s,
        first_eta_s=entry.first_eta_s,
        first_eta_interval_s=list(entry.first_eta_interval_s) if entry.first_eta_interval_s else None,
        session=entry.session,
        error=entry.error,
        cost_source=entry.cost_source,
        jct_s=jct,
        metadata=entry.meta(),
        metadata_dropped=entry.metadata_dropped,
        **view,
    )
