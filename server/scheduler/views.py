"""What the dispatcher tells: an agent's record (`AgentView`) and the scheduler's state as
plain data (`snapshot`). Reads only: neither moves the clock."""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import TYPE_CHECKING, Any

from .state import AgentState, AgentView, PromiseKind

if TYPE_CHECKING:
    from .dispatcher import Dispatcher


def agent_view(d: Dispatcher, agent: AgentState, now: float) -> AgentView:
    """The agent's record: tag, costs and times (seconds from its submission)."""
    fair = d.fair_finish_time(agent.agent_id, now) - agent.submitted_at
    bound = agent.bound.total_s
    # the replay's ETA, its remaining time scaled by the agent's calibration (eta_interval.py)
    elapsed = now - agent.submitted_at
    deadline = (agent.deadline_at if agent.deadline_at is not None else now) - agent.submitted_at
    eta, interval = _eta_and_interval(d, agent, now, elapsed, deadline)
    return AgentView(
        agent_id=agent.agent_id,
        agent_type=agent.agent_type,
        submitted_at=agent.submitted_at,
        predicted_cost=agent.predicted_cost,
        charged_cost=agent.charged_cost,
        consumed_cost=agent.consumed_cost,
        virtual_finish=agent.virtual_finish,
        fair_finish_s=fair,
        eta_s=eta,
        eta_interval_s=interval,
        delay_bound_s=bound,
        deadline_s=deadline,
        bound=agent.bound,
        requests_total=agent.requests_total,
        requests_done=agent.requests_done,
        pending=agent.pending,
        running=agent.running,
        promise=agent.promise,
        promise_reason=agent.promise_reason,
        promise_assumes=agent.promise_assumes,
        tool_allowance_s=agent.tool_allowance_s,
        paused_s=d.pauses.paused_so_far(agent, now),
        expected_cost=agent.expected_kv,
        tool=agent.tool,
        pause_remaining_s=d.pauses.remaining_s(agent, now),
    )


def _eta_and_interval(d: Dispatcher, agent: AgentState, now: float, elapsed: float,
                      deadline: float) -> tuple[float, tuple[float, float]]:
    """The ETA told and its [p10, p90] interval, seconds from the agent's submission: the
    replay's remaining time scaled by the agent's calibration (eta_interval.py), or, for an
    agent whose ETA counts tool time apart (`eta_tools`), its engine time and tool time weighed apart
    (tool_time.py). The interval's p90 is no later than the deadline promised when that is
    later than the ETA told."""
    with_tools = d.etas.told_with_tools(agent, now) if agent.eta_tools else None
    if with_tools is not None:
        told, low, high = (elapsed + x for x in with_tools[:3])
        if deadline >= told:
            # where the pauses seen cannot place the high end, the deadline promised does:
            # it allows the longest pause seen before one stage and the p90 before the others
            high = deadline if with_tools[3] else min(high, deadline)
        return told, (low, max(high, told))
    replay = d.etas.eta_time(agent, now) - agent.submitted_at
    eta = elapsed + max(0.0, replay - elapsed) * agent.eta_scale
    return eta, d.etas.calibration.interval(elapsed, replay, deadline, agent.promise_context, agent.eta_scale,
                                            agent.eta_pausing)


def server_promise(d: Dispatcher) -> PromiseKind:
    """What the server can promise now: widened while it is uncertain (`d.uncertainty`
    says why), else firm."""
    return PromiseKind.WIDENED if d.uncertainty else PromiseKind.FIRM


def snapshot(d: Dispatcher, now: float, max_queue: int = 50) -> dict[str, Any]:
    """Plain-data state: policy, V, M, tau, backlog, queue (head first) with tags.
    A read: the clock does not move."""
    gps = d.clock.peek(now)
    waiting = [a for a in d.agents.values() if a.pending]
    # the head of the queue only: O(n log max_queue), whatever the number of agents
    queued = heapq.nsmallest(max_queue, waiting, key=functools.partial(_queue_key, d))
    return {
        "policy": d.policy.name,
        "now": now,
        "V": gps.V,
        "M": d.kv_capacity,
        "block_size": d.block_size,
        "prefix_block": d.prefix_block,
        "tau": d.tau,
        "bound_tau": d.bound_tau,
        "bound_iteration_s": d.bound_iteration_s,
        "bound_step_s": d.promises.bound_step_s,
        "promise": server_promise(d),
        "promise_reason": d.uncertainty or "",
        "rate": d.rate,
        "eta_rate": d.eta_rate,
        # what the ETA replay divides by and what one prompt token it adds takes
        "replay_rate": d.etas.replay_rates()[0],
        "prefill_token_s": d.etas.prefill_token_s(),
        "arrival_rate": d.arrivals.rate,
        "arrival_promise_rate": d.arrivals.promise_rate,
        "arrival_history_s": d.arrivals.history_s(now),
        "arrival_episodes": d.arrivals.episodes,
        "etas_refreshed_at": d.etas.last_pass.now if d.etas.last_pass is not None else None,
        "backlog": gps.backlog,
        "agents": len(d.agents),
        "queued_agents": len(waiting),
        "pending_requests": d.ledger.pending_count,
        "running_requests": d.ledger.running_count,
        "reserved_kv": d.ledger.reserved_kv,
        "kv_shared": d.ledger.kv_shared_now,
        "kv_saved_total": d.ledger.kv_saved_total,
        "prefix_hit_rate": d.ledger.prefix_hit_rate,
        "pauses": d.pauses.summary(),
        "limits": dataclasses.asdict(d.promises.limits_for(None)),
        "queue": [
            {
                "agent_id": a.agent_id,
                "virtual_finish": a.virtual_finish,
                "priority": d.policy.priority(a, d.queue.head(a)),
                "pending": a.pending,
                "running": a.running,
            }
            for a in queued
        ],
    }


def _queue_key(d: Dispatcher, agent: AgentState) -> Any:
    head = d.queue.head(agent)
    if head is not None:
        return d.policy.agent_key(agent, head)
    return d.policy.static_key(agent)  # a queue of requests, not agents (ewsjf)
