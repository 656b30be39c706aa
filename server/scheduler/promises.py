"""Promises and bounds: the deadline each agent is given, and the limits it rests on.

An agent's worst-case deadline is its GPS finish projected with the work expected to arrive
ahead of it, served at the pessimistic rate (M / bound_tau), plus its delay bound (bounds.py)
at the pessimistic step time, plus the tool time allowed before the stages it has not
started (the longest pause seen before one, the pauses' p90 before each other, pauses under
way counted as lasting at least as long as they have: pauses.py).
The deadline given is the tighter of that and its ETA scaled by how far the first ETAs of
agents in its context (its place in the queue) have fallen short (tight_promise.py; the
record's promise_assumes says what that rests on).

Invariants:
- a promise only ever moves later: it is made at registration and made again when the
  agent starts late or over-runs its charge, and a new deadline earlier than the old one is
  not taken;
- a promise the scheduler expects to break is never called firm: where an assumption fails
  (no request seen, a predicted cost, arrivals above the share a deadline allows, too
  little history of arrivals, an uncertain rate), it is "widened" and says why; under a
  policy that does not keep the delay bound it is "none";
- the limits an agent is bounded against count real (committed) work of anyone, and
  predictions of its own tenant only (another tenant cannot widen its bound by lying).

Reads the dispatcher's clock, arrivals, rates and pauses; never reads a clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .bounds import BoundLimits, delay_bound
from .cost import kv_cost
from .eta import MAX_ARRIVAL_SHARE, PROMISE_MIN_SPAN_S
from .eta_interval import quantile_grid
from .pauses import stages_left
from .policies import Justitia
from .state import AgentState, ObservedLimits, PromiseKind
from .tight_promise import (
    PromiseParts,
    assumption,
    at_burst_head,
    context_of,
    densest_finish_s,
    fair_share_s,
    floor_of,
    is_large,
    promise_record,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .dispatcher import Dispatcher

# The points of an ETA's distribution an agent keeps from registration (tool_time.py), to
# tell where its JCT fell in it when it finishes.
TIMES_KEPT = 32


class Promises:
    """The deadlines and delay bounds of a dispatcher's agents."""

    def __init__(self, dispatcher: Dispatcher, limits: BoundLimits | None,
                 tenant_limits: Mapping[str | None, BoundLimits] | None, context_tokens: int | None) -> None:
        self._d = dispatcher
        self.declared = limits
        self.tenant_limits = dict(tenant_limits or {})  # declared per tenant (over `limits`)
        # The longest request the engine takes (prompt and output): what bounds requests
        # before any is seen (None: nothing).
        self.context_tokens = context_tokens
        self.observed = ObservedLimits()

    # -- limits and bounds -------------------------------------------------------------
    def limits_for(self, tenant: str | None, guessed: bool = False) -> BoundLimits:
        """The limits an agent of `tenant` is promised against: the operator's, or what the
        scheduler can trust (real work of anyone, predictions of `tenant` only). `guessed`:
        the agent's cost is a guess (see `context_bound`)."""
        declared = self.tenant_limits.get(tenant)
        if declared is not None:
            return declared
        if self.declared is not None:
            return self.declared
        limits = self.observed.as_limits(tenant)
        if self.no_request_seen or (guessed and self.context_bound):
            # Nothing bounds the requests an agent will wait behind but the engine's context:
            # with none seen, the longest output seen is 0, which would bound the first
            # agents as if no request decoded.
            top = int(self.context_tokens or 0)
            limits = BoundLimits(max(limits.max_request_cost, kv_cost(0, top)), limits.max_agent_cost, top)
        return limits

    @property
    def no_request_seen(self) -> bool:
        """No request submitted yet, and the context length known: the limits are its."""
        return self.declared is None and bool(self.context_tokens) and self.observed.max_output_tokens <= 0

    @property
    def context_bound(self) -> bool:
        """An agent whose cost is a guess is bounded as if no request had been seen while the
        engine's rate is not measured: the few requests seen then (the first of a burst,
        whose agents register together) say nothing of how long an unseen type's requests
        are, nor the engine's guessed step time how slow its steps will be. Live, a fresh
        server's opening burst of 64 unseen agents, bounded by the first 24-token request
        seen, was promised 2.5 s and took 4-16 s (98 of 128 broken)."""
        return bool(self.context_tokens) and self.declared is None and self._d.uncertainty is not None

    @property
    def bound_step_s(self) -> float:
        """The step time of the bounds given now: the pessimistic iteration time, or the
        time model's step with the cache full (a critical path's steps under contention)."""
        return max(self._d.bound_iteration_s, self._d.etas.saturated_iteration_s())

    def bound(self, agent: AgentState) -> None:
        """Set the agent's delay bound from its shape and the limits it is promised against."""
        d = self._d
        agent.bound = delay_bound(self.limits_for(agent.tenant, agent.cost_guessed), agent.shape, d.kv_capacity,
                                  d.bound_tau, self.bound_step_s)

    # -- deadlines ------------------------------------------------------------------------
    def promise(self, agent: AgentState, now: float) -> None:
        """The deadline promised at `now` (the module docstring's rule); it only moves later."""
        d = self._d
        v = d.clock.tenant_v(agent.tenant, now)
        # A predicted cost may be short of the real one, and an agent that over-runs is
        # charged its excess as it shows, so its fair finish moves later with it: the promise
        # allows for the prediction's p90.
        extra = max(0.0, agent.promise_charge - agent.charged_cost)
        fluid = self.fair_finish_with(agent, extra, now) - now
        slow = d.bound_tau / d.tau
        # The share of the rate the deadline assumes (M / bound_tau), not of R: the deadline
        # serves its work at the pessimistic rate, and so must it serve the arrivals.
        gap = max(0.0, agent.virtual_finish + extra - v)
        share = d.arrivals.fluid_ahead(gap) / d.rate * slow
        reasons = []
        if d.uncertainty:
            reasons.append(d.uncertainty)
        if self.no_request_seen:
            reasons.append(f"no request seen yet: the bound assumes requests as long as the engine's context "
                           f"({self.context_tokens} tokens)")
        elif agent.cost_guessed and self.context_bound and not self.tenant_limits.get(agent.tenant):
            reasons.append(f"its cost is a guess: until the engine's rate is measured the bound assumes requests "
                           f"as long as the engine's context ({self.context_tokens} tokens)")
        if extra > 0.0:
            reasons.append(f"its cost is a prediction: the deadline allows for {agent.promise_charge:.4g} units, "
                           f"the prediction's p90 ({agent.promise_charge / agent.charged_cost:.2g}x its charge)")
        arriving_share = min(MAX_ARRIVAL_SHARE, share / slow)  # of the measured rate, as measured
        if share > MAX_ARRIVAL_SHARE:
            reasons.append(f"work arrives at {share:.0%} of the engine's (pessimistic) rate: the deadline assumes "
                           f"{MAX_ARRIVAL_SHARE:.0%}")
            share = MAX_ARRIVAL_SHARE
        history = d.arrivals.history_s(now)
        horizon = fluid / (1.0 - share) * slow
        if share < MAX_ARRIVAL_SHARE and (history is None or history < max(PROMISE_MIN_SPAN_S, horizon)):
            # Arrivals seen over less time than the deadline looks ahead say little of what
            # arrives before it (the start of a burst looks like a light load), and none seen
            # at all is no sign of a light load either: assume the most the deadline can
            # allow for, and say so.
            seen = "no arrivals measured yet" if history is None else f"arrivals measured over {history:.1f} s"
            reasons.append(f"{seen}, less than the {horizon:.1f} s the deadline looks ahead: it assumes work "
                           f"arrives at {MAX_ARRIVAL_SHARE:.0%} of the engine's rate")
            share = MAX_ARRIVAL_SHARE
            horizon = fluid / (1.0 - share) * slow
        # Tool time: the longest pause seen before one stage it has not started, the pauses'
        # p90 before each other, those under way counted (pauses.py `allowance_parts`).
        left = stages_left(agent.shape.stages, agent.stages_started)
        pauses = d.pauses.allowance_s(agent.agent_type, left, now)
        # only an agent with a stage boundary ahead may pause
        unpaused = bool(left) and d.pauses.unpaused_lately(now, d.arrivals.episode_start(now))
        if left and pauses <= 0.0 and d.pauses.any_seen and not unpaused:
            # boundaries crossed, none paused, but not lately: whether the traffic of the
            # moment pauses is not known, and the deadline allows it no tool time
            reasons.append(f"no pause seen yet: the deadline allows no tool time before its {left} later "
                           f"stage(s)")
        worst = now + horizon + agent.bound.total_s + pauses
        # The deadline given: the tighter of the worst case and the ETA scaled by how far
        # the ETAs of agents in its context (its place in the queue when it registered) have
        # fallen short (tight_promise.py), which says what it rests on. Tool time is not
        # calibrated so: an agent that may pause (stage boundaries ahead, and a pause at one
        # of the recent boundaries of any type, or none crossed lately: `unpaused_lately`)
        # keeps the worst case. Its own type's pauses are not enough: a server taught by
        # traffic whose agents never paused promised agents of the same types that did as if
        # they would not (10 of 240 broken).
        replay_s = max(0.0, d.etas.eta_time(agent, now) - now)  # the replay's ETA, seconds from now
        if agent.promise_context is None:
            agent.promise_context = context_of(*d.etas.queue_place(agent, now))
            agent.promise_large = is_large(agent.charged_cost, d.arrivals.median_cost())
            agent.promise_burst_head = at_burst_head(d.arrivals.burst_rank(now))
            # the ETA it is told: the replay's scaled by its context's record (eta_interval.py)
            # of the agents whose first ETAs expected pauses where its own does, of those whose
            # ETAs expected none where it does not (eta_interval.py); or, where the traffic of
            # its episode pauses and it has stages ahead, its engine time and tool time weighed
            # apart (tool_time.py), with what its record at the end is of
            pauses_expected = d.etas.pause_ahead(agent, now)
            agent.eta_pausing = pauses_expected > 0.0
            agent.eta_scale = d.etas.calibration.scale(agent.promise_context, agent.eta_pausing)
            agent.eta_tools = d.etas.expects_tools(agent, now)
            times = d.etas.remaining_times(agent, now) if agent.eta_tools else None
            agent.eta_times = quantile_grid(times, TIMES_KEPT) if times else ()
            agent.eta_replay_s = replay_s
            agent.eta_engine_s = max(0.0, agent.eta_replay_s - pauses_expected)
        record, learned_from = promise_record(d.etas.calibration, agent.promise_context, agent.promise_large)
        # Nor is an ETA resting on guesses: until the engine's rate is measured here, or
        # where the agent's cost is a guess (a type no predictor knows), the ETA is the
        # guess's and no record of ETAs says how far it may fall short: the opening burst of
        # a fresh server (its rate from the built-in profile, its types unseen) can run 5-10x
        # longer than such ETAs say.
        cost_ratio = (agent.charged_cost + extra) / agent.charged_cost if agent.charged_cost > 0 else 1.0
        parts = PromiseParts(
            worst_s=worst - now, eta_s=replay_s * max(1.0, cost_ratio),
            # Never earlier than its fair-share finish (GPS at the measured rate) with the
            # work the ETA expects to arrive ahead of it: an ETA below that counts on the
            # policy serving it ahead of its fair share, which the bound does not promise.
            # A large agent's, or one among the first of a burst, with the work the densest
            # stretch seen would bring ahead.
            fair_share_s=self.fair_share_of(agent, fluid, arriving_share, gap),
            floor=floor_of(agent.promise_context, agent.promise_large), record=record,
            calibrated=not d.uncertainty and not agent.cost_guessed and (left == 0 or unpaused),
            context=agent.promise_context, large=agent.promise_large)
        deadline = now + parts.deadline_s()
        if agent.deadline_at is not None and deadline <= agent.deadline_at:
            return  # made again (late start, over-run): a promise only ever moves later
        agent.deadline_at = deadline
        if agent.promise_parts is None:
            agent.promise_parts = parts
        tighter = parts.tight_s() < parts.worst_s
        agent.tool_allowance_s = 0.0 if tighter else pauses
        # The worst case rests on the client's tool calls taking no longer than allowed.
        agent.promise_assumes = (
            assumption(parts.factor, learned_from, d.arrivals.promise_rate, agent.promise_context, d.tau,
                       agent.promise_large)
            if tighter else d.pauses.allowance_words(agent.agent_type, left, pauses, now))
        if not isinstance(d.policy, Justitia):
            agent.promise = PromiseKind.NONE
            agent.promise_reason = f"policy {d.policy.name} does not keep the delay bound (Justitia's)"
        else:
            agent.promise = PromiseKind.WIDENED if reasons else PromiseKind.FIRM
            agent.promise_reason = "; ".join(reasons)

    def fair_share_of(self, agent: AgentState, fluid: float, share: float, gap: float) -> float:
        """Seconds to the agent's fair-share finish (`fluid` seconds of GPS service) with
        `share` of the rate taken by arrivals over the span its ETA expects them; a large
        agent's, or one among the first of a burst, with them as dense as the densest stretch
        of the history of its length (`gap`: how far V must advance before it finishes;
        tight_promise.py)."""
        arrivals = self._d.arrivals
        fair = fair_share_s(fluid, share, arrivals.span_s)
        if not (agent.promise_large or agent.promise_burst_head):
            return fair
        ahead = arrivals.share_ahead(gap)
        return max(fair, densest_finish_s(fluid, lambda window: ahead * arrivals.peak_work(window), self._d.rate))

    def fair_finish_with(self, agent: AgentState, extra: float, now: float) -> float:
        """GPS finish time of the agent projected from now were its charge `extra` larger."""
        d = self._d
        if extra <= 0.0:
            return d.fair_finish_time(agent.agent_id, now)
        if not agent.in_reference:
            return d.clock.arrival_finish_time(agent.charged_cost + extra, now, agent.tenant)
        return d.clock.projected_time(agent.virtual_finish + extra, now, agent.tenant)
