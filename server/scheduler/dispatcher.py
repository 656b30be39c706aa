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

A request is PENDING in the policy's queue (queues.py), RUNNING once admitted, and leaves the
table when it finishes or its agent goes (state.py). The dispatcher composes:

- `RequestCosts` (charges.py): a request's footprint and estimated cost, its real cost;
- `KvLedger` (kv_ledger.py): reservations of running requests, footprints of pending ones;
- `TenantClock` (tenant_clock.py): the GPS reference, tenants first, then agents;
- `Promises` (promises.py): deadlines and delay bounds;
- `EtaEstimator` (eta_estimator.py): projected finishes under the running policy.

Invariants:
- the ledger, the pending queue and the agent table return to zero once every agent is
  finished or cancelled (`is_idle`, which also asks the policy about its own bookkeeping);
- over-runs: an agent is charged its predicted cost when it arrives; each request adds its
  estimated cost to the agent's committed cost when submitted, corrected to its real cost
  when it finishes, and whenever committed exceeds charged the excess is charged with WFQ's
  rule for new work, F = max(F, V(now)) + excess (`commit`): an agent that under-predicts
  never runs ahead for free. Under-runs are not refunded;
- an agent enters the GPS reference with its first request; when it ends, the charge it
  did not use is settled out of it, and ended agents' leftover fluid work is flushed when
  the real system runs dry;
- events (register, submit, admit, finish, cancel) advance the virtual clock to `now`;
  reads (`view`, `fair_finish_time`, `snapshot`) do not.

Stateful policies (vtc, ewsjf, equinox) get their own instance (`Policy.bind(seed)`) and hear
about every request through hooks (`on_submit`, `on_admit`, `on_finish`, `on_drop`), which
receive the dispatcher as a `SchedulerContext`, nothing more. docs/architecture.md shows
the modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .admit import admit_in_order
from .bounds import AgentShape, BoundLimits
from .charges import RequestCosts
from .cost import COMPUTE
from .eta import StepTimeSource, WorkArrivals
from .eta_estimator import EtaEstimator
from .kv_ledger import KvLedger
from .pauses import PauseStats, stages_left
from .policies import Policy, get_policy
from .prefix import uncached_prompt
from .promises import Promises
from .queues import RequestQueue, TenantQueue
from .state import AgentState, AgentView, RequestSpec, RequestState, RequestStatus
from .tenant_clock import TenantClock
from .views import agent_view, snapshot

__all__ = ["AgentState", "AgentView", "Dispatcher", "RequestSpec", "RequestState", "RequestStatus"]

