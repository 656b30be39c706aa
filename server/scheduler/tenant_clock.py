"""Hierarchical GPS: tenants first, then the agents within each tenant.

Flat GPS shares the rate R equally among backlogged *agents*, so a tenant that splits its
work into more agents (or sends untagged requests, one agent each) takes more of everyone's
share. Hierarchical GPS (H-GPS) shares R among the backlogged *tenants* in proportion to
their weights w_t (`--tenant-weight TENANT=W`, default 1), and each tenant's share equally
among its own backlogged agents:

    top level:   dV/dt = R / sum_{t backlogged} w_t             (V: the tenants' virtual time)
    tenant t:    W_t, its service, grows by w_t dV while t is backlogged
    within t:    dv_t/dW_t = 1 / |B_t|,   F_j = v_t(a_j) + C_j   (an agent's tag in its tenant)

A tenant is backlogged while its own agents are (B_t not empty): its remaining work is
sum_{j in B_t} (F_j - v_t), so it leaves the top level when V reaches
T_t = V + remaining_t / w_t. Each tenant's clock is a `VirtualClock` whose "time" is the
tenant's service W_t (rate 1): arrivals, over-runs, cancellations and settlements inside
a tenant are exactly the flat clock's, in the tenant's own units.

Ordering across tenants. An agent's tag F_j only orders it within its tenant. Across
tenants the dispatcher orders tenants by the H-GPS finish, on the top-level scale V, of
each tenant's first agent in line h: P_t = V + X_h / w_t, with X_h the tenant's work GPS
does before h finishes (sum over B_t of min(F_k, F_h) - v_t). P_t does not change as time
passes (V grows by dV, X_h shrinks by w_t dV), nor when another tenant's work arrives; only
an event of tenant t moves it (`position`).

One tenant (the single-tenant server, a workload without tenants) is the flat clock, bit
for bit: until a second tenant's agent arrives, every call goes to one `VirtualClock` with
rate R on the caller's clock. At the second tenant that clock becomes the first tenant's
clock (rebased onto its service) and the hierarchy starts from there.

Like the flat clock, nothing here reads a wall clock (callers pass `now`), and reads
(`peek`, `finish_time`, `projected_time`, `arrival_finish_time`, `projection`,
`position`) do not move the clock. docs/concepts.md derives it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping

from .tenant_levels import (
    HierProjection,
    Tenant,
    TenantGps,
    TopState,
    second_tenant_finish,
    sweep,
    time_of,
    top_walk,
)
from .virtual_clock import ClockReading, Projection, VirtualClock

__all__ = ["HierProjection", "TenantClock"]

class TenantClock:
    """Hierarchical GPS over tenants (weighted) and their agents (equal shares)."""

    def __init__(self, rate: float, now: float = 0.0, weights: Mapping[Tenant, float] | None = None) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.weights: dict[Tenant, float] = {}
        for tenant, w in (weights or {}).items():
            if not w > 0:
                raise ValueError(f"tenant weight must be positive: {tenant!r}={w!r}")
            self.weights[tenant] = float(w)
        self.rate = rate
        self._now = now
        self._v = 0.0  # top level (multi-tenant only)
        self._solo: TenantGps | None = TenantGps(rate=rate, now=now)
        self._solo_tenant: Tenant = None
        self._solo_named = False  # a tenant has arrived (the solo clock is that tenant's)
        self._clocks: dict[Tenant, TenantGps] = {}
        self._tenant_of: dict[object, Tenant] = {}
        # top level: backlogged tenants, their tags T_t and service anchors (W_a, V_a)
        self._tags: dict[Tenant, float] = {}
        self._anchor: dict[Tenant, tuple[float, float]] = {}
        self._weight_sum = 0.0
        self._heap: list[tuple[float, int, Tenant]] = []
        self._seq = itertools.count()
        # the current stretch of constant slope: time and V at its start
        self._seg = (now, 0.0)
        self._deps: dict[object, tuple[float, float]] = {}  # key -> (time, V) of its H-GPS finish

    @property
    def now(self) -> float:
        """The time the clock was last moved to."""
        return self._solo.now if self._solo is not None else self._now

    @property
    def departures(self) -> dict[object, float]:
        """Key -> GPS finish time of the agents that have finished in the reference."""
        if self._solo is not None:
            return self._solo.departures
        return {key: t for key, (t, _) in self._deps.items()}

    @property
    def flat(self) -> VirtualClock | None:
        """The flat clock while there is one tenant (None once there are two)."""
        return self._solo

    @property
    def V(self) -> float:
        """The virtual time: the flat clock's with one tenant, else the top level's."""
        return self._solo.V if self._solo is not None else self._v

    # -- mode -----------------------------------------------------------------------
    @property
    def hierarchical(self) -> bool:
        """True once agents of two tenants have arrived."""
        return self._solo is None

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0)

    def tenant_of(self, key: object) -> Tenant:
        return self._tenant_of.get(key)

    def _split(self, tenant: Tenant, now: float) -> None:
        """A second tenant arrives: the solo clock becomes its tenant's, rebased onto that
        tenant's service (rate 1, service 0 now), and the top level starts at V = 0."""
        solo = self._solo
        assert solo is not None
        solo.advance(now)
        solo.now, solo.rate = 0.0, 1.0
        solo.fresh = []
        self._clocks[self._solo_tenant] = solo
        self._solo = None
        self._now, self._v = now, 0.0
        self._seg = (now, 0.0)
        self._retag(self._solo_tenant)

    def _clock(self, tenant: Tenant, now: float) -> TenantGps:
        """The tenant's clock, synced to `now` (the clock advanced to `now` first)."""
        clock = self._clocks.get(tenant)
        if clock is None:
            clock = self._clocks[tenant] = TenantGps(rate=1.0, now=0.0)
            clock.fresh = []
        self._sync(tenant)
        return clock

    # -- top level ------------------------------------------------------------------
    def _service(self, tenant: Tenant, v: float) -> float:
        """The tenant's service W_t when the top level is at `v` (backlogged tenants)."""
        anchor = self._anchor.get(tenant)
        if anchor is None:
            return self._clocks[tenant].now
        w_a, v_a = anchor
        return w_a + self.weight(tenant) * (v - v_a)

    def _sync(self, tenant: Tenant) -> None:
        """Advance the tenant's clock to its service now, converting its departures."""
        clock = self._clocks[tenant]
        if tenant in self._tags:
            clock.advance(max(clock.now, self._service(tenant, self._v)))
        if clock.fresh:
            w_a, v_a = self._anchor.get(tenant, (clock.now, self._v))
            w = self.weight(tenant)
            seg_t, seg_v = self._seg
            slope = self.rate / self._weight_sum if self._weight_sum > 0 else 0.0
            for key, w_dep in clock.fresh:
                v_dep = v_a + (w_dep - w_a) / w
                t_dep = seg_t + (v_dep - seg_v) / slope if slope > 0 else self._now
                self._deps[key] = (min(max(t_dep, seg_t), self._now), v_dep)
            clock.fresh.clear()

    def _top_event(self) -> None:
        """The slope changes now: every tenant's clock is brought to now first, so that the
        departures they process later fall in one stretch of constant slope."""
        for tenant in list(self._tags):
            self._sync(tenant)
        self._seg = (self._now, self._v)

    def _retag(self, tenant: Tenant) -> None:
        """The tenant's remaining work changed (at the clock's time): its top tag, and
        whether it is backlogged."""
        clock = self._clocks[tenant]
        self._sync(tenant)
        remaining = clock.remaining()
        if clock.backlog and remaining > 0.0:
            if tenant not in self._tags:
                self._top_event()
                self._anchor[tenant] = (clock.now, self._v)
                self._weight_sum += self.weight(tenant)
            tag = self._v + remaining / self.weight(tenant)
            self._tags[tenant] = tag
            heapq.heappush(self._heap, (tag, next(self._seq), tenant))
        elif tenant in self._tags:
            self._leave(tenant)

    def _leave(self, tenant: Tenant) -> None:
        self._top_event()
        del self._tags[tenant]
        self._anchor.pop(tenant, None)
        self._weight_sum -= self.weight(tenant)
        if not self._tags:
            self._weight_sum = 0.0
        self._seg = (self._now, self._v)

    # -- updates --------------------------------------------------------------------
    def advance(self, now: float) -> float:
        """Move to `now`, processing tenants' departures from the top level. Returns V
        (the solo clock's V while there is one tenant)."""
        if self._solo is not None:
            self._now = max(self._now, now)
            return self._solo.advance(now)
        if now < self._now:
            if self._now - now > 1e-9:
                raise ValueError(f"time went backwards: {now} < {self._now}")
            return self._v
        guard = 0
        while self._tags and guard < 10_000:
            guard += 1
            tag, _, tenant = self._heap[0]
            if self._tags.get(tenant) != tag:
                heapq.heappop(self._heap)
                continue
            t_dep = self._now + (tag - self._v) * self._weight_sum / self.rate
            if t_dep > now:
                break
            heapq.heappop(self._heap)
            self._now, self._v = max(self._now, t_dep), tag
            clock = self._clocks[tenant]
            self._sync(tenant)
            if clock.backlog and clock.remaining() > 1e-9 * max(1.0, abs(clock.V)):
                self._retag(tenant)  # rounding left it a hair of work: a new tag just ahead
                continue
            for key in list(clock._tags):  # a rounding residue: done now
                clock.flush([key], clock.now)
                self._deps[key] = (self._now, self._v)
            self._leave(tenant)
        if self._tags and self._weight_sum > 0:
            self._v += (now - self._now) * self.rate / self._weight_sum
        self._now = now
        return self._v

    def arrive(self, key: object, cost: float, now: float, tenant: Tenant = None) -> float:
        """Agent `key` of `tenant` arrives with `cost`: its tag in its tenant's clock."""
        if self._solo is not None:
            if not self._solo_named:
                self._solo_tenant, self._solo_named = tenant, True
            if tenant == self._solo_tenant:
                self._tenant_of[key] = tenant
                self._now = max(self._now, now)
                return self._solo.arrive(key, cost, now)
            self._split(tenant, now)
        self.advance(now)
        clock = self._clock(tenant, now)
        f = clock.arrive(key, cost, clock.now)
        self._tenant_of[key] = tenant
        if cost == 0:
            self._deps[key] = (now, self._v)
        self._retag(tenant)
        return f

    def _for(self, key: object, now: float) -> TenantGps | None:
        """The clock of `key`'s tenant, synced to `now` (None: the solo clock's mode)."""
        if self._solo is not None:
            return None
        self.advance(now)
        tenant = self._tenant_of.get(key)
        if tenant not in self._clocks:
            return None
        return self._clock(tenant, now)

    def extend(self, key: object, old_tag: float, extra: float, now: float) -> float:
        return self._move(TenantGps.extend, key, old_tag, extra, now)

    def shift(self, key: object, old_tag: float, extra: float, now: float) -> float:
        return self._move(TenantGps.shift, key, old_tag, extra, now)

    def _move(self, move: Callable[[TenantGps, object, float, float, float], float],
              key: object, old_tag: float, extra: float, now: float) -> float:
        """`extend` or `shift` on the clock that holds `key`: the solo clock, or its tenant's
        (at that clock's time, then the tenant re-tagged); a key of no tenant only moves."""
        if self._solo is not None:
            self._now = max(self._now, now)
            return move(self._solo, key, old_tag, extra, now)
        clock = self._for(key, now)
        if clock is None:
            return old_tag + max(0.0, extra)
        f = move(clock, key, old_tag, extra, clock.now)
        self._retag(self._tenant_of[key])
        return f

    def remove(self, key: object, now: float) -> None:
        if self._solo is not None:
            self._solo.remove(key, now)
            return
        clock = self._for(key, now)
        if clock is not None:
            clock.remove(key, clock.now)
            self._retag(self._tenant_of[key])

    def settle(self, key: object, unused: float, now: float) -> float | None:
        if self._solo is not None:
            return self._solo.settle(key, unused, now)
        clock = self._for(key, now)
        if clock is None:
            return None
        f = clock.settle(key, unused, clock.now)
        self._retag(self._tenant_of[key])
        return f

    def flush(self, keys: Iterable[object], now: float) -> None:
        if self._solo is not None:
            self._solo.flush(keys, now)
            return
        self.advance(now)
        touched: set[Tenant] = set()
        for key in keys:
            tenant = self._tenant_of.get(key)
            if tenant in self._clocks:
                clock = self._clock(tenant, now)
                clock.flush([key], clock.now)
                touched.add(tenant)
        for tenant in touched:
            self._retag(tenant)

    def set_rate(self, rate: float, now: float) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        if self._solo is not None:
            self._solo.set_rate(rate, now)
            self.rate = rate
            return
        self.advance(now)
        self._top_event()
        self.rate = rate

    def forget(self, key: object) -> None:
        if self._solo is not None:
            self._solo.forget(key)
        else:
            tenant = self._tenant_of.get(key)
            if tenant in self._clocks:
                self._clocks[tenant].forget(key)
            self._deps.pop(key, None)
        self._tenant_of.pop(key, None)

    # -- reads ----------------------------------------------------------------------
    @property
    def backlog(self) -> int:
        if self._solo is not None:
            return self._solo.backlog
        return sum(c.backlog for c in self._clocks.values())

    def tag(self, key: object) -> float | None:
        if self._solo is not None:
            return self._solo.tag(key)
        tenant = self._tenant_of.get(key)
        clock = self._clocks.get(tenant)
        return clock.tag(key) if clock is not None else None

    def _state(self, now: float) -> TopState:
        now = max(now, self._now)
        return top_walk(TopState(self._now, self._v, dict(self._tags)), now, self.weight, self.rate)

    def _inner_reading(self, tenant: Tenant, state: TopState) -> tuple[TenantGps | None, float]:
        """The tenant's clock and its service at the top state's time (a read)."""
        clock = self._clocks.get(tenant)
        if clock is None:
            return None, 0.0
        if tenant in self._tags:
            w_a, v_a = self._anchor[tenant]
            w = self.weight(tenant)
            if tenant in state.tags:
                return clock, max(clock.now, w_a + w * (state.V - v_a))
            # it left the top level before the state's time: all of its work is done
            return clock, max(clock.now, w_a + w * (self._tags[tenant] - v_a))
        return clock, clock.now

    def peek(self, now: float) -> ClockReading:
        """V and |B| at `now` without moving the clock (V: the top level's, or the solo
        clock's with one tenant)."""
        if self._solo is not None:
            return self._solo.peek(now)
        state = self._state(now)
        backlog = 0
        for tenant in state.tags:
            clock, service = self._inner_reading(tenant, state)
            if clock is not None:
                backlog += clock.peek(service).backlog
        return ClockReading(state.V, backlog, [])

    def tenant_v(self, tenant: Tenant, now: float) -> float:
        """v_t at `now`: the virtual time of the tenant's own clock (its agents' tags are
        on this scale). The solo clock's V while there is one tenant."""
        if self._solo is not None:
            return self._solo.peek(now).V if tenant == self._solo_tenant or not self._solo_named else 0.0
        state = self._state(now)
        clock, service = self._inner_reading(tenant, state)
        return clock.peek(service).V if clock is not None else 0.0

    def _work_to(self, clock: TenantGps, service: float, tag: float, joining: int = 0) -> float:
        """Service the tenant must receive from `service` until its clock reaches `tag`."""
        reading = clock.peek(service)
        if joining:
            return clock._project(reading, tag, service, joining=joining) - service
        if tag <= reading.V:
            return 0.0
        return clock._project(reading, tag, service) - service

    def position(self, key: object, tag: float, now: float) -> float:
        """The agent's H-GPS finish on the top level's scale V (no further arrivals): the
        tenant order's key. Constant while nothing happens in its tenant."""
        if self._solo is not None:
            return tag
        tenant = self._tenant_of.get(key)
        state = self._state(now)
        clock, service = self._inner_reading(tenant, state)
        if clock is None or key not in clock._tags:
            dep = self._deps.get(key)
            return dep[1] if dep is not None else state.V
        work = self._work_to(clock, service, tag)
        if work <= 0.0:
            dep = self._deps.get(key)
            return dep[1] if dep is not None else state.V
        return state.V + work / self.weight(tenant)

    def finish_time(self, key: object, tag: float, now: float) -> float:
        """H-GPS finish time of `key` as seen at `now` (its departure if done)."""
        if self._solo is not None:
            return self._solo.finish_time(key, tag, now)
        tenant = self._tenant_of.get(key)
        state = self._state(now)
        clock, service = self._inner_reading(tenant, state)
        if clock is None or key not in clock._tags:
            dep = self._deps.get(key)
            return dep[0] if dep is not None else now
        work = self._work_to(clock, service, tag)
        if work <= 0.0:
            dep = self._deps.get(key)
            return min(now, dep[0]) if dep is not None else now
        return time_of(state, state.V + work / self.weight(tenant), self.weight, self.rate)

    def projected_time(self, tag: float, now: float, tenant: Tenant = None) -> float:
        """When `tenant`'s clock will reach `tag` if nothing else arrives."""
        if self._solo is not None:
            return self._solo.projected_time(tag, now)
        state = self._state(now)
        clock, service = self._inner_reading(tenant, state)
        if clock is None:
            return now
        work = self._work_to(clock, service, tag)
        if work <= 0.0:
            return now
        return time_of(state, state.V + work / self.weight(tenant), self.weight, self.rate)

    def arrival_finish_time(self, cost: float, now: float, tenant: Tenant = None) -> float:
        """H-GPS finish time of an agent of `tenant` that would arrive at `now` with `cost`."""
        if self._solo is not None:
            if self._solo_named and tenant != self._solo_tenant:
                return second_tenant_finish(self._solo, cost, now, self.weight(tenant),
                                            self.weight(self._solo_tenant), self.rate)
            return self._solo.arrival_finish_time(cost, now)
        if cost <= 0:
            return now
        state = self._state(now)
        clock, service = self._inner_reading(tenant, state)
        if clock is None:
            work = cost
        else:
            reading = clock.peek(service)
            work = clock._project(reading, reading.V + cost, service, joining=1) - service
        return time_of(state, state.V + work / self.weight(tenant), self.weight, self.rate, (tenant, cost))

    def projection(self, now: float) -> Projection | HierProjection:
        """Every backlogged agent's finish time at `now` (no further arrivals)."""
        if self._solo is not None:
            return self._solo.projection(now)
        state = self._state(now)
        finish: dict[object, float] = {}
        points: list[tuple[float, object]] = []
        for tenant, clock in self._clocks.items():
            _, service = self._inner_reading(tenant, state)
            proj = clock.projection(service)
            w = self.weight(tenant)
            for key, w_fin in proj.finish.items():
                if key in clock._tags and w_fin > service:
                    points.append((state.V + (w_fin - service) / w, key))
                else:
                    dep = self._deps.get(key)
                    finish[key] = min(now, dep[0]) if dep is not None else now
        points.sort(key=lambda p: p[0])
        sweep(state, points, self.weight, self.rate, finish)
        return HierProjection(now, finish, self)
