"""An exact offline GPS fluid simulation: the reference for fair finish times.

Independent of `VirtualClock` on purpose: it tracks each agent's *remaining work* and
shares the rate R equally among the agents that still have work, event by event (arrival or
departure), in O(n^2). Tests compare the two; the simulator reports `gps_finish_s` from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def gps_finish_times(arrivals: Sequence[float], costs: Sequence[float], rate: float) -> list[float]:
    """GPS fluid finish time of every agent (same order as the inputs).

    arrivals: arrival times (seconds); costs: total work of each agent (cost units);
    rate: R, cost units per second shared equally among agents that have work left.
    """
    if len(arrivals) != len(costs):
        raise ValueError("arrivals and costs differ in length")
    if rate <= 0:
        raise ValueError("rate must be positive")
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
    finish = [0.0] * len(arrivals)
    remaining: dict[int, float] = {}
    t = 0.0
    k = 0
    eps = 1e-9
    while k < len(order) or remaining:
        next_arrival = arrivals[order[k]] if k < len(order) else float("inf")
        if not remaining:
            t = max(t, next_arrival)
        if remaining:
            n = len(remaining)
            j_min = min(remaining, key=lambda j: (remaining[j], j))
            t_done = t + remaining[j_min] * n / rate
            if t_done <= next_arrival:
                served = remaining[j_min]
                t = t_done
                for j in list(remaining):
                    remaining[j] -= served
                    # every agent with (nearly) as little work left leaves now too
                    if remaining[j] <= eps * max(1.0, served):
                        finish[j] = t
                        del remaining[j]
                continue
            served = (next_arrival - t) * rate / n
            for j in remaining:
                remaining[j] -= served
            t = next_arrival
        k, _ = _admit(order, k, t, arrivals, costs, finish, remaining)
    return finish


def _admit(order: Sequence[int], k: int, t: float, arrivals: Sequence[float], costs: Sequence[float],
           finish: list[float], remaining: dict[int, float]) -> tuple[int, list[int]]:
    """Admit every agent arriving by `t` (from position `k` of the arrival `order`): one of
    no cost finishes on arrival, the others join `remaining`. Returns the next position and
    the agents that joined."""
    joined = []
    while k < len(order) and arrivals[order[k]] <= t:
        i = order[k]
        k += 1
        if costs[i] <= 0:
            finish[i] = max(t, arrivals[i])
        else:
            remaining[i] = float(costs[i])
            joined.append(i)
    return k, joined


def hierarchical_gps_finish_times(arrivals: Sequence[float], costs: Sequence[float], tenants: Sequence[object],  # noqa: C901
                                  rate: float, weights: Mapping[Any, float] | None = None) -> list[float]:
    """Hierarchical GPS fluid finish time of every agent (same order as the inputs).

    The rate R is shared among the tenants that have work left, in proportion to their
    weights (default 1), and each tenant's share equally among its agents that have work
    left. Independent of `TenantClock` on purpose: remaining work, event by event, O(n^2).
    With one tenant it is `gps_finish_times`.
    """
    if not len(arrivals) == len(costs) == len(tenants):
        raise ValueError("arrivals, costs and tenants differ in length")
    if rate <= 0:
        raise ValueError("rate must be positive")
    weights = weights or {}
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
    finish = [0.0] * len(arrivals)
    remaining: dict[int, float] = {}
    t = 0.0
    k = 0
    eps = 1e-9

    count: dict[object, int] = {}  # tenant -> its agents with work left

    def speeds() -> dict[int, float]:
        wsum = sum(weights.get(tn, 1.0) for tn in count)
        share = {tn: rate * weights.get(tn, 1.0) / wsum / n for tn, n in count.items()}
        return {j: share[tenants[j]] for j in remaining}

    while k < len(order) or remaining:
        next_arrival = arrivals[order[k]] if k < len(order) else float("inf")
        if not remaining:
            t = max(t, next_arrival)
        if remaining:
            speed = speeds()
            j_min = min(remaining, key=lambda j: (remaining[j] / speed[j], j))
            dt = remaining[j_min] / speed[j_min]
            if t + dt <= next_arrival:
                t += dt
                for j in list(remaining):
                    remaining[j] -= speed[j] * dt
                    if remaining[j] <= eps * max(1.0, speed[j] * dt):
                        finish[j] = t
                        del remaining[j]
                        count[tenants[j]] -= 1
                        if not count[tenants[j]]:
                            del count[tenants[j]]
                continue
            dt = next_arrival - t
            for j in remaining:
                remaining[j] -= speed[j] * dt
            t = next_arrival
        k, joined = _admit(order, k, t, arrivals, costs, finish, remaining)
        for i in joined:
            count[tenants[i]] = count.get(tenants[i], 0) + 1
    return finish