# The smallest unit in which the live server hashes prompts into prefix chains, in tokens:
# whole blocks of at least this many tokens keep a chain to a few dozen segments, which
# admission, release and charges walk (benchmarks/dispatch_overhead.py measures it).
PREFIX_UNIT_TOKENS = 128
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
        time_model: StepTimeSource | None = None,
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
        # The bounds' iteration time and rate (pessimistic percentiles on the live server, tau
        # in the simulator) and why promises are widened (None: firm): `set_iteration_time`.
        self.bound_tau = self.tau
        self.bound_iteration_s = self.tau
        self.uncertainty: str | None = None
        # The work registered recently: what ETAs and deadlines expect to arrive (eta.py).
        self.arrivals = WorkArrivals(window_s=arrival_window_s)
        # Pauses between an agent's stages (tool calls), per type (pauses.py).
        self.pauses = PauseStats()
        self.etas = EtaEstimator(self, time_model)
        self.promises = Promises(self, limits, tenant_limits, context_tokens)
        self.ledger = KvLedger()
        self._ended_backlog: set[str] = set()  # ended agents GPS has not finished yet
        self.backfill = backfill
        # A paged engine allocates whole blocks: a request holds ceil((p + d) / block) blocks,
        # so footprints are rounded up to blocks, or the engine runs out before M does.
        self.block_size = max(1, int(block_size))
        # The unit of the live server's prefix chains (a shared head counts to its last one).
        self.prefix_block = self.block_size * max(1, PREFIX_UNIT_TOKENS // self.block_size)
        self.backfill_depth = backfill_depth
        # a request's cost in the policy's units (justitia-c's are compute tokens: its rate is
        # M / tau converted with the compute/KV ratio of the requests submitted so far)
        self.costs = RequestCosts(self.policy.cost_model, self.block_size, self.policy.prefix_aware)
        # Hierarchical GPS: tenants (weighted by `tenant_weights`, default 1) first, then their
        # agents; with one tenant, the flat GPS clock (tenant_clock.py).
        self.clock = TenantClock(rate=self.rate_at(self.tau), now=now, weights=tenant_weights)
        self.agents: dict[str, AgentState] = {}
        self._drained_at: float | None = None  # when the last agent left (None: never held one)
        self.requests: dict[str, RequestState] = {}
        self._seq = itertools.count()
        self.queue: RequestQueue = self.policy.make_queue(self, backfill_depth if backfill else 0)

    # -- rate and capacity ------------------------------------------------------
    def rate_at(self, tau: float) -> float:
        """M / tau in policy cost units."""
        rate = self.kv_capacity / tau
        if self.policy.cost_model == COMPUTE:
            rate *= self.compute_per_kv
        return rate

    @property
    def compute_per_kv(self) -> float:
        """Compute tokens per unit of KV token-time over the requests submitted so far."""
        return self.costs.compute_per_kv

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
        self.etas.typical_iteration_s = typical_iteration_s
        self.uncertainty = uncertainty
        self.clock.set_rate(self.rate_at(self.tau), now)

    def set_time_model(self, time_model: StepTimeSource | None, *, sustains: bool = True) -> None:
        """The engine's step time as a function of its batch (an EngineProfile, or the
        server's fitted model), for ETAs' critical paths; with `sustains`, also for the rate
        ETAs divide by (not for a model of another engine: a prior, a fit to few steps)."""
        self.etas.time_model = time_model
        self.etas.model_sustains = sustains

    def set_kv_capacity(self, kv_capacity_tokens: int, now: float) -> None:
        """Replicas added or removed: new M (and R) from `now` on."""
        if kv_capacity_tokens <= 0:
            raise ValueError("kv capacity must be positive")
        self.kv_capacity = int(kv_capacity_tokens)
        self.clock.set_rate(self.rate_at(self.tau), now)

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
        cost_guessed: bool = False,
    ) -> AgentView:
        """Admit an agent with its predicted KV cost: its tag will be F = V + cost at its
        first request (V(now) + cost if that is now). `shape` is what its bound covers,
        `eta_shape` what its ETA expects where that differs (default: `shape`). `tenant`:
        whose predictions may widen its bound (None: one shared tenant). `cost_p90`: the
        p90 of its KV cost where the prediction is uncertain (a predictor's interval): its
        promise allows for that much; its tag and ETA do not. `cost_guessed`: the cost is a
        guess (a cold start's): its deadline is the worst case (tight_promise.py)."""
        self.clock.advance(now)  # an event: the promise below reads the clock at `now`
        if agent_id in self.agents:
            raise ValueError(f"agent {agent_id!r} is already registered")
        predicted_cost = max(0.0, float(predicted_cost))
        charge = self.costs.agent_charge(predicted_cost, predicted_compute_cost)
        self.promises.observed.declare(tenant, predicted_cost)
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
            cost_guessed=cost_guessed,
        )
        # the p90's ratio to the prediction, applied to the charge (whatever the cost model)
        if cost_p90 is not None and predicted_cost > 0.0 and cost_p90 > predicted_cost:
            agent.promise_charge = charge * float(cost_p90) / predicted_cost
        self.promises.bound(agent)
        self.agents[agent_id] = agent
        self.etas.registered(agent)
        # an arrival after a lull begins its episode before its promise: it is promised with
        # the episode's forecast, as the agents registered after it are (alone in the
        # system, after the server sat empty long enough, a shorter lull ends the episode)
        self.arrivals.open_episode(now, idle_since=self._drained_at if len(self.agents) == 1 else None)
        self.promises.promise(agent, now)
        self.arrivals.add(now, charge)  # after its own promise: it is not ahead of itself
        return self.view(agent_id, now)

    def _enter(self, agent: AgentState, now: float) -> None:
        """The agent's first request: it joins the GPS reference now, F = V(now) + charge.
        An agent that waited after registering has its deadline moved by its own wait."""
        agent.in_reference = True
        agent.fair_at = None  # the pass projected it as if joining then; it joins now
        agent.virtual_finish = self.clock.arrive(agent.agent_id, agent.charged_cost, now, agent.tenant)
        if now > agent.submitted_at:
            self.promises.promise(agent, now)

    def finish_agent(self, agent_id: str, now: float) -> AgentView:
        """The agent is done: forget it (pending requests, if any, are dropped)."""
        self._agent(agent_id)
        self.clock.advance(now)  # an event: the clock moves to `now`
        view = self.view(agent_id, now)
        self._drop(agent_id, now)
        return view

    def cancel_agent(self, agent_id: str, now: float) -> list[str]:
        """Cancel an agent: returns the ids of its running requests, to abort in the engine."""
        return self._drop(agent_id, now)

    def _drop(self, agent_id: str, now: float) -> list[str]:
        """Forget the agent (finished, failed, cancelled or expired alike for the reference:
        the charge it did not use leaves the GPS backlog; what it used stays)."""
        agent = self._agent(agent_id)
        self.pauses.forget(agent_id)
        running: list[str] = []
        pending: list[RequestState] = []
        for rid in sorted(agent.request_ids, key=lambda r: self.requests[r].seq):
            req = self.requests.pop(rid)
            if self._hooked:
                self.policy.on_drop(self, agent, req)
            if req.status is RUNNING:
                running.append(rid)
                self.ledger.release(req)
            else:
                self.ledger.dequeue(req)
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
        if not self.agents:
            self._drained_at = now  # a busy period ended (eta.py `WorkArrivals`: episodes)
        self.promises.observed.drop(agent, admitted_kv)
        if self.clock.hierarchical and isinstance(self.queue, TenantQueue):
            self.queue.retag(agent.tenant)  # its settled charge moved its tenant's order
        self._flush_if_dry(now)
        return running

    def _flush_if_dry(self, now: float) -> None:
        """The real system has nothing pending or running: every ended agent's work is done,
        so what GPS still holds of theirs is phantom (no backlog while the server is idle)."""
        if self._ended_backlog and self.ledger.pending_count == 0 and self.ledger.running_count == 0:
            self.clock.flush(self._ended_backlog, now)
            self._ended_backlog.clear()

    # -- requests ---------------------------------------------------------------
    def submit(self, spec: RequestSpec, now: float) -> None:
        """Queue a request of a registered agent."""
        agent = self._agent(spec.agent_id)
        if spec.request_id in self.requests:
            raise ValueError(f"request {spec.request_id!r} already submitted")
        self.pauses.stage_started(agent, now)
        if not agent.in_reference:
            self._enter(agent, now)
        p, d = int(spec.prompt_tokens), spec.expected_tokens
        req = self.costs.estimate(spec, agent, next(self._seq), now)
        req.order = self.policy.request_order(req)
        if self.policy.cost_model == COMPUTE:
            self.clock.set_rate(self.rate_at(self.tau), now)
        observed = self.promises.observed
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
        self.ledger.enqueue(req)
        # the prompt tokens the engine will compute: what running requests hold is cached
        computed = p - self.ledger.holds.covered(req.segments) if req.segments else p
        self.etas.observe_request(computed, d, p)
        self.queue.push(agent, req)
        if self._hooked:
            self.policy.on_submit(self, agent, req, now, first)
        self.commit(agent, req.est_cost, now)
        self.queue.requeue(agent)

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
        self.costs.unshare(agent, req)
        if cached_tokens is not None and req.status is RUNNING:
            cached = self.ledger.observe_cached(prompt_tokens, cached_tokens)
            self.etas.observe_uncached(uncached_prompt(prompt_tokens, cached))
        if req.status is RUNNING:
            self.ledger.release(req)
            agent.running -= 1
            if self._hooked:
                self.policy.on_finish(self, agent, req, prompt_tokens, output_tokens, now)
        else:  # finished without being admitted (e.g. rejected): just drop it
            if self._hooked:
                self.policy.on_drop(self, agent, req)
            self.queue.remove(agent, req)
            req.status = DONE
            agent.pending -= 1
            self.ledger.dequeue(req)
        lengths = each or (output_tokens,)
        real, real_kv = self.costs.real(req, prompt_tokens, output_tokens, lengths)
        agent.consumed_cost += real
        agent.consumed_kv += real_kv
        agent.committed_kv += real_kv - req.est_kv_cost
        self.promises.observed.commit(agent)
        agent.requests_done += 1
        if agent.pending == 0 and agent.running == 0:
            agent.idle_since = now  # paused until it submits again (or finishes)
            if stages_left((agent.eta_shape or agent.shape).stages, agent.stages_started) > 0:
                self.pauses.pause_began(agent, now)
        self.commit(agent, real - req.est_cost, now)
        self.queue.requeue(agent)
        self._flush_if_dry(now)
        return True

    def commit(self, agent: AgentState, delta: float, now: float) -> None:
        """Add to the agent's committed cost; charge any excess over what it was charged (its
        tag moves by it: the over-run rule)."""
        agent.committed_cost += delta
        excess = agent.committed_cost - agent.charged_cost
        if excess > 1e-9 * max(1.0, agent.charged_cost):
            agent.virtual_finish = self.clock.extend(agent.agent_id, agent.virtual_finish, excess, now)
            agent.charged_cost += excess
            agent.fair_at = None  # its tag moved: the cached projection no longer applies
            self.promises.bound(agent)
            self.promises.promise(agent, now)  # its own over-run moves its deadline

    # -- admission --------------------------------------------------------------
    def admit(
        self,
        now: float,
        engine_free_kv_tokens: int | None = None,
        engine_free_slots: int | None = None,
        place: Callable[[RequestSpec, int], bool] | None = None,
    ) -> list[RequestSpec]:
        """The requests to hand to the engine now, in order (admit.py: budgets, backfill,
        replicas; `place(spec, footprint)` finds a replica and reserves there)."""
        self.clock.advance(now)
        return admit_in_order(self, now, engine_free_kv_tokens, engine_free_slots, place)

    def mark_running(self, agent: AgentState, req: RequestState, now: float) -> None:
        """A pending request the queue has let go enters the engine."""
        agent.pending -= 1
        agent.running += 1
        req.admitted_at = now
        self.ledger.admit(req)
        if self._hooked:
            self.policy.on_admit(self, agent, req, now)

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

    # -- ETAs (eta_estimator.py) ----------------------------------------------------
    def recall_registrations(self, events: Sequence[tuple[float, float]], now: float) -> int:
        """Replay past registrations, (time on this clock, predicted KV cost) at or before
        `now`, into the arrivals ETAs forecast from, as if this dispatcher had seen them: a
        restarted server's history. Their agents are gone; nothing else changes. Call it
        before any agent registers. Returns how many were replayed."""
        return self.etas.recall(events, now, self.costs.kv_unit)

    def refresh_etas(self, now: float) -> None:
        """Replay the policy's order once (O(N log N)) and cache every agent's ETA. Called
        off the request path: the live server's housekeeping, the simulator's timer."""
        self.etas.refresh(now)
        # ended agents that GPS has finished since need no flush
        self._ended_backlog = {k for k in self._ended_backlog if self.clock.tag(k) is not None}

    @property
    def eta_rate(self) -> float:
        """The rate ETAs divide work by (`EtaEstimator.eta_rate`)."""
        return self.etas.eta_rate

    def repredict(self, agent_id: str, expected_total_kv: float, now: float) -> None:
        """A new estimate of the agent's total KV cost as it runs (reprediction.py). ETAs
        (its own and those of agents queued behind it) use it from the next refresh; its
        virtual finish tag and charge do not move: only the over-run rule changes those."""
        self.etas.repredict(self._agent(agent_id), expected_total_kv)

    def eta_time(self, agent_id: str, now: float) -> float:
        """Projected finish under the running policy (cached by `refresh_etas`; an agent the
        last pass did not see is placed in its order by binary search, O(log N))."""
        return self.etas.eta_time(self._agent(agent_id), now)

    def observe_jct(self, first_eta_s: float, jct_s: float, agent_id: str | None = None,
                    eta_scale: float | None = None) -> None:
        """A finished agent's JCT / the first ETA it was told (EtaEstimator.observe_jct)."""
        self.etas.observe_jct(self.agents.get(agent_id or ""), first_eta_s, jct_s, eta_scale)

    def view(self, agent_id: str, now: float) -> AgentView:
        """The agent's record: tag, costs and times (seconds from its submission)."""
        return agent_view(self, self._agent(agent_id), now)

    def snapshot(self, now: float, max_queue: int = 50) -> dict[str, Any]:
        """Plain-data state: policy, V, M, tau, backlog, queue (head first) with tags.
        A read: the clock does not move."""
        return snapshot(self, now, max_queue)

    def is_idle(self) -> bool:
        """True when no agent, request or reservation is left (accounting back to zero)."""
        return not self.agents and not self.requests and self.ledger.is_empty() and self.policy.is_idle()
