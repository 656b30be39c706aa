"""The two levels of hierarchical GPS (tenant_clock.py): a tenant's own clock, and the walk
of the top level, where backlogged tenants share the rate R in proportion to their weights.

Pure functions of plain data: the top level's state at some time (`TopState`), the weight of
each tenant and R. Nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .virtual_clock import VirtualClock

if TYPE_CHECKING:
    from .tenant_clock import TenantClock

Tenant = Any  # a tenant's name (None: the one shared tenant)
Weight = Callable[[Tenant], float]


def _first(pair: tuple[float, Any]) -> float:
    return pair[0]


class TenantGps(VirtualClock):
    """A tenant's own GPS clock: the flat clock, keeping the sum of its live tags (its
    remaining work is that sum less |B| v) and, when `fresh` is a list, the departures it
    processes (key, time on this clock) for the top level to convert."""

    tag_sum: float = 0.0
    fresh: list[tuple[object, float]] | None = None  # departures since the last collection

    def _track(self, key: object, f: float) -> None:
        super()._track(key, f)
        self.tag_sum += f

    def _untrack(self, key: object) -> None:
        entry = self._entry.get(key)
        if entry is not None:
            self.tag_sum -= entry[0]
        super()._untrack(key)
        if not self._entry:
            self.tag_sum = 0.0  # no drift survives an empty backlog

    def _departed(self, key: object, t_dep: float) -> None:
        super()._departed(key, t_dep)
        if self.fresh is not None:
            self.fresh.append((key, t_dep))

    def remaining(self) -> float:
        return max(0.0, self.tag_sum - len(self._tags) * self.V) if self._tags else 0.0


@dataclass
class HierProjection:
    """H-GPS finish times at `now` with no further arrivals: of every backlogged agent
    (`finish`), and of an agent that would join a tenant with some cost (`arrival`)."""

    now: float
    finish: dict[object, float]
    clock: TenantClock

    def arrival(self, cost: float, tenant: Tenant = None) -> float:
        return self.clock.arrival_finish_time(cost, self.now, tenant)


@dataclass
class TopState:
    """The top level at some time: V, the backlogged tenants' weights and top tags."""

    t: float
    V: float
    tags: dict[Tenant, float]  # backlogged tenant -> T_t


def top_walk(state: TopState, until: float, weight: Weight, rate: float) -> TopState:
    """The top level moved to `until` on copies (departures of whole tenants)."""
    t, v, tags = state.t, state.V, dict(state.tags)
    order = sorted(((tag, tenant) for tenant, tag in tags.items()), key=_first)
    wsum = sum(weight(tn) for tn in tags)
    for tag, tenant in order:
        t_dep = t + (tag - v) * wsum / rate
        if t_dep > until:
            break
        t, v = t_dep, tag
        del tags[tenant]
        wsum -= weight(tenant)
    if tags and wsum > 0:
        v += (until - t) * rate / wsum
    return TopState(until, v, tags)


def time_of(state: TopState, target_v: float, weight: Weight, rate: float,
            extra: tuple[Tenant, float] | None = None) -> float:
    """When the top level reaches `target_v` from `state` with no further arrivals
    (`extra`: a tenant whose remaining work grows by that much now, as an arrival)."""
    tags = dict(state.tags)
    if extra is not None:
        tenant, work = extra
        tags[tenant] = max(tags.get(tenant, state.V), state.V) + work / weight(tenant)
    t, v = state.t, state.V
    wsum = sum(weight(tn) for tn in tags)
    for tag, tenant in sorted(((tg, tn) for tn, tg in tags.items()), key=_first):
        if tag >= target_v:
            break
        t += (tag - v) * wsum / rate
        v = tag
        wsum -= weight(tenant)
    if target_v <= v:
        return t
    return t + (target_v - v) * (wsum if wsum > 0 else 1.0) / rate


def sweep(state: TopState, points: list[tuple[float, object]], weight: Weight, rate: float,
          finish: dict[object, float]) -> None:
    """The times the top level reaches each of `points` (V, key), sorted by V, in one sweep
    of its breakpoints, into `finish`."""
    tags = sorted(((tg, tn) for tn, tg in state.tags.items()), key=_first)
    t, v = state.t, state.V
    wsum = sum(weight(tn) for tn in state.tags)
    i = 0
    for target, key in points:
        while i < len(tags) and tags[i][0] < target:
            t += (tags[i][0] - v) * wsum / rate
            v = tags[i][0]
            wsum -= weight(tags[i][1])
            i += 1
        finish[key] = t + (target - v) * (wsum if wsum > 0 else 1.0) / rate if target > v else t


def second_tenant_finish(solo: VirtualClock, cost: float, now: float, w: float, w_solo: float,
                         rate: float) -> float:
    """One tenant so far (its flat clock `solo`), an agent of a second tenant arriving with
    `cost`: its finish time, with its weight's share of R against the first tenant while
    both are backlogged."""
    if cost <= 0:
        return now
    v = solo.peek(now).V
    other = float(sum(f - v for f, _, _ in solo._sorted if f > v))  # the solo tenant's work left
    # both served together until the smaller (per weight) runs out
    v_new, v_old = cost / w, other / w_solo
    both = min(v_new, v_old)
    t = both * (w + w_solo) / rate
    if v_new > both:
        t += (v_new - both) * w / rate
    return now + t
