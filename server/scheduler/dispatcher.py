"""The dispatcher: holds pending requests and hands them to the engine in policy order.

One object drives both the simulator and the live server. It never reads a clock and does no
I/O: callers pass `now` (seconds, non-decreasing) and the engine's state when they have it.

Life of an agent, as the live server sees it (it does not know future stages):

    disp = Dispatcher("justitia", kv_capacity_tokens=45_000, iteration_time_s=0.025)
    view = disp.register_agent("a17", predicted_cost=3.2e6, now=t)    # tag F = V(t) + C
    disp.submit(RequestSpec("r1", "a17", prompt_tokens=812, max_tokens=256), now=t)
    for spec in disp.admit(now=t, engine_free_kv_tokens=free):          # in order
        engine.add(spec, priority=disp.priority(spec.agent_id, spec.request_id))
    disp.on_request_finished("r1", prompt_tokens=812, output_tokens=120, now=t2)
    disp.finish_agent("a17", now=t3)   # or: ids = disp.cancel_agent("a17", now); engine.abort(ids)

A request is PENDING in the policy's queue (queues.py), RUNNING once admitted (its footprint
reserved), and leaves the table when it finishes or its agent goes (state.py). `admit` is one
loop over the queue: compute the budget, then peek at the next request, check that it fits,
pop it and mark it running.

Accounting: `reserved_kv` (footprints of admitted, unfinished requests), the pending queue and
the agent table return to zero once every agent is finished or cancelled.

Over-runs: an agent is charged its predicted cost when it arrives. Every request adds its
estimated cost to the agent's *committed* cost when submitted, and is corrected to its real
cost when it finishes. Whenever committed exceeds charged, the excess is charged too, with
WFQ's rule for new work: F = max(F, V(now)) + excess. So an agent that under-predicts falls
back in the queue as soon as the excess is visible; it never runs ahead for free. Under-runs
are not refunded (an agent's GPS share is fixed once charged).

Stateful policies (vtc, ewsjf, equinox) get their own instance (`Policy.bind(seed)`) and hear
about every request through hooks: `on_submit`, `on_admit`, `on_finish` (with the true lengths
and `now`), `on_drop`. The hooks receive the dispatcher as a `SchedulerContext` (tau,
compute_per_kv, leader), nothing more. `is_idle()` also asks the policy whether its own
bookkeeping (queued requests, provisional charges) is back to zero.

Events (register, submit, admit, finish, cancel) advance the virtual clock to `now`; reads
(`view`, `fair_finish_time`, `snapshot`) do not. docs/architecture.md shows the modules.

Promises (docs/concepts.md, "Promises no one else can break"): an agent enters the GPS
reference with its first request, not at registration; when it ends, the charge it did not
use is settled out of the reference, and ended agents' leftover fluid work is flushed when
the real system runs dry. The bound's C_max counts real (committed) work, plus the
predictions of the agent's own tenant only. ETAs come from `refresh_etas(now)` (eta.py), a
replay the caller runs off the request path; views read its cached result.

Shared prompt prefixes (prefix.py, docs/concepts.md "Shared prefixes"): a request whose spec
names a prefix chain reserves its private footprint plus the part of the chain no running
request holds (`PrefixHolds`: the footprint of the running set is the union of its prefix
blocks plus private tokens), and, under a KV-cost policy, is charged its private KV
token-time plus what its hold adds to its agent's (`PrefixLedger`). justitia-nocache
(`prefix_aware=False`) ignores chains: every prompt token private, as before.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .bounds import AgentShape, BoundLimits, delay_bound
from .cost import COMPUTE, KV, compute_cost, cost_function, kv_cost, kv_footprint
from .eta import MAX_ARRIVAL_SHARE, PROMISE_MIN_SPAN_S, EtaPass, TimeModel, WorkArrivals, eta_of, step_function
from .eta_interval import EtaCalibration
from .tight_promise import assumption, promise_factor, tight_deadline
from .pauses import PauseStats, stages_left
from .policies import FOOTPRINT, Justitia, Policy, get_policy
from .prefix import PrefixHolds, PrefixLedger, private_kv_cost, segments, shared_tokens, uncached_prompt
from .queues import RequestQueue, TenantQueue
from .state import (
    AgentState,
    AgentView,
    CostMix,
    ObservedLimits,
    RequestSpec,
    RequestState,
    RequestStatus,
)
from .tenant_clock import HierProjection, TenantClock

__all__ = ["AgentState", "AgentView", "Dispatcher", "RequestSpec", "RequestState", "RequestStatus"]

PREFIX_UNIT_TOKENS = 128
# Registrations between two ETA passes whose work later registrations' ETAs count: a bound
# on the scan in `_unpassed_work_before` under a flood (past it, the next pass counts them).
MAX_UNPASSED = 256
RUNNING = RequestStatus.RUNNING
DONE = RequestStatus.DONE


class Dispatcher:
    """Policy-ordered admission of requests into an engine with M tokens of KV cache."""

    def __init__(
        self,
        policy: str | Policy,
        kv_capacity_tokens: int,
        iteration_time_s: float,
        *,
        limits: BoundLimits | None = None,
        backfill: bool = False,
        backfill_depth: int = 32,
        now: float = 0.0,
        block_size: int = 1,
        seed: int = 0,
        time_model: TimeModel | None = None,
        arrival_window_s: float = 60.0,
        context_tokens: int | None = None,
        tenant_weights: Mapping[Any, float] | None = None,
        tenant_limits: Mapping[str | None, BoundLimits] | None = None,
    ) -> None:
        # A stateful policy (ewsjf, equinox) gets an instance of its own, seeded.
        self.policy = (get_policy(policy) if isinstance(policy, str) else policy).bind(seed)
        self._hooked = self.policy.hooked
        if kv_capacity_tokens <= 0 or iteration_time_s <= 0:
            raise ValueError("kv_capacity_tokens and iteration_time_s must be positive")
        self.kv_capacity = int(kv_capacity_tokens)
        self.tau = float(iteration_time_s)
        # The bound's iteration time and rate (a pessimistic percentile on the live server;
        # tau itself in the simulator), the typical iteration for ETAs, and why promises are
        # widened (None: firm). Set by `set_iteration_time`.
        self.bound_tau = self.tau
        self.bound_iteration_s = self.tau
        self.typical_iteration_s: float | None = None
        self.uncertainty: str | None = None
        self.time_model = time_model
        self._model_sustains = True  # the time model may set ETAs' rate (set_time_model)
        self.arrivals = WorkArrivals(window_s=arrival_window_s)
        # How far first ETAs have been off: the ETA interval's factors (eta_interval.py).
        self.eta_calibration = EtaCalibration()
        # Pauses between an agent's stages (tool calls), per type (pauses.py).
        self.pauses = PauseStats()
        self._eta: EtaPass | None = None
        # Agents registered since the last pass (refresh_etas), for the ETAs of agents
        # registered after them before the next pass (`_unpassed_work_before`).
        self._unpassed: list[AgentState] = []
        self._ended_backlog: set[str] = set()  # ended agents GPS has not finished yet
        self.backfill = backfill
        # A paged engine allocates whole blocks: a request holds ceil((p + d) / block) blocks,
        # so footprints are rounded up to blocks, or the engine runs out before M does.
        self.block_size = max(1, int(block_size))
        # The unit in which the live server hashes prompts into prefix chains: whole blocks,
        # at least PREFIX_UNIT_TOKENS of them, so that a chain has at most a few dozen
        # segments (admission, release and charges walk it; measured in
        # benchmarks/dispatch_overhead.py). A shared head is counted to the last whole unit.
        self.prefix_block = self.block_size * max(1, PREFIX_UNIT_TOKENS // self.block_size)
        self.backfill_depth = backfill_depth
        self._declared_limits = limits
        self._tenant_limits = dict(tenant_limits or {})  # declared per tenant (over `limits`)
        # The longest request the engine takes (prompt and output): what bounds requests
        # before any is seen (None: nothing).
        self.context_tokens = context_tokens
        self._observed = ObservedLimits()
        self._cost = cost_function(self.policy.cost_model)
        # justitia-c keeps its clock in compute tokens; its rate is M/tau converted with the
        # compute/KV ratio of the requests submitted so far (1/256 before any).
        self._mix = CostMix()
        # Hierarchical GPS: tenants (weighted by `tenant_weights`, default 1) first, then their
        # agents; with one tenant, the flat GPS clock (tenant_clock.py).
        self.clock = TenantClock(rate=self._rate(), now=now, weights=tenant_weights)
        self.agents: dict[str, AgentState] = {}
        self.requests: dict[str, RequestState] = {}
        self._seq = itertools.count()
        self.queue: RequestQueue = self.policy.make_queue(self, backfill_depth if backfill else 0)
        self.reserved_kv = 0  # footprints of admitted, unfinished requests
        self.reserved_prompt = 0  # prompts of admitted, unfinished requests
        self.holds = PrefixHolds()  # shared prefixes of running requests, each counted once
        self.running_footprint = 0  # footprints of running requests as if nothing were shared
        self.kv_saved_total = 0  # KV tokens not reserved again thanks to shared prefixes (sum)
        # Prompt tokens of finished requests, and how many of them the engine served from its
        # prefix cache (when it reports it): the prefix-hit rate.
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.pending_count = 0
        self.pending_kv = 0  # footprints of pending requests (the load an ETA expects)
        # recency-weighted prompt and output of a request: the batch an ETA expects and the
        # prompt tokens it prefills per step (each prompt once over its d decode steps)
        self._mean_prompt = 0.0
        self._mean_decode = 0.0
        self._mean_context = 0.0  # the whole prompt, cached or not: what attention reads
        self.running_count = 0

    # -- rate and capacity ------------------------------------------------------
    def _rate(self, tau: float | None = None) -> float:
        """M / tau in policy cost units (tau: the measured one unless given)."""
        rate = self.kv_capacity / (self.tau if tau is None else tau)
        if self.policy.cost_model == COMPUTE:
            rate *= self.compute_per_kv
        return rate

    @property
    def compute_per_kv(self) -> float:
        """Compute tokens (p + 2d) per unit of KV token-time over the requests submitted so
        far (1/256 before any): converts one cost model into the other."""
        return self._mix.compute_per_kv

    @property
    def rate(self) -> float:
        """R: cost units per second at full memory."""
        return self.clock.rate

    def set_iteration_time(self, tau: float, now: float, *, bound_tau: float | None = None,
                           bound_iteration_s: float | None = None, typical_iteration_s: float | None = None,
                           uncertainty: str | None = None) -> None:
        """A new measured iteration time: R = M / tau from `now` on.

        bound_tau / bound_iteration_s: the pessimistic rate (M / bound_tau) and iteration time
        of the deadlines promised from now on (default: tau); typical_iteration_s: one
        engine step, for ETAs' critical paths when there is no time model; uncertainty: why
        the server cannot promise firmly (promises are then "widened" and say why)."""
        if tau <= 0 or (bound_tau is not None and bound_tau <= 0):
            raise ValueError("tau must be positive")
        self.tau = float(tau)
        self.bound_tau = max(self.tau, float(bound_tau)) if bound_tau is not None else self.tau
        self.bound_iteration_s = float(bound_iteration_s) if bound_iteration_s else self.bound_tau
        self.typical_iteration_s = typical_iteration_s
        self.uncertainty = uncertainty
        self.clock.set_rate(self._rate(), now)

    def set_time_model(self, time_model: TimeModel | None, *, sustains: bool = True) -> None:
        """The engine's iteration time as a function of its batch (plain data: an
        EngineProfile, or the server's fitted model), for ETAs' critical paths; and, with
        `sustains`, for the rate ETAs divide by (`eta_rate`). A model that describes another
        engine (a prior not measured on this one, a fit to few steps) times critical paths
        but does not set that rate: the default prior made the rate three times the
        engine's at a fresh server's first burst (live, the middle of it told -0.75)."""
        self.time_model = time_model
        self._model_sustains = sustains

    def set_kv_capacity(self, kv_capacity_tokens: int, now: float) -> None:
        """Replicas added or removed: new M (and R) from `now` on."""
        if kv_capacity_tokens <= 0:
            raise ValueError("kv capacity must be positive")
        self.kv_capacity = int(kv_capacity_tokens)
        self.clock.set_rate(self._rate(), now)

    @property
    def limits(self) -> BoundLimits:
        """Declared workload limits, or the largest costs seen so far."""
        return self.limits_for(None)

    def limits_for(self, tenant: str | None) -> BoundLimits:
        """The limits an agent of `tenant` is promised against: the operator's, or what the
        scheduler can trust (real work of anyone, predictions of `tenant` only)."""
        declared = self._tenant_limits.get(tenant)
        if declared is not None:
            return declared
        if self._declared_limits is not None:
            return self._declared_limits
        limits = self._observed.as_limits(tenant)
        if self._no_request_seen:
            # Nothing bounds the requests an agent will wait behind but the engine's context:
            # with none seen, d_max was 0 and a fresh server's first agent was bounded as if
            # no request decoded (live: promised 23.1 s, it took 43.8 s).
            top = int(self.context_tokens or 0)
            limits = BoundLimits(max(limits.max_request_cost, kv_cost(0, top)), limits.max_agent_cost, top)
        return limits

    @property
    def _no_request_seen(self) -> bool:
        """No request submitted yet, and the context length known: the limits are its."""
        return self._declared_limits is None and bool(self.context_tokens) and self._observed.max_output_tokens <= 0

    @property
    def bound_step_s(self) -> float:
        """The step time of the bounds given now: the pessimistic iteration time, or the
        time model's step with the cache full (a critical path's steps under contention)."""
        return max(self.bound_iteration_s, self._saturated_iteration_s())

    def _bound(self, agent: AgentState) -> None:
        agent.bound = delay_bound(self.limits_for(agent.tenant), agent.shape, self.kv_capacity,
                                  self.bound_tau, self.bound_step_s)

    # -- agents -----------------------------------------------------------------
    def register_agent(
        self,
        agent_id: str,
        predicted_cost: float,
        now: float,
        *,
        agent_type: str | None = None,
        predicted_compute_cost: float | None = None,
        shape: AgentShape | None = None,
        eta_shape: AgentShape | None = None,
        tenant: str | None = None,
        cost_p90: float | None = None,
    ) -> AgentView:
        """Admit an agent with its predicted KV cost: its tag will be F = V + cost at its
        first request (V(now) + cost if that is now). `shape` is what its bound covers,
        `eta_shape` what its ETA expects where that differs (default: `shape`). `tenant`:
        whose predictions may widen its bound (None: one shared tenant). `cost_p90`: the
        p90 of its KV cost where the prediction is uncertain (a predictor's interval): its
        promise allows for that much; its tag and ETA do not."""
        self.clock.advance(now)  # an event: the promise below reads the clock at `now`
        if agent_id in self.agents:
            raise ValueError(f"agent {agent_id!r} is already registered")
        predicted_cost = max(0.0, float(predicted_cost))
        charge = predicted_cost
        if self.policy.cost_model == COMPUTE:
            if predicted_compute_cost is None:
                predicted_compute_cost = predicted_cost * self.compute_per_kv
            charge = max(0.0, float(predicted_compute_cost))
        self._observed.declare(tenant, predicted_cost)
        agent = AgentState(
            agent_id=agent_id,
            seq=next(self._seq),
            agent_type=agent_type,
            submitted_at=now,
            predicted_cost=predicted_cost,
            charged_cost=charge,
            virtual_finish=self.clock.tenant_v(tenant, now) + charge,  # provisional until it enters B
            bound=None,  # type: ignore[arg-type]  # set just below
            shape=shape or AgentShape(),
            eta_shape=eta_shape,
            tenant=tenant,
        )
        # the p90's ratio to the prediction, applied to the charge (whatever the cost model)
        if cost_p90 is not None and predicted_cost > 0.0 and cost_p90 > predicted_cost:
            agent.promise_charge = charge * float(cost_p90) / predicted_cost
        self._bound(agent)
        self.agents[agent_id] = agent
        if len(self._unpassed) < MAX_UNPASSED:
            self._unpassed.append(agent)
        self._promise(agent, now)
        self.arrivals.add(now, charge)  # after its own promise: it is not ahead of itself
        return self.view(agent_id, now)

    def _enter(self, agent: AgentState, now: float) -> None:
        """The agent's first request: it joins the GPS reference now, F = V(now) + charge.
        An agent that waited after registering has its deadline moved by its own wait."""
        agent.in_reference = True
        agent.fair_at = None  # the pass projected it as if joining then; it joins now
        agent.virtual_finish = self.clock.arrive(agent.agent_id, agent.charged_cost, now, agent.tenant)
        if now > agent.submitted_at:
            self._promise(agent, now)

    def _promise(self, agent: AgentState, now: float) -> None:
        """The deadline promised at `now`: the GPS finish projected with the work expected to
        arrive ahead of the agent, at the pessimistic rate, plus the delay bound at the
        pessimistic iteration time. Never a promise the scheduler expects to break: where
        its assumptions fail, the promise is widened and says why. Made again when the
        agent starts late or over-runs; it then only moves later."""
        v = self.clock.tenant_v(agent.tenant, now)
        # A predicted cost may be short of the real one. An agent that over-runs is charged
        # its excess as it shows, so its fair finish moves later with it: the promise allows
        # for the prediction's p90 (live, a fresh server promised its first agent 16.0 s on
        # a cold-start guess of a fraction of its cost; it finished at 37.4 s).
        extra = max(0.0, agent.promise_charge - agent.charged_cost)
        fluid = self._fair_finish_with(agent, extra, now) - now
        slow = self.bound_tau / self.tau
        # The share of the rate the deadline assumes (M / bound_tau), not of R: the deadline
        # serves its work at the pessimistic rate, and so must it serve the arrivals (a CI
        # run's stream was 72% of R but 104% of M / bound_tau: firm, when no promise holds).
        share = self.arrivals.fluid_ahead(max(0.0, agent.virtual_finish + extra - v)) / self.rate * slow
        reasons = []
        if self.uncertainty:
            reasons.append(self.uncertainty)
        if self._no_request_seen:
            reasons.append(f"no request seen yet: the bound assumes requests as long as the engine's context "
                           f"({self.context_tokens} tokens)")
        if extra > 0.0:
            reasons.append(f"its cost is a prediction: the deadline allows for {agent.promise_charge:.4g} units, "
                           f"the prediction's p90 ({agent.promise_charge / agent.charged_cost:.2g}x its charge)")
        if share > MAX_ARRIVAL_SHARE:
            reasons.append(f"work arrives at {share:.0%} of the engine's (pessimistic) rate: the deadline assumes "
                           f"{MAX_ARRIVAL_SHARE:.0%}")
            share = MAX_ARRIVAL_SHARE
        history = self.arrivals.history_s(now)
        horizon = fluid / (1.0 - share) * slow
        if share < MAX_ARRIVAL_SHARE and (history is None or history < max(PROMISE_MIN_SPAN_S, horizon)):
            # Arrivals seen over less time than the deadline looks ahead say little of what
            # arrives before it (the start of a burst looks like a light load: issue 18's
            # contended run broke the promise of its fifth agent so). Assume the most the
            # deadline can allow for, and say so. None seen at all (the first agent a server
            # sees) is no sign of a light load either: live, on a host 2.5x slower than the
            # calibrated one, the first agent of that run was overtaken by the 47 after it and
            # finished at 29.3 s against a promise of 28.5 s that counted no arrivals.
            seen = "no arrivals measured yet" if history is None else f"arrivals measured over {history:.1f} s"
            reasons.append(f"{seen}, less than the {horizon:.1f} s the deadline looks ahead: it assumes work "
                           f"arrives at {MAX_ARRIVAL_SHARE:.0%} of the engine's rate")
            share = MAX_ARRIVAL_SHARE
            horizon = fluid / (1.0 - share) * slow
        # Tool time: the type's p90 pause before each stage it has not started (pauses.py).
        pauses = self.pauses.p90_s(agent.agent_type) * stages_left(agent.shape.stages, agent.stages_started)
        worst = now + horizon + agent.bound.total_s + pauses
        # The deadline given: the tighter of the worst case and the ETA scaled by how far
        # ETAs have fallen short (tight_promise.py), which says what it rests on.
        # Tool time is not calibrated: an agent that may pause (stage boundaries ahead, and
        # pauses seen, or none seen yet) keeps the worst case.
        factor = promise_factor(self.eta_calibration)
        left = stages_left(agent.shape.stages, agent.stages_started)
        tight = worst
        if left == 0 or (self.pauses.any_seen and pauses <= 0.0):
            tight = tight_deadline(now, self.eta_time(agent.agent_id, now), 0.0, 0.0, factor,
                                   (agent.charged_cost + extra) / agent.charged_cost if agent.charged_cost > 0 else 1.0)
        deadline = min(worst, tight)
        if agent.deadline_at is not None and deadline <= agent.deadline_at:
            return  # made again (late start, over-run): a promise only ever moves later
        agent.deadline_at = deadline
        agent.promise_assumes = assumption(factor, self.eta_calibration.seen, self.arrivals.promise_rate) \
            if tight < worst else ""
        if not isinstance(self.policy, Justitia):
            agent.promise = "none"
            agent.promise_reason = f"policy {self.policy.name} does not keep the delay bound (Justitia's)"
        else:
            agent.promise = "widened" if reasons else "firm"
            agent.promise_reason = "; ".join(reasons)

    def _fair_finish_with(self, agent: AgentState, extra: float, now: float) -> float:
        """GPS finish time of the agent projected from now were its charge `extra` larger."""
        if extra <= 0.0:
            return self.fair_finish_time(agent.agent_id, now)
        if not agent.in_reference:
            return self.clock.arrival_finish_time(agent.charged_cost + extra, now, agent.tenant)
        return self.clock.projected_time(agent.virtual_finish + extra, now, agent.tenant)

    def finish_agent(self, agent_id: str, now: float) -> AgentView:
        """The agent is done: forget it (pending requests, if any, are dropped)."""
        self._agent(agent_id)
        self.clock.advance(now)  # an event, like every update: the clock moves to `now`
        view = self.view(agent_id, now)
        self._drop(agent_id, now, cancel=False)
        return view

    def cancel_agent(self, agent_id: str, now: float) -> list[str]:
        """Cancel an agent: returns the ids of its running requests, to abort in the engine."""
        return self._drop(agent_id, now, cancel=True)

    def _drop(self, agent_id: str, now: float, cancel: bool) -> list[str]:
        """Forget the agent (finished, failed, cancelled or expired alike for the reference:
        the charge it did not use leaves the GPS backlog; what it used stays)."""
        agent = self._agent(agent_id)
        running: list[str] = []
        pending: list[RequestState] = []
        for rid in sorted(agent.request_ids, key=lambda r: self.requests[r].seq):
            req = self.requests.pop(rid)
            if self._hooked:
                self.policy.on_drop(self, agent, req)
            if req.status is RUNNING:
                running.append(rid)
                self._release(req)
            else:
                self.pending_count -= 1
                self.pending_kv -= req.footprint
                pending.append(req)
        self.queue.remove_agent(agent, pending)
        # what it had admitted: its queued requests leave the bound's C_max with it
        admitted_kv = agent.committed_kv - sum(req.est_kv_cost for req in pending)
        for req in pending:
            req.status = DONE
        agent.pending = 0
        agent.request_ids.clear()
        agent.running = 0
        if agent.in_reference and self.clock.settle(
                agent_id, agent.charged_cost - agent.consumed_cost, now) is not None:
            if self.clock.tag(agent_id) is not None:
                self._ended_backlog.add(agent_id)
        self.clock.forget(agent_id)
        del self.agents[agent_id]
        self._observed.drop(agent, admitted_kv)
        if self.clock.hierarchical and isinstance(self.queue, TenantQueue):
            self.queue.retag(agent.tenant)  # its settled charge moved its tenant's order
        self._flush_if_dry(now)
        return running

    def _flush_if_dry(self, now: float) -> None:
        """The real system has nothing pending or running: every ended agent's work is done,
        so what GPS still holds of theirs is phantom (no backlog while the server is idle)."""
        if self._ended_backlog and self.pending_count == 0 and self.running_count == 0:
            self.clock.flush(self._ended_backlog, now)
            self._ended_backlog.clear()

    # -- requests ---------------------------------------------------------------
    def submit(self, spec: RequestSpec, now: float) -> None:
        """Queue a request of a registered agent."""
        agent = self._agent(spec.agent_id)
        if spec.request_id in self.requests:
            raise ValueError(f"request {spec.request_id!r} already submitted")
        if agent.idle_since is not None:  # back from a pause: its next stage starts
            self.pauses.observe(agent.agent_type, now - agent.idle_since)
            agent.idle_since = None
            agent.stages_started += 1
        elif agent.stages_started == 0:
            agent.stages_started = 1
        if not agent.in_reference:
            self._enter(agent, now)
        p, d, n = int(spec.prompt_tokens), spec.expected_tokens, spec.n
        footprint = n * (-(-kv_footprint(p, d) // self.block_size) * self.block_size)
        req = RequestState(
            spec=spec,
            seq=next(self._seq),
            submitted_at=now,
            footprint=footprint,
            est_cost=n * self._cost(p, d),
            est_kv_cost=n * kv_cost(p, d),
            private_footprint=footprint,
        )
        # n > 1: vLLM gives every sequence its own copy of the prompt (measured), no sharing
        if spec.prefix and n == 1 and self.policy.prefix_aware:
            self._share(agent, req, p, d)
        req.order = self.policy.request_order(req)
        self._mix.compute += n * compute_cost(p, d)
        self._mix.kv += req.est_kv_cost
        if self.policy.cost_model == COMPUTE:
            self.clock.set_rate(self._rate(), now)
        observed = self._observed
        observed.max_request_cost = max(observed.max_request_cost, req.est_kv_cost)
        observed.max_output_tokens = max(observed.max_output_tokens, spec.max_tokens)
        agent.committed_kv += req.est_kv_cost
        agent.longest_decode = max(agent.longest_decode, d)
        observed.commit(agent)
        self.requests[spec.request_id] = req
        agent.request_ids.add(spec.request_id)
        agent.requests_total += 1
        first = agent.pending == 0
        agent.pending += 1
        self.pending_count += 1
        self.pending_kv += req.footprint
        # the prompt tokens the engine will compute: what running requests hold is cached
        computed = p - self.holds.covered(req.segments) if req.segments else p
        if self._mean_prompt + self._mean_decode <= 0:
            self._mean_prompt, self._mean_decode, self._mean_context = float(computed), float(d), float(p)
        else:
            self._mean_prompt += 0.05 * (computed - self._mean_prompt)
            self._mean_decode += 0.05 * (d - self._mean_decode)
            self._mean_context += 0.05 * (p - self._mean_context)
        self.queue.push(agent, req)
        if self._hooked:
            self.policy.on_submit(self, agent, req, now, first)
        self._commit(agent, req.est_cost, now)
        self.queue.requeue(agent)

    def _share(self, agent: AgentState, req: RequestState, p: int, d: int) -> None:
        """A request naming shared prefixes: its segments, private footprint and charge."""
        segs = segments(req.spec.prefix, self.block_size)
        if not segs:
            return
        shared = shared_tokens(segs)
        req.segments = segs
        req.private_footprint = req.footprint - shared
        if self.policy.cost_model == KV:
            if agent.prefixes is None:
                agent.prefixes = PrefixLedger()
            req.shared_charge = agent.prefixes.charge(segs, d)
            req.est_cost = private_kv_cost(p, d, shared) + req.shared_charge

    def _unshare(self, agent: AgentState, req: RequestState) -> None:
        if req.segments and agent.prefixes is not None:
            agent.prefixes.release(req.segments)

    def _real_cost(self, req: RequestState, prompt_tokens: int, output_tokens: int,
                   lengths: Sequence[int]) -> float:
        """A finished request's cost in policy units: its private part at its true length,
        plus the charge of its shared prefixes (fixed at submission)."""
        if req.segments and self.policy.cost_model == KV:
            return private_kv_cost(prompt_tokens, output_tokens, shared_tokens(req.segments)) + req.shared_charge
        return sum(self._cost(prompt_tokens, d) for d in lengths)

    def on_request_finished(self, request_id: str, prompt_tokens: int, output_tokens: int,
                            now: float, each: Sequence[int] = (), cached_tokens: int | None = None) -> bool:
        """A request left the engine: release its reservation and account its real cost.

        `output_tokens` is the total over the request's sequences; `each` the output of each
        sequence when it sampled several (`n` > 1): each one is charged as one request.

        `cached_tokens`: the prompt tokens the engine served from its prefix cache, when it
        reports them (the prefix-hit rate; the ETAs' expected prefill per request).

        Returns False (and does nothing) for an id the dispatcher no longer knows: a request
        of a cancelled agent whose abort raced with its completion.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        agent = self._agent(req.spec.agent_id)
        agent.request_ids.discard(request_id)
        self._unshare(agent, req)
        if cached_tokens is not None and req.status is RUNNING:
            self._observe_cached(prompt_tokens, cached_tokens)
        if req.status is RUNNING:
            self._release(req)
            agent.running -= 1
            if self._hooked:
                self.policy.on_finish(self, agent, req, prompt_tokens, output_tokens, now)
        else:  # finished without being admitted (e.g. rejected): just drop it
            if self._hooked:
                self.policy.on_drop(self, agent, req)
            self.queue.remove(agent, req)
            req.status = DONE
            agent.pending -= 1
            self.pending_count -= 1
            self.pending_kv -= req.footprint
        lengths = each or (output_tokens,)
        real = self._real_cost(req, prompt_tokens, output_tokens, lengths)
        real_kv = sum(kv_cost(prompt_tokens, d) for d in lengths)
        agent.consumed_cost += real
        agent.consumed_kv += real_kv
        agent.committed_kv += real_kv - req.est_kv_cost
        self._observed.commit(agent)
        agent.requests_done += 1
        if agent.pending == 0 and agent.running == 0:
            agent.idle_since = now  # paused until it submits again (or finishes)
        self._commit(agent, real - req.est_cost, now)
        self.queue.requeue(agent)
        self._flush_if_dry(now)
        return True

    def _observe_cached(self, prompt_tokens: int, cached_tokens: int) -> None:
        cached = max(0, min(int(cached_tokens), int(prompt_tokens)))
        self.prompt_tokens_total += int(prompt_tokens)
        self.cached_tokens_total += cached
        # the engine's word beats the holds' guess made at submission
        self._mean_prompt += 0.05 * (uncached_prompt(prompt_tokens, cached) - self._mean_prompt)

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens served from the engine's prefix cache over all prompt tokens of the
        finished requests it reported on (None before any)."""
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else None

    @property
    def kv_shared_now(self) -> int:
        """KV tokens the running requests would reserve again if nothing were shared."""
        return self.running_footprint - self.reserved_kv

    def _commit(self, agent: AgentState, delta: float, now: float) -> None:
        """Add to the agent's committed cost; charge any excess over what it was charged."""
        agent.committed_cost += delta
        excess = agent.committed_cost - agent.charged_cost
        if excess > 1e-9 * max(1.0, agent.charged_cost):
            agent.virtual_finish = self.clock.extend(agent.agent_id, agent.virtual_finish, excess, now)
            agent.charged_cost += excess
            agent.fair_at = None  # its tag moved: the cached projection no longer applies
            self._bound(agent)
            self._promise(agent, now)  # its own over-run moves its deadline

    # -- admission --------------------------------------------------------------
    def admit(
        self,
        now: float,
        engine_free_kv_tokens: int | None = None,
        engine_free_slots: int | None = None,
        place: Callable[[RequestSpec, int], bool] | None = None,
    ) -> list[RequestSpec]:
        """The requests to hand to the engine now, in order.

        Footprint policies reserve p + expected d against min(M - reserved, engine free) and
        stop at the first request that does not fit (strict order; optional backfill).
        With several engine replicas, room in the sum is not enough (a request cannot span
        replicas): `place(spec, footprint)` must also find it a replica, and reserves there.
        Prompt policies admit while the prompt fits in free memory (the engine's report, or M
        minus admitted prompts) and leave preemption to the engine.
        """
        self.clock.advance(now)
        footprint = self.policy.admission == FOOTPRINT
        free = self._budget(footprint, engine_free_kv_tokens)
        slots = engine_free_slots
        queue = self.queue
        out: list[RequestSpec] = []
        while slots is None or slots > 0:
            req = queue.peek(now)
            if req is None:
                break
            need = self._need(req, footprint)
            fits = need <= free
            if fits and footprint and place is not None:
                # several replicas: one of them must hold the whole request (it reserves there)
                fits = place(req.spec, req.footprint)
            # An idle engine takes the head whatever its size: nothing would ever free room.
            if not fits and (self.running_count or out):
                if queue.defer():  # backfill: look past the blocked agent (restored below)
                    continue
                break
            agent = self.agents[req.spec.agent_id]
            queue.pop(agent, req)
            self._mark_running(agent, req, now)
            queue.requeue(agent)
            free -= need
            if slots is not None:
                slots -= 1
            out.append(req.spec)
        queue.restore()
        return out

    def _need(self, req: RequestState, footprint: bool) -> int:
        """Memory a request takes when admitted now: its footprint (footprint policies) or its
        prompt and one token (prompt policies), shared prefixes that running requests hold
        taken out."""
        if not req.segments:
            return req.footprint if footprint else req.spec.prompt_tokens + 1
        held = self.holds.marginal(req.segments)
        if footprint:
            return req.private_footprint + held
        return req.spec.prompt_tokens - shared_tokens(req.segments) + held + 1

    def _budget(self, footprint: bool, engine_free_kv_tokens: int | None) -> int:
        """Memory the next admissions may take: footprints against M (and what the engine
        reports free), or prompts against the engine's free memory."""
        if footprint:
            free = self.kv_capacity - self.reserved_kv
        else:
            free = self.kv_capacity - self.reserved_prompt
        if engine_free_kv_tokens is not None:
            free = min(free, engine_free_kv_tokens) if footprint else engine_free_kv_tokens
        return free

    def _mark_running(self, agent: AgentState, req: RequestState, now: float) -> None:
        req.status = RUNNING
        agent.pending -= 1
        agent.running += 1
        self.pending_count -= 1
        self.pending_kv -= req.footprint
        self.running_count += 1
        self.running_footprint += req.footprint
        if req.segments:
            held = self.holds.add(req.segments)
            self.reserved_kv += req.private_footprint + held
            self.reserved_prompt += req.spec.prompt_tokens - shared_tokens(req.segments) + held
            self.kv_saved_total += req.footprint - req.private_footprint - held
        else:
            self.reserved_kv += req.footprint
            self.reserved_prompt += req.spec.prompt_tokens
        if self._hooked:
            self.policy.on_admit(self, agent, req, now)

    def _release(self, req: RequestState) -> None:
        self.running_footprint -= req.footprint
        if req.segments:
            freed = self.holds.remove(req.segments)
            self.reserved_kv -= req.private_footprint + freed
            self.reserved_prompt -= req.spec.prompt_tokens - shared_tokens(req.segments) + freed
        else:
            self.reserved_kv -= req.footprint
            self.reserved_prompt -= req.spec.prompt_tokens
        self.running_count -= 1
        req.status = DONE

    def leader(self) -> AgentState | None:
        """The agent whose head request is admitted next (agent-keyed queues), or None."""
        return self.queue.leader()

    # -- views ------------------------------------------------------------------
    def _agent(self, agent_id: str) -> AgentState:
        try:
            return self.agents[agent_id]
        except KeyError:
            raise KeyError(f"unknown agent {agent_id!r}") from None

    def priority(self, agent_id: str, request_id: str | None = None) -> int:
        """An int rank for vLLM's priority scheduling; lower runs first."""
        agent = self._agent(agent_id)
        req = self.requests.get(request_id) if request_id is not None else None
        return self.policy.priority(agent, req)

    def fair_finish_time(self, agent_id: str, now: float) -> float:
        """GPS finish time of the agent projected from now (no further arrivals); for an
        agent that has not sent a request yet, as if it joined now. A read: the clock does
        not move."""
        agent = self._agent(agent_id)
        if agent.fair_at is not None:  # the last refresh_etas pass's (views stay O(1))
            return agent.fair_at if agent.in_reference else max(now, agent.fair_at)
        if not agent.in_reference:
            return self.clock.arrival_finish_time(agent.charged_cost, now, agent.tenant)
        return self.clock.finish_time(agent_id, agent.virtual_finish, now)

    def tenant_position(self, agent: AgentState) -> float:
        """The agent's H-GPS finish on the tenants' virtual scale at the clock's time: the
        order of tenants (`TenantQueue`). Its tag itself while there is one tenant."""
        return self.clock.position(agent.agent_id, agent.virtual_finish, self.clock.now)

    # -- ETAs (eta.py) -------------------------------------------------------------
    def recall_registrations(self, events: Sequence[tuple[float, float]], now: float) -> int:
        """Replay past registrations, (time on this clock, predicted KV cost) at or before
        `now`, into the arrivals ETAs forecast from, as if this dispatcher had seen them: a
        restarted server's history (server/relearn.py). Their agents are gone; nothing else
        changes. Call it before any agent registers. Returns how many were replayed."""
        unit = self.compute_per_kv if self.policy.cost_model == COMPUTE else 1.0
        kept = sorted((t, c) for t, c in events if t <= now and math.isfinite(t) and math.isfinite(c) and c >= 0)
        for t, cost in kept:
            self.arrivals.add(t, cost * unit)
        self.arrivals.freeze(now)
        return len(kept)

    def refresh_etas(self, now: float) -> None:
        """Replay the policy's order once (O(N log N)) and cache every agent's ETA. Called
        off the request path: the live server's housekeeping, the simulator's timer."""
        self.arrivals.freeze(now)
        for a in self._unpassed:
            a.eta_key_at = None
        self._unpassed.clear()
        reading = self.clock.peek(now)
        v = reading.V
        closing = self._gap_closing(reading.backlog)
        fair = self.clock.projection(now)  # every backlogged agent's GPS finish, one walk
        policy, it = self.policy, self._iteration_s()
        rate, per_unit, prefill_work = self._replay_rates()
        agents = list(self.agents.values())
        hier = self.clock.hierarchical
        if hier:  # tenants first: replay in the order of the agents' H-GPS finish
            keys = [self._eta_key(a, now, fair) for a in agents]
            tenant_v = {t: self.clock.tenant_v(t, now) for t in {a.tenant for a in agents}}
        else:
            keys = list(map(policy.static_key, agents))
        order = sorted(range(len(agents)), key=keys.__getitem__)
        keys = [keys[i] for i in order]
        prefix = [0.0] * (len(agents) + 1)
        # eta_of and _critical_path_s, inlined: this loop is the whole cost of the upkeep
        gap, costs, cprefix = policy.arrival_gap, self.arrivals._costs, self.arrivals._prefix
        unit = self._kv_unit()
        prefill_s = self._prefill_token_s()
        scale = self.arrivals.rate * per_unit / cprefix[-1] if cprefix and cprefix[-1] > 0 else 0.0
        cap = MAX_ARRIVAL_SHARE * rate
        span = self.arrivals.span_s
        total = 0.0
        for k, i in enumerate(order):
            a = agents[i]
            charged = a.charged_cost
            expected = a.expected_kv
            if expected is None:
                own = charged - a.consumed_cost
            else:  # re-predicted: its expected total (at least what it submitted) not yet consumed
                if expected < a.committed_kv:
                    expected = a.committed_kv
                own = (expected - a.consumed_kv) * unit
                charged = expected * unit
            if own < 0.0:
                own = 0.0
            shape = a.eta_shape or a.shape
            left = own / charged if charged > 0.0 else 1.0
            # _replay_work, inlined
            if shape.prefill_tokens is None or not prefill_work or charged <= 0.0:
                work = own * per_unit
            else:
                work = own + left * shape.prefill_tokens * prefill_work
            g = (gap(a, tenant_v[a.tenant] if hier else v, closing)) if scale else 0.0
            arriving = scale * cprefix[bisect_left(costs, g)] if g > 0.0 else 0.0
            r = rate - (arriving if arriving < cap else cap)
            if arriving > 0.0 and total + work > r * span:  # arrivals end after `span` (served_by)
                r = (total + work) / max(span, (total + work + arriving * span) / rate)
            if shape.critical_path_tokens is not None:
                path = ((shape.critical_path_tokens + max(1, shape.stages)) * it
                        + (shape.prefill_tokens or 0) * prefill_s) * left
            elif a.pending or a.running:
                path = (a.longest_decode + 1) * it
            else:
                path = 0.0
            start = total / r
            finish = (total + work) / r
            a.eta_at = now + (finish if finish > start + path else start + path)
            if not a.in_reference:
                a.fair_at = fair.arrival(a.charged_cost, a.tenant) if isinstance(fair, HierProjection) \
                    else fair.arrival(a.charged_cost)
            else:
                a.fair_at = fair.finish.get(a.agent_id)
            total += work
            prefix[k + 1] = total
        self._eta = EtaPass(now, rate, keys, prefix)
        # ended agents that GPS has finished since need no flush
        self._ended_backlog = {k for k in self._ended_backlog if self.clock.tag(k) is not None}

    def _eta_key(self, agent: AgentState, now: float, fair: Any = None) -> Any:
        """The agent's place in the ETA replay: the policy's static key, or, with several
        tenants under a tag-ordered policy, its H-GPS finish (tags of different tenants are
        on different scales)."""
        if not self.clock.hierarchical or not isinstance(self.policy, Justitia):
            return self.policy.static_key(agent)
        if fair is not None:
            t = (fair.finish.get(agent.agent_id) if agent.in_reference
                 else fair.arrival(agent.charged_cost, agent.tenant))
            if t is not None:
                return (t, agent.seq)
        if agent.eta_key_at is None:  # once per agent between passes (a burst's registrations)
            agent.eta_key_at = self.fair_finish_time(agent.agent_id, now)
        return (agent.eta_key_at, agent.seq)

    @property
    def eta_rate(self) -> float:
        """The rate ETAs divide work by: what the time model's engine sustains on the current
        mix with its cache full of reservations, else R. Not the measured R: that is the rate
        of the last stretch of steps, and at a burst's start every agent prefills its first
        prompt at once, so R read half the engine's long-run rate there (live contended48:
        0.94M against 1.6M units a second over the run) and the ETAs given in the burst
        divided tens of seconds of work by it."""
        tau = self._sustained_tau()
        return self.rate if tau is None else max(self.rate, self._rate(tau))

    def _replay_rates(self) -> tuple[float, float, float]:
        """What the ETA replay measures work in: (rate, per_unit, prefill_work).

        KV token-time does not see prefill: a verification agent's 2,500-token prompts with
        4-token answers cost little of it and take the engine 0.2 s each. With a time model the
        replay divides by R0, the rate of its engine on the current mix were prompts free, and
        adds each agent's own prefill (`AgentShape.prefill_tokens`, the share not yet done)
        as the work of that time at R0 (`prefill_work` a token); an agent whose prefill is
        unknown is assumed to prefill like the mix, its charge scaled by R0 / eta_rate
        (`per_unit`), which makes its time the one eta_rate gives. Without a time model,
        eta_rate, 1, 0."""
        rate = self.eta_rate
        tau = self._sustained_tau(prefill=False)
        if tau is None or (free := self._rate(tau)) <= rate:
            return rate, 1.0, 0.0
        return free, free / rate, self._prefill_token_s() * free

    def _sustained_tau(self, prefill: bool = True) -> float | None:
        """tau as the time model's engine sustains it on the mix of requests seen (the
        simulator's `EngineProfile.effective_tau_s`, from the running means): a request
        reserves p + d, holds p + d/2 on average, and prefills p over its d steps (not with
        `prefill=False`). None without a time model or a request seen."""
        if self.time_model is None or not self._model_sustains or self._mean_prompt + self._mean_decode <= 0:
            return None
        p, d = self._mean_prompt, max(1.0, self._mean_decode)
        it = self._step_holding(self.kv_capacity, prefill)
        served = self.kv_capacity * (p + d / 2) / (p + d)  # KV in use with the cache reserved full
        return self.kv_capacity * it / served if it > 0 and served > 0 else None

    def _gap_closing(self, backlog: int) -> float:
        """How far V advances while the arrivals the ETAs count go on (`arrivals.span_s`):
        GPS serves R a second among the backlogged agents, about half of the expected
        newcomers among them on average over the span."""
        arrivals = self.arrivals
        if arrivals.rate <= 0.0:
            return 0.0
        return arrivals.span_s * self.rate / max(1.0, backlog + 0.5 * arrivals.expected_agents())

    def _iteration_s(self) -> float:
        """One engine step with the work known now admitted: the time model's at the batch
        and KV the running and pending requests make (up to M), else the measured typical
        step, else tau."""
        if self.time_model is None:
            return self.typical_iteration_s or self.tau
        # the memory the work known now fills, or what the measured arrivals keep filled
        utilisation = min(1.0, self.arrivals.rate / self.rate)
        kv = min(self.kv_capacity, max(self.reserved_kv + self.pending_kv, utilisation * self.kv_capacity))
        if kv <= 0 or self._mean_prompt + self._mean_decode <= 0:
            return step_function(self.time_model)(1, 0, 0)
        return self._step_holding(kv)

    def _step_holding(self, kv: float, prefill: bool = True) -> float:
        """The time model's step with `kv` tokens reserved by requests of the current mix:
        a request reserves p + d (p the prompt it computes), prefills p once per d steps and
        attends over its whole prompt and d/2 outputs on average over its life (its shared
        prefixes too: attention reads them per request). (EngineProfile names it
        iteration_s, the server's fitted TimeModel step_s.)"""
        assert self.time_model is not None
        p, d = self._mean_prompt, max(1.0, self._mean_decode)
        batch = max(1.0, kv / (p + d))
        context = max(p, self._mean_context)
        prefilled = round(batch * p / d) if prefill else 0
        return step_function(self.time_model)(round(batch), prefilled, int(batch * (context + d / 2)))

    def _saturated_iteration_s(self) -> float:
        """One engine step with the whole cache in use by the current mix of requests (the
        time model's; 0 without one): the steps of a critical path under contention. The
        recent steps' p90 can be much shorter: live, a stream of small agents ran steps of
        2.2 ms at registration and 4.8 ms once the large agent's stages joined them."""
        if self.time_model is None or self._mean_prompt + self._mean_decode <= 0:
            return 0.0
        return self._step_holding(self.kv_capacity)

    def _prefill_token_s(self) -> float:
        """The time model's cost of one more prompt token computed in a step (0 without one):
        the prefill on an agent's critical path. A stage's requests decode once their prompts
        are in, and a burst's small verification agents are mostly prefill: one stage of
        2,540- and 2,386-token prompts with 4-60 output tokens took 3.4 s live, while the
        decode steps of its path made an ETA of 0.6 s."""
        if self.time_model is None:
            return 0.0
        step = step_function(self.time_model)
        return max(0.0, (step(1, 1024, 0) - step(1, 0, 0)) / 1024)

    def _kv_unit(self) -> float:
        """Policy cost units per unit of KV token-time (1 unless the policy charges compute)."""
        return self.compute_per_kv if self.policy.cost_model == COMPUTE else 1.0

    def _remaining(self, agent: AgentState) -> tuple[float, float]:
        """(work not yet done, its total) in policy units, for ETAs: the re-predicted total
        once there is one (`repredict`), else the charge."""
        if agent.expected_kv is None:
            return max(0.0, agent.charged_cost - agent.consumed_cost), agent.charged_cost
        unit = self._kv_unit()
        # never less than the requests it has already submitted
        expected = max(agent.expected_kv, agent.committed_kv)
        return max(0.0, expected - agent.consumed_kv) * unit, expected * unit

    def repredict(self, agent_id: str, expected_total_kv: float, now: float) -> None:
        """A new estimate of the agent's total KV cost as it runs (reprediction.py). ETAs
        (its own and those of agents queued behind it) use it from the next refresh; its
        virtual finish tag and charge do not move: only the over-run rule changes those."""
        agent = self._agent(agent_id)
        agent.expected_kv = max(float(expected_total_kv), agent.consumed_kv)
        agent.eta_at = None  # its remaining work changed: place it again until the next pass

    def _critical_path_s(self, agent: AgentState, it: float) -> float:
        """The agent's remaining critical path: its expected shape scaled by the share of its
        (re-predicted) cost not yet consumed, else the longest decode of its known requests."""
        own, total = self._remaining(agent)
        left = own / total if total > 0 else 1.0
        left = min(1.0, max(0.0, left))
        shape = agent.eta_shape or agent.shape
        if shape.critical_path_tokens is not None:
            return ((shape.critical_path_tokens + max(1, shape.stages)) * it
                    + (shape.prefill_tokens or 0) * self._prefill_token_s()) * left
        if agent.pending or agent.running:
            return (agent.longest_decode + 1) * it
        return 0.0

    def eta_time(self, agent_id: str, now: float) -> float:
        """Projected finish under the running policy (cached by `refresh_etas`; an agent the
        last pass did not see is placed in its order by binary search, O(log N))."""
        agent = self._agent(agent_id)
        if agent.eta_at is not None:
            return max(now, agent.eta_at) + self._pause_ahead(agent, now)
        key = self._eta_key(agent, now)
        rates = self._replay_rates()
        before = self._eta.work_before(key) if self._eta is not None else 0.0
        before += self._unpassed_work_before(agent, key, rates, now)
        reading = self.clock.peek(now)
        v = self.clock.tenant_v(agent.tenant, now) if self.clock.hierarchical else reading.V
        ahead = self.arrivals.ahead(self.policy.arrival_gap(agent, v, self._gap_closing(reading.backlog)))
        return eta_of(now, before, self._replay_work(agent, rates), rates[0], ahead * rates[1],
                      self._critical_path_s(agent, self._iteration_s()), self.arrivals.span_s) \
            + self._pause_ahead(agent, now)

    def _pause_ahead(self, agent: AgentState, now: float) -> float:
        """The tool time its ETA expects: its type's mean pause before each stage it has not
        started, less what it has already paused before the next one."""
        shape = agent.eta_shape or agent.shape
        left = stages_left(shape.stages, agent.stages_started)
        if left == 0:
            return 0.0
        mean = self.pauses.mean_s(agent.agent_type)
        paused = now - agent.idle_since if agent.idle_since is not None else 0.0
        return max(0.0, mean * left - min(paused, mean))

    def _replay_work(self, agent: AgentState, rates: tuple[float, float, float]) -> float:
        """The agent's remaining work in the replay's units (`_replay_rates`)."""
        own, total = self._remaining(agent)
        _, per_unit, prefill_work = rates
        prefill = (agent.eta_shape or agent.shape).prefill_tokens
        if prefill is None or not prefill_work or total <= 0.0:
            return own * per_unit
        return own + own / total * prefill * prefill_work

    def _unpassed_work_before(self, agent: AgentState, key: Any, rates: tuple[float, float, float],
                              now: float = 0.0) -> float:
        """Remaining work of the agents registered since the last pass that the policy
        orders before `agent`. A burst registers faster than passes run (every few hundred
        ms); without this, each of its agents got an ETA as if it were alone (the demo's 18
        agents, submitted at once: a first ETA of 0.0 s each, JCTs of 0.5-1.7 s)."""
        work = 0.0
        static_key: Callable[[AgentState], Any] = self.policy.static_key
        if self.clock.hierarchical and isinstance(self.policy, Justitia):
            static_key = functools.partial(self._eta_key, now=now)
        for a in self._unpassed:
            if a is not agent and self.agents.get(a.agent_id) is a and static_key(a) < key:
                work += self._replay_work(a, rates)
        return work

    def observe_jct(self, first_eta_s: float, jct_s: float) -> None:
        """A finished agent's JCT against its first ETA (both seconds from its submission):
        what the ETA intervals are calibrated on."""
        self.eta_calibration.observe(first_eta_s, jct_s)

    def view(self, agent_id: str, now: float) -> AgentView:
        """The agent's record: tag, costs and times (seconds from its submission)."""
        agent = self._agent(agent_id)
        fair = self.fair_finish_time(agent_id, now) - agent.submitted_at
        bound = agent.bound.total_s
        eta = self.eta_time(agent_id, now) - agent.submitted_at
        deadline = (agent.deadline_at if agent.deadline_at is not None else now) - agent.submitted_at
        return AgentView(
            agent_id=agent_id,
            agent_type=agent.agent_type,
            submitted_at=agent.submitted_at,
            predicted_cost=agent.predicted_cost,
            charged_cost=agent.charged_cost,
            consumed_cost=agent.consumed_cost,
            virtual_finish=agent.virtual_finish,
            fair_finish_s=fair,
            eta_s=eta,
            eta_interval_s=self.eta_calibration.interval(now - agent.submitted_at, eta, deadline),
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
            expected_cost=agent.expected_kv,
        )

    def snapshot(self, now: float, max_queue: int = 50) -> dict[str, Any]:
        """Plain-data state: policy, V, M, tau, backlog, queue (head first) with tags.
        A read: the clock does not move."""
        gps = self.clock.peek(now)
        waiting = [a for a in self.agents.values() if a.pending]
        # the head of the queue only: O(n log max_queue), whatever the number of agents
        queued = heapq.nsmallest(max_queue, waiting, key=self._queue_key)
        return {
            "policy": self.policy.name,
            "now": now,
            "V": gps.V,
            "M": self.kv_capacity,
            "block_size": self.block_size,
            "prefix_block": self.prefix_block,
            "tau": self.tau,
            "bound_tau": self.bound_tau,
            "bound_iteration_s": self.bound_iteration_s,
            "bound_step_s": self.bound_step_s,
            "promise": "widened" if self.uncertainty else "firm",
            "promise_reason": self.uncertainty or "",
            "rate": self.rate,
            "eta_rate": self.eta_rate,
            # what the ETA replay divides by and what one prompt token it adds takes
            "replay_rate": self._replay_rates()[0],
            "prefill_token_s": self._prefill_token_s(),
            "arrival_rate": self.arrivals.rate,
            "arrival_promise_rate": self.arrivals.promise_rate,
            "arrival_history_s": self.arrivals.history_s(now),
            "arrival_episodes": self.arrivals.episodes,
            "etas_refreshed_at": self._eta.now if self._eta is not None else None,
            "backlog": gps.backlog,
            "agents": len(self.agents),
            "queued_agents": len(waiting),
            "pending_requests": self.pending_count,
            "running_requests": self.running_count,
            "reserved_kv": self.reserved_kv,
            "kv_shared": self.kv_shared_now,
            "kv_saved_total": self.kv_saved_total,
            "prefix_hit_rate": self.prefix_hit_rate,
            "limits": dataclasses.asdict(self.limits),
            "queue": [
                {
                    "agent_id": a.agent_id,
                    "virtual_finish": a.virtual_finish,
                    "priority": self.policy.priority(a, self.queue.head(a)),
                    "pending": a.pending,
                    "running": a.running,
                }
                for a in queued
            ],
        }

    def _queue_key(self, agent: AgentState) -> Any:
        head = self.queue.head(agent)
        if head is not None:
            return self.policy.agent_key(agent, head)
        return self.policy.static_key(agent)  # a queue of requests, not agents (ewsjf)

    def is_idle(self) -> bool:
        """True when no agent, request or reservation is left (accounting back to zero)."""
        return (
            not self.agents
            and not self.requests
            and self.reserved_kv == 0
            and self.reserved_prompt == 0
            and self.running_footprint == 0
            and len(self.holds) == 0
            and self.pending_count == 0
            and self.running_count == 0
            and self.policy.is_idle()
        )
