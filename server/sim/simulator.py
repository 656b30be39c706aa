"""The discrete-event simulator: a workload, a policy, the engine model, the scheduler core.

The driver plays the part of the live server: it registers each agent when it arrives (with
its predicted cost), submits a stage's requests when the previous stage has finished, asks
the dispatcher what to admit whenever something changed, and hands those requests to the
engine model. The dispatcher is the same class the server uses.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.scheduler import (
    AgentShape,
    BoundLimits,
    Dispatcher,
    Policy,
    RequestSpec,
    get_policy,
    gps_finish_times,
    hierarchical_gps_finish_times,
)
from server.scheduler.cost import KV, kv_cost
from server.scheduler.policies import FOOTPRINT, Justitia
from server.scheduler.prefix import segments
from server.scheduler.rate import TauEstimator
from server.scheduler.retention import Retention, check_mode
from server.scheduler.tight_promise import PromiseParts
from server.shared.profiles import EngineProfile

from .engine import EngineModel, SimRequest
from .results import AgentResult, PolicyResult
from .retain import SimRetention
from .workload import AgentSpec

ETA_REFRESH_S = 0.25  # simulated seconds between two ETA passes (the live server: 0.25 s too)


# `tau="measured"`: the simulated server measures its rate as the live one does, from this
# initial guess (the server's `initial_tau_s`), once a simulated second (its housekeeping).
MEASURED_TAU_PRIOR_S = 0.01


TAU_UPDATE_S = 1.0


TAU_SOURCES = ("profile", "measured")


@dataclass
class Predictions:
    """Predicted agent costs, shared by every policy of a run."""

    kv: list[float]
    compute: list[float | None]
    label: str = "oracle"
    # KV costs with the prefixes each agent's parallel requests share charged once (what a
    # prefix-aware Justitia charges); None: the same as `kv`.
    kv_shared: list[float] | None = None
    # p90 of an agent's true cost over its prediction (the promise allows for it); None: exact
    p90_ratio: float | None = None

    def kv_for(self, policy: Policy) -> list[float]:
        """The KV costs `policy` is told: prefix-aware for a prefix-aware Justitia."""
        if self.kv_shared is not None and isinstance(policy, Justitia) and policy.prefix_aware \
                and policy.cost_model == KV:
            return self.kv_shared
        return self.kv


def make_predictions(agents: Sequence[AgentSpec], mode: str = "oracle", seed: int = 0,
                     predictor: Callable[[AgentSpec], float] | None = None) -> Predictions:
    """oracle: the true costs; noisy:L: true x L^u, u ~ U(-1, 1) per agent (a factor within
    [1/L, L], log-uniform); model: what `predictor(agent)` says (KV cost)."""
    true_kv = [a.kv_cost for a in agents]
    true_c = [a.compute_cost for a in agents]
    shared = [a.kv_cost_shared for a in agents] if any(a.prefixes for a in agents) else None
    if mode == "oracle":
        return Predictions(true_kv, list(true_c), "oracle", shared)
    if mode.startswith("noisy:"):
        lam = float(mode.split(":", 1)[1])
        if lam < 1:
            raise ValueError("noisy:LAMBDA needs LAMBDA >= 1")
        rng = random.Random(seed)
        factors = [lam ** rng.uniform(-1.0, 1.0) for _ in agents]
        # true = predicted x L^-u: at most predicted x L^0.8 with probability 0.9
        return Predictions([c * f for c, f in zip(true_kv, factors, strict=True)],
                           [c * f for c, f in zip(true_c, factors, strict=True)], mode,
                           None if shared is None else [c * f for c, f in zip(shared, factors, strict=True)],
                           p90_ratio=lam ** 0.8 if lam > 1 else None)
    if mode.startswith("model:"):
        if predictor is None:
            raise ValueError("model predictions need a predictor")
        return Predictions([max(0.0, float(predictor(a))) for a in agents], [None] * len(agents), mode)
    raise ValueError(f"unknown prediction mode {mode!r}: oracle, noisy:LAMBDA or model:DIR")


def gps_tau_s(profile: EngineProfile, kv_tokens: int, agents: Sequence[AgentSpec]) -> float:
    """The tau of the GPS rate R = M / tau: what the engine sustains on this request mix
    (see EngineProfile.effective_tau_s). The live server measures it online."""
    return profile.effective_tau_s(kv_tokens, [(p, d) for a in agents for st in a.stages for p, d in st])


def workload_limits(agents: Sequence[AgentSpec]) -> BoundLimits:
    """c_max, C_max and d_max of a workload (the limits the bound is stated against)."""
    reqs = [(p, d) for a in agents for st in a.stages for p, d in st]
    return BoundLimits(
        max_request_cost=max((kv_cost(p, d) for p, d in reqs), default=0.0),
        max_agent_cost=max((a.kv_cost for a in agents), default=0.0),
        max_output_tokens=max((d for _, d in reqs), default=0),
    )


def tenant_limits(agents: Sequence[AgentSpec]) -> dict[str | None, BoundLimits] | None:
    """Per tenant, the workload's limits with C_max that of the tenant's own agents (None
    when the agents name fewer than two tenants: the workload's limits hold for all)."""
    tenants = {a.tenant for a in agents}
    if len(tenants) < 2:
        return None
    whole = workload_limits(agents)
    return {t: BoundLimits(whole.max_request_cost, max(a.kv_cost for a in agents if a.tenant == t),
                           whole.max_output_tokens) for t in tenants}


def isolated_jct_s(agents: Sequence[AgentSpec], profile: EngineProfile, kv_tokens: int | None = None) -> list[float]:
    """Each agent's JCT alone on an idle engine of M tokens: its critical path (stage after
    stage, each stage's requests batched together) under the profile's time model, by the
    simulator itself with no other agent. The same for every policy that admits a lone
    agent's stage whole; `justitia` (footprint admission: no preemption) is the one run."""
    out = []
    for a in agents:
        alone = AgentSpec(a.id, a.type, 0.0, a.stages, pauses=a.pauses)
        res = simulate([alone], "justitia", profile, kv_tokens, make_predictions([alone]), isolated=[0.0])
        out.append(res.agents[0].jct_s)
    return out


def simulate(
    agents: Sequence[AgentSpec],
    policy: str | Policy,
    profile: EngineProfile,
    kv_tokens: int | None = None,
    predictions: Predictions | None = None,
    *,
    backfill: bool = False,
    gps_finish: Sequence[float] | None = None,
    seed: int = 0,
    isolated: Sequence[float] | None = None,
    tau: str = "profile",
    tenant_weights: Mapping[Any, float] | None = None,
    retain: str = "auto",
) -> PolicyResult:
    """Run one policy over the workload; returns per-agent finish times and counters.
    `seed` seeds a policy that learns online (ewsjf's tuner): same seed, same run.
    `isolated`: each agent's time alone (`isolated_jct_s`, computed when not given).
    `tau`: where the dispatcher's rate R = M / tau comes from. "profile": what the profile's
    engine sustains on the workload's mix, known from the start (`gps_tau_s`); "measured":
    measured from the simulated steps as the live server measures the real ones (a
    `TauEstimator` from the server's initial guess, updated once a simulated second), and the
    delay bound's limits (c_max, C_max, d_max) observed from the requests submitted so far,
    the first bounded against the engine's context, so that ETAs and deadlines are those the
    live server would give. (Told the workload's own limits, a server promises early agents
    against requests it has not seen yet: live, a taught server's opening agents got half
    the deadlines the simulator gave them.)
    `retain`: whether paused agents' contexts are kept (auto, always, never; server/sim/retain.py),
    for policies that keep them (`Policy.retains`; the others never do)."""
    import time

    if tau not in TAU_SOURCES:
        raise ValueError(f"tau must be one of {', '.join(TAU_SOURCES)}, not {tau!r}")
    wall0 = time.perf_counter()
    agents = sorted(agents, key=lambda a: a.arrival)
    m = int(kv_tokens or profile.kv_tokens)
    profile_tau = gps_tau_s(profile, m, agents)
    estimator = TauEstimator(m, MEASURED_TAU_PRIOR_S) if tau == "measured" else None
    predictions = predictions or make_predictions(agents)
    # measured: the server bounds agents against the limits it has seen, as the live one does
    # (it knows nothing of the requests ahead, and bounds the first against its context)
    # where the profile's server is told the workload's own
    observed = estimator is not None
    if gps_finish is None:
        gps_finish = reference_finish_times(agents, m / profile_tau, tenant_weights)
    pol = get_policy(policy) if isinstance(policy, str) else policy
    # measured: the loop hands the estimator's guess (and its widened promises) over at t = 0,
    # before the first agent registers
    disp = Dispatcher(pol, m, profile_tau if estimator is None else estimator.tau_s,
                      limits=None if observed else workload_limits(agents), backfill=backfill, seed=seed,
                      time_model=profile, tenant_weights=tenant_weights,
                      tenant_limits=None if observed else tenant_limits(agents),
                      context_tokens=min(profile.max_model_len, m) if observed else None)
    # conversations (resent contexts, pauses): the engine keeps finished sequences, in blocks
    talks = any(a.ctxs or a.pauses for a in agents)
    engine = EngineModel(profile, m, preempt_newest=(pol.name == "fcfs"),
                         block_size=profile.block_size if talks else 1, cache_sequences=talks)
    mode = check_mode(retain) if pol.retains else "never"
    keeper = SimRetention(Retention(mode, disp.pauses), disp, engine, m, profile.per_prefill_token_s)

    run = _Run(agents, disp, engine, predictions, estimator, keeper, profile.stage_turnaround_s)
    run.loop()
    if isolated is None:
        isolated = isolated_jct_s(agents, profile, m)
    results = [
        AgentResult(a.id, a.type, a.arrival, run.finish[i], gps_finish[i], run.bounds[i], run.first_eta[i],
                    run.first_deadline[i], isolated[i] or None, run.first_interval[i],
                    engine.reprefill_tokens(a.id), run.first_allowance[i], run.paused_total[i], run.first_parts[i])
        for i, a in enumerate(agents)
    ]
    return PolicyResult(
        policy=pol.name,
        agents=results,
        iterations=engine.iterations,
        preemptions=engine.preemptions,
        accounting_zero=disp.is_idle() and engine.holds_nothing(),
        sim_wall_s=time.perf_counter() - wall0,
        extra=_extra(disp, engine) | ({"measured_tau_s": disp.tau} if estimator is not None else {})
        | (keeper.summary() if talks else {}),
    )


def _extra(disp: Dispatcher, engine: EngineModel) -> dict:
    extra: dict = {}
    if state := disp.policy.describe():
        extra["policy_state"] = state
    if engine.cache.prompt_tokens and engine.cache.entries or engine.cache.hit_tokens:
        extra["prefix_hit_rate"] = engine.prefix_hit_rate
        # prompt tokens prefilled again because their cached prefix had been evicted
        extra["prefix_recomputed_tokens"] = engine.cache.recomputed_tokens
        extra["prefix_recomputed_share"] = (engine.cache.recomputed_tokens / engine.cache.prompt_tokens
                                            if engine.cache.prompt_tokens else 0.0)
        extra["kv_saved_total"] = disp.ledger.kv_saved_total
    return extra


class _Run:
    """One policy's run over a workload in `simulate`: arrivals, admission and stage
    completions as steps of one event loop (ETAs refreshed off the decision path)."""

    def __init__(self, agents: Sequence[AgentSpec], disp: Dispatcher, engine: EngineModel,
                 predictions: Predictions, tau_estimator: TauEstimator | None = None,
                 keeper: SimRetention | None = None, turnaround_s: float = 0.0) -> None:
        self.agents, self.disp, self.engine, self.predictions = agents, disp, engine, predictions
        self.turnaround_s = turnaround_s  # the client's, before every stage but the first
        self.keeper = keeper
        self.tau_estimator = tau_estimator
        # the live server tells the estimator the reservations of footprint policies only
        self.footprint = disp.policy.admission == FOOTPRINT
        self.kv_predicted = predictions.kv_for(disp.policy)
        self.segments: dict[str, tuple] = {}  # request id -> its prefix segments (engine model)
        self.ctxs: dict[str, str] = {}  # request id -> the conversation it extends
        n = len(agents)
        self.index = {a.id: i for i, a in enumerate(agents)}
        self.stage_of = [0] * n
        self.left_in_stage = [0] * n
        self.finish = [math.nan] * n
        self.bounds = [0.0] * n
        self.first_eta = [0.0] * n
        self.first_deadline = [0.0] * n
        self.first_interval: list[tuple[float, float] | None] = [None] * n
        self.first_allowance = [0.0] * n  # the client's tool time the first deadline allowed
        self.first_parts: list[PromiseParts | None] = [None] * n  # what the first deadline was made of
        self.paused_total = [0.0] * n  # the time each agent spent paused, as the server saw it
        self.nxt = 0  # the next agent to arrive
        self.done = 0
        # Paused agents (a tool call before their next stage): (resume time, agent index).
        # They stay registered, keeping their place in virtual time, with nothing queued.
        self.paused: list[tuple[float, int]] = []
        # Agents whose client is turning their last answer into their next stage: (the time
        # it reaches the server, agent index). Not paused as far as anyone can tell: the
        # server sees the gap as its client's turnaround (pauses.py, TURNAROUND_S).
        self.returning: list[tuple[float, int]] = []

    def loop(self) -> None:
        agents, disp, engine = self.agents, self.disp, self.engine
        t = 0.0
        next_refresh = 0.0
        next_tau = 0.0
        while self.done < len(agents):
            if t >= next_refresh:  # ETAs are refreshed off the decision path, as on the server
                disp.refresh_etas(t)
                next_refresh = t + ETA_REFRESH_S
            if self.tau_estimator is not None and t >= next_tau:  # then tau, as its housekeeping does
                disp.set_iteration_time(self.tau_estimator.tau_s, t, **self.tau_estimator.promise_times())
                next_tau = t + TAU_UPDATE_S
            self.arrive(t)
            if self.keeper is not None:
                self.keeper.expire(t)
            self.resume_paused(t)
            engine.resume()
            if not engine.waiting:
                self.admit(t)
            next_event = min(agents[self.nxt].arrival if self.nxt < len(agents) else math.inf,
                             self.paused[0][0] if self.paused else math.inf,
                             self.returning[0][0] if self.returning else math.inf)
            if engine.idle():
                if next_event < math.inf:
                    t = max(t, next_event)
                    continue
                if self.done < len(agents):
                    raise RuntimeError("simulator stalled: requests pending but nothing admitted")
                break
            until = next_event
            if self.tau_estimator is None:
                t, finished = engine.step(t, until)
            else:
                t, finished = self.measured_step(t, until)
            for r in finished:
                self.request_finished(r, t)

    def measured_step(self, t: float, until: float) -> tuple[float, list[SimRequest]]:
        """An engine step (or stretch of decode steps) whose time and memory the estimator
        sees as the live server sees the engine's: each step's duration and the KV cache in
        use (shared prefixes once; unreferenced cached prefixes are free, as vLLM counts)."""
        engine, estimator = self.engine, self.tau_estimator
        assert estimator is not None
        iterations, batch = engine.iterations, len(engine.running)
        in_use = engine.kv_used - engine.cache.evictable
        reserved = self.disp.ledger.reserved_kv if self.footprint else None
        end, finished = engine.step(t, until)
        n = engine.iterations - iterations
        if n > 0 and end > t:  # memory grows by one token per sequence and step: its mean
            estimator.observe_steps(n, (end - t) / n, in_use + batch * (n + 1) / 2.0, reserved)
        return end, finished

    def arrive(self, t: float) -> None:
        """Registers the agents that have arrived by `t` and submits their first stage."""
        while self.nxt < len(self.agents) and self.agents[self.nxt].arrival <= t:
            i, a = self.nxt, self.agents[self.nxt]
            view = self.disp.register_agent(
                a.id, self.kv_predicted[i], t, agent_type=a.type, tenant=a.tenant,
                predicted_compute_cost=self.predictions.compute[i],
                shape=AgentShape(len(a.stages), a.critical_path_tokens, a.prefill_tokens, a.first_request_tokens,
                                 a.prefill_square_tokens, a.stage_request_tokens),
                cost_p90=self.kv_predicted[i] * self.predictions.p90_ratio if self.predictions.p90_ratio else None,
            )
            self.bounds[i] = view.delay_bound_s
            self.first_eta[i], self.first_deadline[i] = view.eta_s, view.deadline_s
            self.first_interval[i] = view.eta_interval_s
            self.first_allowance[i] = view.tool_allowance_s
            state = self.disp.agents.get(a.id)
            self.first_parts[i] = state.promise_parts if state is not None else None
            if a.stages:
                self.start_stage(i, t)
            else:
                self.agent_done(i, t)
            self.nxt += 1

    def start_stage(self, i: int, now: float) -> None:
        """The agent's next stage: submitted now, after the pause before it, or (a stage after
        the first) after its client's turnaround, which follows a pause too."""
        pause = self.agents[i].pause_before(self.stage_of[i])
        turnaround = self.turnaround_s if self.stage_of[i] > 0 else 0.0
        if pause > 0:
            heapq.heappush(self.paused, (now + pause + turnaround, i))
            if self.keeper is not None:
                self.keeper.pause(self.agents[i].id, self.agents[i].type, now)
        elif turnaround > 0:
            heapq.heappush(self.returning, (now + turnaround, i))
        else:
            self.submit_stage(i, now)

    def resume_paused(self, t: float) -> None:
        """Submit the stages whose pause, or client's turnaround, is over by `t`."""
        for waiting in (self.paused, self.returning):
            while waiting and waiting[0][0] <= t:
                _, i = heapq.heappop(waiting)
                self.submit_stage(i, t)

    def admit(self, t: float) -> None:
        while True:
            for spec in self.disp.admit(t, self.engine.free_kv, self.engine.free_slots):
                self.engine.add(SimRequest(spec.request_id, spec.agent_id, spec.prompt_tokens, spec.max_tokens,
                                           priority=self.disp.priority(spec.agent_id, spec.request_id),
                                           segments=self.segments.pop(spec.request_id, ()),
                                           ctx=self.ctxs.pop(spec.request_id, None)))
                if self.keeper is not None:
                    self.keeper.release(spec.agent_id, t)  # back in the engine: its pin ends
            # a kept context gives way to an agent ahead of it that does not fit
            if self.keeper is None or not self.engine.free_slots or not self.keeper.make_way(t):
                return

    def submit_stage(self, i: int, now: float) -> None:
        a = self.agents[i]
        st = a.stages[self.stage_of[i]]
        self.left_in_stage[i] = len(st)
        if self.keeper is not None:
            resent = (key for k in range(len(st)) for key, _ in a.prefix(self.stage_of[i], k))
            self.keeper.resume(a.id, a.type, resent, now)
        for k, (p, d) in enumerate(st):
            chain = a.prefix(self.stage_of[i], k)
            rid = f"{a.id}/{self.stage_of[i]}/{k}"
            if (ctx := a.ctx(self.stage_of[i], k)) is not None:
                self.ctxs[rid] = ctx
            if chain:  # the engine stores shared prefixes once, whatever the policy reserves
                self.segments[rid] = segments(chain)
            self.disp.submit(RequestSpec(rid, a.id, p, d, d, prefix=chain), now)

    def request_finished(self, r: SimRequest, t: float) -> None:
        """Feeds back a finished request; a finished stage submits the next one or ends the agent."""
        i = self.index[r.agent_id]
        self.disp.on_request_finished(r.request_id, r.prompt_tokens, r.output_tokens, t,
                                      cached_tokens=r.cached)
        if self.keeper is not None:
            self.keeper.request_kept(r.agent_id, r.kept_key, (seg.key for seg in r.segments))
        self.left_in_stage[i] -= 1
        if self.left_in_stage[i] > 0:
            return
        self.stage_of[i] += 1
        if self.stage_of[i] < len(self.agents[i].stages):
            self.start_stage(i, t)
        else:
            self.agent_done(i, t)

    def agent_done(self, i: int, t: float) -> None:
        if self.keeper is not None:
            self.keeper.release(self.agents[i].id, t)
            self.keeper.last_keys.pop(self.agents[i].id, None)
            self.keeper.last_heads.pop(self.agents[i].id, None)
            self.keeper.sizes.pop(self.agents[i].id, None)
        self.disp.observe_jct(self.first_eta[i], t - self.agents[i].arrival, self.agents[i].id)
        self.paused_total[i] = self.disp.pauses.paused_so_far(self.disp.agents[self.agents[i].id], t)
        self.disp.finish_agent(self.agents[i].id, t)
        self.finish[i] = t
        self.done += 1


def run_comparison(
    agents: Sequence[AgentSpec],
    policies: Sequence[str | Policy],
    profile: EngineProfile,
    kv_tokens: int | None = None,
    predictions: Predictions | None = None,
    backfill: bool = False,
    seed: int = 0,
    tau: str = "profile",
    tenant_weights: Mapping[Any, float] | None = None,
    retain: str = "auto",
) -> list[PolicyResult]:
    """Every policy on the same workload, predictions and GPS reference (`tau`: `simulate`'s)."""
    agents = sorted(agents, key=lambda a: a.arrival)
    m = int(kv_tokens or profile.kv_tokens)
    # The GPS reference charges shared prefixes once (what the work really is; without
    # prefixes, kv_cost_shared is kv_cost): a stricter reference than the prefix-blind one.
    gps = reference_finish_times(agents, m / gps_tau_s(profile, m, agents), tenant_weights)
    predictions = predictions or make_predictions(agents)
    isolated = isolated_jct_s(agents, profile, m)
    return [simulate(agents, p, profile, m, predictions, backfill=backfill, gps_finish=gps, seed=seed,
                     isolated=isolated, tau=tau, tenant_weights=tenant_weights, retain=retain)
            for p in policies]


def reference_finish_times(agents: Sequence[AgentSpec], rate: float,
                           tenant_weights: Mapping[Any, float] | None = None) -> list[float]:
    """The GPS fluid finish times `gps_finish_s` reports: flat GPS over the agents, or, when
    agents name tenants, hierarchical GPS (tenants by weight, then their agents)."""
    arrivals, costs = [a.arrival for a in agents], [a.kv_cost_shared for a in agents]
    if len({a.tenant for a in agents}) > 1:
        return hierarchical_gps_finish_times(arrivals, costs, [a.tenant for a in agents], rate, tenant_weights)
    return gps_finish_times(arrivals, costs, rate)
