"""Calls of the agent API that many server tests make, on any server (fake or real engine)."""

from __future__ import annotations

import re
from typing import Any

import httpx

# The fields every agent record carries (docs/server.md, the agent API).
RECORD_FIELDS = {
    "id", "type", "state", "predicted_cost", "virtual_finish", "consumed_cost", "requests_total",
    "requests_done", "submitted_at", "fair_finish_s", "eta_s", "delay_bound_s", "deadline_s",
    "finished_at",
}


def register(client: httpx.Client, type_: str = "test_agent", prompt: str = "check this claim",
             **extra: Any) -> dict:
    """Register an agent (201 expected) and return its record."""
    r = client.post("/v1/agents", json={"type": type_, "prompt": prompt, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def complete(client: httpx.Client, agent_id: str | None, max_tokens: int, prompt: Any = "hello",
             **extra: Any) -> httpx.Response:
    """A completion of exactly `max_tokens` tokens (ignore_eos), tagged with `agent_id`."""
    headers = {"X-Justitia-Agent": agent_id} if agent_id else {}
    return client.post("/v1/completions", headers=headers,
                       json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                             **extra})


def scheduler_idle(client: httpx.Client) -> bool:
    """Nothing pending, running or reserved in the scheduler."""
    snap = client.get("/v1/scheduler").json()
    return snap["pending_requests"] == 0 and snap["running_requests"] == 0 and snap["reserved_kv"] == 0


def promise_clauses(reason: str) -> set[str]:
    """A promise's reasons, numbers left out. The two arrival clauses say the same thing (the
    deadline assumes the most arrivals it allows) and exclude each other: a server that saw
    more arrivals than the core says "work arrives at N%" where the core says "arrivals
    measured over T s", so both count as one kind of reason."""
    out = set()
    for c in (c.strip() for c in reason.split(";")):
        if c.startswith(("arrivals measured over", "work arrives at")):
            out.add("assumes the most arrivals it allows")
        elif c:
            out.add(re.sub(r"[0-9.]+", "#", c))
    return out


def core_views(snapshot: dict, records: list[dict], costs: list[float]) -> list[Any]:
    """What the scheduler core, as the simulator drives it, tells the agents of `records`
    (registered with the predicted `costs`) when given what the server had after those
    registrations (`snapshot`: M, tau, the bound limits and step, the arrival history) and
    the same moments of registration."""
    from server.scheduler import BoundLimits, Dispatcher

    # The bound's C_max counts the tenant's own predictions; its rate and iteration time
    # are the server's pessimistic ones (widened while cold).
    limits = {**snapshot["limits"]}
    limits["max_agent_cost"] = max(limits["max_agent_cost"], max(costs))
    core = Dispatcher("justitia", kv_capacity_tokens=snapshot["M"], iteration_time_s=snapshot["tau"],
                      limits=BoundLimits(**limits), block_size=32)
    core.set_iteration_time(snapshot["tau"], 0.0, bound_tau=snapshot["bound_tau"],
                            bound_iteration_s=snapshot["bound_step_s"],
                            uncertainty=snapshot["promise_reason"] or None)
    t0 = records[0]["submitted_at"]
    start = same_arrival_history(core, snapshot)
    return [core.register_agent(rec["id"], cost, start + rec["submitted_at"] - t0)
            for rec, cost in zip(records, costs, strict=True)]


def same_arrival_history(core: Any, snapshot: dict) -> float:
    """Give the core the arrival history the server has measured (the deadline widens while
    that is shorter than it looks ahead): one cancelled arrival at the core's time 0;
    returns when, on the core's clock, the registrations compared begin."""
    history = snapshot["arrival_history_s"]
    if history is None:
        return 0.0
    core.register_agent("history", 1.0, 0.0)
    core.cancel_agent("history", 0.0)
    return float(history)
