"""The ETA estimator: every agent's projected finish under the running policy.

The formula (eta.py's docstring) is applied two ways that must agree:

- the fast pass, `refresh`: one replay of the policy's order over every agent (one sort,
  O(N log N)), caching each agent's ETA and keeping the sorted keys and prefix sums of the
  work ahead of each position (`EtaPass`). The caller runs it off the request path.
- the slow path, `eta_time` for an agent the last pass did not place (registered since, or
  re-predicted): a binary search in the last pass plus the agents registered since
  (`unpassed_work_before`), then `eta_of` for that one agent, O(log N).

What the replay measures work in (`replay_rates`): with a time model of the engine, the rate
R0 of the engine on the current mix were prompts free, and each agent's declared prefill added
as the work of that time at R0; without one, `eta_rate` and no prefill. The estimator keeps
the recency-weighted shape of a request (prompt computed, output, whole context), from
which the time model gives one step's time.

It reads the dispatcher's tables (agents, clock, policy, ledger, arrivals, pauses) and owns
only what forecasting needs. It never reads a clock.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .bounds import AgentShape
from .eta import MAX_ARRIVAL_SHARE, EtaPass, MemoryDrain, StepTimeSource, chunked_function, eta_of, step_function
from .eta_interval import EtaCalibration
from .pauses import stages_left
from .policies import ENGINE, FOOTPRINT, Justitia
from .prefix import shared_tokens
from .state import AgentState
from .tenant_clock import HierProjection
from .tool_time import level_of, remaining_times, told_with_tools
from .virtual_clock import Projection

if TYPE_CHECKING:
    from .dispatcher import Dispatcher

# The weight of each new request in the running means of a request's prompt, output and
# context: about the last 20 requests count (a mix changes over tens of requests, not one).
MEAN_WEIGHT = 0.05
# Registrations between two passes whose work later registrations' ETAs count: a bound on
# the scan in `unpassed_work_before` under a flood (past it, the next pass counts them).
MAX_UNPASSED = 256
# The prompt tokens over which one more prompt token's step time is measured on the time
# model: long enough to average out the model's per-step constant.
PREFILL_PROBE_TOKENS = 1024

# (rate, per_unit, prefill_work): what the replay measures work in (`replay_rates`)
ReplayRates = tuple[float, float, float]


class EtaEstimator:
    """Projected finishes of a dispatcher's agents: the fast pass and the slow path."""

    def __init__(self, dispatcher: Dispatcher, time_model: StepTimeSource | None) -> None:
        self._d = dispatcher
        self.time_model = time_model
        self.model_sustains = True  # the time model may set ETAs' rate (`set_time_model`)
        self.typical_iteration_s: float | None = None  # one engine step, measured
        # How far first ETAs have been off: the ETA interval's factors (eta_interval.py).
        self.calibration = EtaCalibration()
        self.last_pass: EtaPass | None = None
        # Agents registered since the last pass, for the ETAs of agents registered after
        # them before the next pass (`unpassed_work_before`).
        self.unpassed: list[AgentState] = []
        # Recency-weighted prompt (computed) and output of a request: the batch an ETA
        # expects and the prompt tokens it prefills per step (each prompt once over its d
        # decode steps); and the whole prompt, cached or not: what attention reads.
        self.mean_prompt = 0.0
        self.mean_decode = 0.0
        self.mean_context = 0.0
        # memory_drain's last few, by key (the drain at the ETAs' iteration and at the running
        # batch's alone: `draining_step_s`)
        self._drains: dict[tuple[float, ...], MemoryDrain] = {}

    # -- what is observed ------------------------------------------------------------
    def repredict(self, agent: AgentState, expected_total_kv: float) -> None:
        """A new estimate of the agent's total KV cost: its ETA is placed again (slow path)
        until the next pass."""
        agent.expected_kv = max(float(expected_total_kv), agent.consumed_kv)
        agent.eta_at = None

    def registered(self, agent: AgentState) -> None:
        """A new agent: later registrations before the next pass count its work."""
        if len(self.unpassed) < MAX_UNPASSED:
            self.unpassed.append(agent)

    def observe_request(self, computed: int, decode: int, prompt: int) -> None:
        """A submitted request: the prompt tokens the engine will compute, its expected output
        and its whole prompt."""
        if self.mean_prompt + self.mean_decode <= 0:
            self.mean_prompt, self.mean_decode, self.mean_context = float(computed), float(decode), float(prompt)
        else:
            self.mean_prompt += MEAN_WEIGHT * (computed - self.mean_prompt)
            self.mean_decode += MEAN_WEIGHT * (decode - self.mean_decode)
            self.mean_context += MEAN_WEIGHT * (prompt - self.mean_context)

    def observe_uncached(self, uncached_prompt: int) -> None:
        """The prompt tokens the engine computed for a finished request, by its own report:
        the engine's word beats the guess made at submission."""
        self.mean_prompt += MEAN_WEIGHT * (uncached_prompt - self.mean_prompt)

    def observe_jct(self, agent: AgentState | None, first_eta_s: float, jct_s: float,
                    eta_scale: float | None = None) -> None:
        """A finished agent's JCT / first ETA (the one it was told): for ETAs' scale and
        intervals, and deadlines unless it paused (eta_interval.py). The record is of the
        replay's ETA: the one told over the scale the agent was given (`eta_scale` where the
        dispatcher has forgotten the agent already, None: unknown).

        Not an agent whose first ETA rested on a cost no predictor made (`cost_guessed`: a
        cold start's guess for a type no predictor knows): the records scale and bound ETAs
        of predicted costs, and a guess's error, tens of times theirs, is another error.
        Counted, a new server's first ten agents of an unseen type, told 0.09-2.6 s for jobs
        of 0.03 s, set the scale of the next ones at a fiftieth: told 2 ms for the same 25 ms
        jobs. (An ETA made before the engine's rate is measured is counted: its error, a
        prior rate's, is of the same kind as a measured rate's, and a fresh server's first
        agents are most of what its scale can learn from early on.)"""
        if agent is not None and agent.cost_guessed:
            return
        scale = agent.eta_scale if agent is not None else eta_scale
        if agent is not None and agent.eta_tools and agent.eta_replay_s is not None:
            first_eta_s = agent.eta_replay_s  # its ETA told was not the replay's scaled
        elif scale is not None and scale > 0.0:
            first_eta_s /= scale
        if agent is not None and agent.eta_tools and agent.eta_engine_s:
            self.calibration.observe_engine((jct_s - agent.paused_s) / agent.eta_engine_s, agent.promise_context)
        if agent is not None and agent.eta_times:
            self.calibration.observe_level(level_of(agent.eta_times, jct_s))
        self.calibration.observe(first_eta_s, jct_s, agent.promise_context if agent is not None else None,
                                 by_context=agent is None or agent.paused_s <= 0.0,
                                 pausing=agent is not None and agent.eta_pausing,
                                 large=agent is not None and agent.promise_large,
                                 deadline_eta_s=agent.eta_replay_s if agent is not None else None)

    @property
    def _has_mix(self) -> bool:
        return self.mean_prompt + self.mean_decode > 0

    # -- rates and step times -----------------------------------------------------------
    @property
    def eta_rate(self) -> float:
        """The rate ETAs divide work by: what the time model's engine sustains on the current
        mix with its cache full of reservations, else R. Not the measured R: that is the rate
        of the last stretch of steps, which at a burst's start (every agent prefilling its
        first prompt at once) reads a fraction of the engine's long-run rate."""
        tau = self.sustained_tau()
        d = self._d
        return d.rate if tau is None else max(d.rate, d.rate_at(tau))

    def replay_rates(self) -> ReplayRates:
        """What the replay measures work in: (rate, per_unit, prefill_work).

        KV token-time does not see prefill: an agent of long prompts and short answers costs
        little of it and takes the engine long. With a time model the replay divides by R0,
        the rate of its engine on the current mix were prompts free, and adds each agent's
        own prefill (`AgentShape.prefill_tokens`, the share not yet done) as the work of that
        time at R0 (`prefill_work` a token); an agent whose prefill is unknown is assumed to
        prefill like the mix, its charge scaled by R0 / eta_rate (`per_unit`), which makes
        its time the one eta_rate gives. Without a time model, (eta_rate, 1, 0)."""
        rate = self.eta_rate
        tau = self.sustained_tau(prefill=False)
        if tau is None or (free := self._d.rate_at(tau)) <= rate:
            return rate, 1.0, 0.0
        return free, free / rate, self.prefill_token_s() * free

    def sustained_tau(self, prefill: bool = True) -> float | None:
        """tau as the time model's engine sustains it on the mix of requests seen (the
        simulator's `EngineProfile.effective_tau_s`, from the running means): a request
        reserves p + d, holds p + d/2 on average, and prefills p over its d steps (not with
        `prefill=False`). None without a time model or a request seen."""
        if self.time_model is None or not self.model_sustains or not self._has_mix:
            return None
        capacity = self._d.kv_capacity
        p, d = self.mean_prompt, max(1.0, self.mean_decode)
        it = self.step_holding(capacity, prefill)
        served = capacity * (p + d / 2) / (p + d)  # KV in use with the cache reserved full
        return capacity * it / served if it > 0 and served > 0 else None

    def gap_closing(self, backlog: int) -> float:
        """How far V advances while the arrivals the ETAs count go on (`arrivals.span_s`):
        GPS serves R a second among the backlogged agents, about half of the expected
        newcomers among them on average over the span."""
        arrivals = self._d.arrivals
        if arrivals.rate <= 0.0:
            return 0.0
        return arrivals.span_s * self._d.rate / max(1.0, backlog + 0.5 * arrivals.expected_agents())

    def iteration_s(self) -> float:
        """One engine step with the work known now admitted: the time model's at the batch
        and KV the running and pending requests make (up to M), else the measured typical
        step, else tau."""
        d = self._d
        if self.time_model is None:
            return self.typical_iteration_s or d.tau
        # the memory the work known now fills, or what the measured arrivals keep filled
        utilisation = min(1.0, d.arrivals.rate / d.rate)
        kv = min(d.kv_capacity, max(d.ledger.reserved_kv + d.ledger.pending_kv, utilisation * d.kv_capacity))
        if kv <= 0 or not self._has_mix:
            return step_function(self.time_model)(1, 0, 0)
        return self.step_holding(kv)

    def step_holding(self, kv: float, prefill: bool = True) -> float:
        """The time model's step with `kv` tokens reserved by requests of the current mix:
        a request reserves p + d (p the prompt it computes), prefills p once per d steps and
        attends over its whole prompt and d/2 outputs on average over its life (its shared
        prefixes too: attention reads them per request)."""
        assert self.time_model is not None
        p, d = self.mean_prompt, max(1.0, self.mean_decode)
        batch = max(1.0, kv / (p + d))
        context = max(p, self.mean_context)
        prefilled = round(batch * p / d) if prefill else 0
        return step_function(self.time_model)(round(batch), prefilled, int(batch * (context + d / 2)))

    def saturated_iteration_s(self) -> float:
        """One engine step with the whole cache in use by the current mix of requests (the
        time model's; 0 without one): the steps of a critical path under contention, which
        the recent steps' percentiles, measured under a lighter load, can understate."""
        if self.time_model is None or not self._has_mix:
            return 0.0
        return self.step_holding(self._d.kv_capacity)

    def prefill_token_s(self) -> float:
        """The time model's cost of one more prompt token computed in a step (0 without one):
        the prefill on an agent's critical path (a stage's requests decode once their prompts
        are in; an agent of long prompts and short answers is mostly prefill)."""
        if self.time_model is None:
            return 0.0
        step = step_function(self.time_model)
        return max(0.0, (step(1, PREFILL_PROBE_TOKENS, 0) - step(1, 0, 0)) / PREFILL_PROBE_TOKENS)

    def prefill_of(self, shape: AgentShape, token_s: float | None = None) -> float | None:
        """The prompt tokens the agent's shape computes (None: unknown), its prompts' chunked
        prefill counted as the prefill tokens of the same time: past the engine's step budget
        a prompt costs more than its tokens' linear term. From the sum of the prompts (P)
        and of their squares (Q), as P^2 / Q prompts of Q / P tokens each: (Q - chunk x P)
        token pairs past the budget, exact for prompts of one length and otherwise no more
        than the prompts' own sum of (p - chunk) x p over those past it. No prompt is longer
        than all of them together nor than the cache (a declaration that says so is capped).
        `token_s`: `prefill_token_s()`, where the caller has it already."""
        prefill = shape.prefill_tokens
        square = shape.prefill_square_tokens
        chunked = chunked_function(self.time_model)
        if prefill is None or not square or prefill <= 0 or chunked is None:
            return prefill
        if token_s is None:
            token_s = self.prefill_token_s()
        if token_s <= 0.0:
            return prefill
        length = self.prompt_length(prefill, square)
        return prefill + chunked(length) * (prefill / length) / token_s

    def prompt_length(self, prefill: float, square: float) -> float:
        """The length of the prompts a shape's sum P and sum of squares Q stand for: Q / P,
        no longer than all of them together nor than the cache (a declaration that says so
        is capped). Both positive."""
        return min(square / prefill, float(prefill), float(self._d.kv_capacity))

    def serial_steps(self, shape: AgentShape, own_kv: float, left: float) -> float:
        """Engine steps left on the path of an agent whose requests cannot share the cache
        (0 where they can): prompts of Q / P tokens (`prefill_of`) longer than half the cache
        run one after another, each holding its prompt for its decode steps, so its KV
        cost left over one prompt's length counts its decode steps, plus a step each."""
        prefill, square = shape.prefill_tokens, shape.prefill_square_tokens
        if not prefill or not square or prefill <= 0:
            return 0.0
        length = self.prompt_length(prefill, square)
        if length <= self._d.kv_capacity / 2:
            return 0.0
        return own_kv / length + prefill / length * left

    def draining_step_s(self, it: float) -> float:
        """One engine step while nothing is admitted: the time model's with the running
        requests alone (`it` without a time model or any running)."""
        ledger = self._d.ledger
        if self.time_model is None or not ledger.running_count:
            return it
        return step_function(self.time_model)(ledger.running_count, 0, int(ledger.reserved_kv))

    def memory_drain(self, now: float, it: float) -> MemoryDrain:
        """When the running requests free their memory (`eta.MemoryDrain`): each ends after
        its expected output less the steps (`it` each, the iteration of the ETA's critical
        paths) it has run since admitted; one past its expectation, after one more step."""
        d = self._d
        ledger = d.ledger
        key = (now, it, ledger.running_count, ledger.reserved_kv, ledger.pinned_kv)
        cached = self._drains.get(key)
        if cached is not None:
            return cached  # a burst's registrations at one instant, nothing admitted between
        free = d.kv_capacity - ledger.reserved_kv - ledger.pinned_kv
        token_s = self.prefill_token_s()
        chunked = chunked_function(self.time_model) if token_s > 0.0 else None
        running = []
        for req in ledger.running.values():
            ran = now - req.admitted_at if req.admitted_at is not None else 0.0
            # its prompt first: a prompt of most of the cache takes tens of steps' time to
            # prefill, and the request holds its memory through them
            computed = req.spec.prompt_tokens - shared_tokens(req.segments)
            prefill = computed * token_s + (chunked(computed) if chunked is not None else 0.0)
            running.append((max(it, req.spec.expected_tokens * it + prefill - ran), req.footprint))
        drain = MemoryDrain.of(running, free)
        if len(self._drains) >= 4:
            self._drains.clear()
        self._drains[key] = drain
        return drain

    def request_need(self, agent: AgentState) -> float:
        """The memory one of the agent's requests reserves, no more than the cache: the one
        it has queued where it has one (what admission waits to fit: a later stage's request
        of most of the cache holds back the agents behind it until the running ones drain,
        whatever the mix's requests are); else a request of the mix (its whole prompt and
        expected output), no more than a stage of its shape holds (prompts and longest
        output per stage); but before any of its requests has finished, no less than its
        first stage's largest request where its shape says it (a first request of most of
        the cache waits for most of it to drain)."""
        d = self._d
        head = d.queue.head(agent) if agent.pending else None
        if head is not None:
            return min(float(d.kv_capacity), float(d.ledger.need(head, d.policy.admission == FOOTPRINT)))
        need = self.mean_context + self.mean_decode
        shape = agent.eta_shape or agent.shape
        if shape.prefill_tokens is not None and shape.critical_path_tokens is not None:
            need = min(need, (shape.prefill_tokens + shape.critical_path_tokens) / max(1, shape.stages))
        if shape.first_request_tokens is not None and agent.requests_done == 0:
            need = max(need, shape.first_request_tokens)
        return min(float(self._d.kv_capacity), need)

    def start_wait(self, agent: AgentState, drain: MemoryDrain) -> float:
        """Seconds before the agent can start: none with a request in the engine, else until
        the running requests free what one of its requests reserves."""
        return 0.0 if agent.running else drain.wait_s(self.request_need(agent))

    # -- one agent's work ---------------------------------------------------------------
    def remaining(self, agent: AgentState) -> tuple[float, float]:
        """(work not yet done, its total) in policy units: the re-predicted total once there
        is one (`Dispatcher.repredict`), else the charge."""
        if agent.expected_kv is None:
            return max(0.0, agent.charged_cost - agent.consumed_cost), agent.charged_cost
        unit = self._d.costs.kv_unit
        # never less than the requests it has already submitted
        expected = max(agent.expected_kv, agent.committed_kv)
        return max(0.0, expected - agent.consumed_kv) * unit, expected * unit

    def critical_path_s(self, agent: AgentState, it: float) -> float:
        """The agent's remaining critical path: its expected shape scaled by the share of its
        (re-predicted) cost not yet consumed, else the longest decode of its known requests."""
        own, total = self.remaining(agent)
        left = own / total if total > 0 else 1.0
        left = min(1.0, max(0.0, left))
        shape = agent.eta_shape or agent.shape
        if shape.critical_path_tokens is None:  # no prefill on the path: no time model to ask
            return self.path_s(agent, shape, left, 0.0, it, None, 0.0)
        token_s = self.prefill_token_s()
        return self.path_s(agent, shape, left, own / self._d.costs.kv_unit, it,
                           self.prefill_of(shape, token_s), token_s)

    def path_s(self, agent: AgentState, shape: AgentShape, left: float, own_kv: float, it: float,
               prefill: float | None, token_s: float) -> float:
        """`critical_path_s` from its parts (the fast pass has them): the share `left` of
        the declared path and of the prefill, or of the requests one after another where
        they cannot share the cache (`serial_steps`, `own_kv` the KV cost left); else the
        longest decode of its known requests."""
        if shape.critical_path_tokens is not None:
            steps = max((shape.critical_path_tokens + max(1, shape.stages)) * left,
                        self.serial_steps(shape, own_kv, left))
            return steps * it + (prefill or 0) * token_s * left
        if agent.pending or agent.running:
            return (agent.longest_decode + 1) * it
        return 0.0

    def replay_work(self, agent: AgentState, rates: ReplayRates) -> float:
        """The agent's remaining work in the replay's units (`replay_rates`)."""
        own, total = self.remaining(agent)
        _, per_unit, prefill_work = rates
        prefill = self.prefill_of(agent.eta_shape or agent.shape)
        if prefill is None or not prefill_work or total <= 0.0:
            return own * per_unit
        return own + own / total * prefill * prefill_work

    def pause_ahead(self, agent: AgentState, now: float) -> float:
        """The tool time its ETA expects: its type's mean pause before each stage it has not
        started, less what it has already paused before the next one. In a tool call its
        client announced, the current pause is that call's expected rest (pauses.py); the
        agent will come back from it even if it declared no further stage."""
        shape = agent.eta_shape or agent.shape
        left = stages_left(shape.stages, agent.stages_started)
        pauses = self._d.pauses
        # Only the boundaries crossed in its own episode of arrivals say whether the traffic
        # pauses: after a lull, the agents that come may be another application's, and an
        # ETA that expects a pause that does not come errs without bound (a 0.5 s agent
        # told 8 s), one that misses a pause that comes by less than 1.
        since = self._d.arrivals.episode_start(agent.submitted_at)
        if agent.tool is not None and agent.idle_since is not None:
            rest = pauses.remaining_s(agent, now)
            if rest is not None:
                return rest + pauses.mean_s(agent.agent_type, since) * max(0, left - 1)
        if left == 0:
            return 0.0
        mean = pauses.mean_s(agent.agent_type, since)
        paused = now - agent.idle_since if agent.idle_since is not None else 0.0
        return max(0.0, mean * left - min(paused, mean))

    def expects_tools(self, agent: AgentState, now: float) -> bool:
        """Whether the agent's ETA counts tool time apart (`told_with_tools`): it has stages
        ahead, and the recent boundaries of its episode of arrivals held pauses."""
        shape = agent.eta_shape or agent.shape
        if stages_left(shape.stages, agent.stages_started) <= 0:
            return False
        return self._d.pauses.share_lately(self._d.arrivals.episode_start(agent.submitted_at)) > 0.0

    def remaining_times(self, agent: AgentState, now: float) -> list[float] | None:
        """The remaining time of an agent whose ETA counts tool time apart, as equally likely
        points (tool_time.py): its engine time by the replay, as far off as such ETAs have
        been, plus its tool time by the pauses seen. None where its tool time is not known
        that way (`PauseStats.tool_grid`)."""
        return self._remaining_times(agent, now, *self._boundaries_ahead(agent))

    def told_with_tools(self, agent: AgentState, now: float) -> tuple[float, float, float, bool] | None:
        """(ETA, interval low, interval high, open-ended), seconds from now, of an agent whose
        ETA counts tool time apart (`remaining_times`; None: not known that way). Open-ended:
        the pauses seen cannot place the interval's high end (`PauseStats.tail_unseen`:
        early in an episode, more than the share the interval leaves above it may fall
        past the longest pause that has ended)."""
        left, since = self._boundaries_ahead(agent)
        times = self._remaining_times(agent, now, left, since)
        if times is None:
            return None
        low_q, high_q = self.calibration.tool_levels()
        told, low, high = told_with_tools(times, low_q, high_q)
        return told, low, high, self._d.pauses.tail_unseen(left, since, now) > 1.0 - high_q

    def _boundaries_ahead(self, agent: AgentState) -> tuple[int, float | None]:
        """The agent's stage boundaries ahead and the start of its episode of arrivals."""
        shape = agent.eta_shape or agent.shape
        return (stages_left(shape.stages, agent.stages_started),
                self._d.arrivals.episode_start(agent.submitted_at))

    def _remaining_times(self, agent: AgentState, now: float, left: int, since: float | None) -> list[float] | None:
        tool = self._d.pauses.tool_grid(agent, left, since, now)
        if tool is None:
            return None
        engine = max(0.0, self.eta_time(agent, now) - now - self.pause_ahead(agent, now))
        return remaining_times(engine, self.calibration.engine_ratios(agent.promise_context), tool)

    def eta_key(self, agent: AgentState, now: float, fair: Any = None) -> Any:
        """The agent's place in the replay: the policy's static key, or, with several
        tenants under a tag-ordered policy, its H-GPS finish (tags of different tenants are
        on different scales)."""
        d = self._d
        if not d.clock.hierarchical or not isinstance(d.policy, Justitia):
            return d.policy.static_key(agent)
        if fair is not None:
            t = (fair.finish.get(agent.agent_id) if agent.in_reference
                 else fair.arrival(agent.charged_cost, agent.tenant))
            if t is not None:
                return (t, agent.seq)
        if agent.eta_key_at is None:  # once per agent between passes (a burst's registrations)
            agent.eta_key_at = d.fair_finish_time(agent.agent_id, now)
        return (agent.eta_key_at, agent.seq)

    # -- the slow path -----------------------------------------------------------------
    def order_key(self, now: float) -> Callable[[AgentState], Any]:
        """An agent's place in the replay's order at `now` (`eta_key` where tenants' tags are
        on different scales, else the policy's static key)."""
        d = self._d
        if d.clock.hierarchical and isinstance(d.policy, Justitia):
            return functools.partial(self.eta_key, now=now)
        return d.policy.static_key

    def unpassed_work_before(self, agent: AgentState, key: Any, rates: ReplayRates, now: float = 0.0) -> float:
        """Remaining work of the agents registered since the last pass that the policy orders
        before `agent`: a burst registers faster than passes run, and each of its agents
        waits behind the ones registered before it."""
        d = self._d
        work = 0.0
        static_key = self.order_key(now)
        for a in self.unpassed:
            if a is not agent and d.agents.get(a.agent_id) is a and static_key(a) < key:
                work += self.replay_work(a, rates)
        return work

    def in_order(self) -> bool:
        """Whether admission starts the queue's requests in strict order (no backfill, the
        scheduler's own admission): then a request that waits for memory holds back every
        agent ordered after it."""
        d = self._d
        return not d.backfill and d.policy.admission != ENGINE

    def blocked_before(self, agent: AgentState, key: Any, it: float, now: float) -> float:
        """Seconds until the agents the policy orders before `agent` (at `key`) that wait
        for memory can all have started: admission in strict order starts none of the
        agents after them sooner, whatever their own size. The last pass's, and that of the
        agents registered since (O(log N) plus those)."""
        if not self.in_order():
            return 0.0
        blocked = self.last_pass.blocked_until(key) - now if self.last_pass is not None else 0.0
        d = self._d
        static_key = self.order_key(now)
        held: MemoryDrain | None = None
        for a in self.unpassed:
            if (a is not agent and (a.pending or a.running) and d.agents.get(a.agent_id) is a
                    and static_key(a) < key):
                held = held or self.memory_drain(now, self.draining_step_s(it))
                blocked = max(blocked, self.holds_back(a, held))
        return max(0.0, blocked)

    def holds_back(self, agent: AgentState, held: MemoryDrain | None) -> float:
        """Seconds the agent holds back the agents ordered after it (`held`: the running
        requests' drain while nothing is admitted; None: admission not in order, no agent
        holds back): until its pending request can start, where it has one and none running;
        with requests running and none pending, until there is room for its next stage's
        largest request where its shape says it (`AgentShape.stage_request_tokens`). That
        request joins the queue ahead of theirs the moment its stage ends, and admission
        stops at it until the cache has drained enough; an agent small enough to be admitted
        before then starts sooner, but holds memory that request then waits for."""
        if held is None:
            return 0.0
        if agent.pending:
            return 0.0 if agent.running else self.start_wait(agent, held)
        sizes = (agent.eta_shape or agent.shape).stage_request_tokens
        if not agent.running or not sizes or agent.stages_started >= len(sizes):
            return 0.0
        return held.wait_s(min(float(self._d.kv_capacity), sizes[agent.stages_started]))

    def work_before(self, agent: AgentState, key: Any, rates: ReplayRates, now: float) -> float:
        """Remaining work the policy orders before `agent` (at `key`): the last pass's,
        and that of the agents registered since (O(log N) plus those)."""
        before = self.last_pass.work_before(key) if self.last_pass is not None else 0.0
        return before + self.unpassed_work_before(agent, key, rates, now)

    def queue_place(self, agent: AgentState, now: float) -> tuple[float, float]:
        """(work ahead of the agent, its own remaining work), in the replay's units: where
        it stands in the queue, which tells how much of its ETA is known work."""
        rates = self.replay_rates()
        return self.work_before(agent, self.eta_key(agent, now), rates, now), self.replay_work(agent, rates)

    def eta_time(self, agent: AgentState, now: float) -> float:
        """Projected finish under the running policy: the last pass's, else the agent placed
        in its order by binary search (O(log N)), plus the pauses it is expected to take."""
        if agent.eta_at is not None:
            return max(now, agent.eta_at) + self.pause_ahead(agent, now)
        d = self._d
        key = self.eta_key(agent, now)
        rates = self.replay_rates()
        before = self.work_before(agent, key, rates, now)
        reading = d.clock.peek(now)
        v = d.clock.tenant_v(agent.tenant, now) if d.clock.hierarchical else reading.V
        ahead = d.arrivals.ahead(d.policy.arrival_gap(agent, v, self.gap_closing(reading.backlog)))
        it = self.iteration_s()
        drain = self.memory_drain(now, it)
        wait = max(self.start_wait(agent, drain), self.blocked_before(agent, key, it, now))
        return eta_of(now, before, self.replay_work(agent, rates), rates[0], ahead * rates[1],
                      self.critical_path_s(agent, it), d.arrivals.span_s, wait) \
            + self.pause_ahead(agent, now)

    # -- the fast pass -----------------------------------------------------------------
    def refresh(self, now: float) -> None:
        """Replay the policy's order once (O(N log N)) and cache every agent's ETA and GPS
        finish."""
        d = self._d
        d.arrivals.freeze(now, self.eta_rate)
        for a in self.unpassed:
            a.eta_key_at = None
        self.unpassed.clear()
        reading = d.clock.peek(now)
        v = reading.V
        closing = self.gap_closing(reading.backlog)
        fair = d.clock.projection(now)  # every backlogged agent's GPS finish, one walk
        policy, it = d.policy, self.iteration_s()
        rate, per_unit, prefill_work = self.replay_rates()
        agents = list(d.agents.values())
        hier = d.clock.hierarchical
        if hier:  # tenants first: replay in the order of the agents' H-GPS finish
            keys = [self.eta_key(a, now, fair) for a in agents]
            tenant_v = {t: d.clock.tenant_v(t, now) for t in {a.tenant for a in agents}}
        else:
            keys = list(map(policy.static_key, agents))
        order = sorted(range(len(agents)), key=keys.__getitem__)
        keys = [keys[i] for i in order]
        prefix = [0.0] * (len(agents) + 1)
        # eta_time's per-agent steps, inlined: this loop is the whole cost of the upkeep
        gap, costs, cprefix = policy.arrival_gap, d.arrivals._costs, d.arrivals._prefix
        unit = d.costs.kv_unit
        prefill_s, prefill_of = self.prefill_token_s(), self.prefill_of
        counts_chunked = chunked_function(self.time_model) is not None
        scale = d.arrivals.rate * per_unit / cprefix[-1] if cprefix and cprefix[-1] > 0 else 0.0
        cap = MAX_ARRIVAL_SHARE * rate
        span = d.arrivals.span_s
        drain = self.memory_drain(now, it)
        held = self.memory_drain(now, self.draining_step_s(it)) if self.in_order() else None
        blocked = 0.0  # seconds until the agents placed so far that wait for memory can start
        blocked_at = [float("-inf")] * (len(agents) + 1)
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
            prefill = prefill_of(shape, prefill_s) if counts_chunked and shape.prefill_square_tokens \
                else shape.prefill_tokens
            # replay_work, inlined
            if prefill is None or not prefill_work or charged <= 0.0:
                work = own * per_unit
            else:
                work = own + left * prefill * prefill_work
            g = (gap(a, tenant_v[a.tenant] if hier else v, closing)) if scale else 0.0
            arriving = scale * cprefix[bisect_left(costs, g)] if g > 0.0 else 0.0
            # served_by, for the work ahead (start) and with its own (finish): arrivals take
            # their share for `span` seconds, then the whole rate is the agents' again
            r = rate - (arriving if arriving < cap else cap)
            start = total / r
            finish = (total + work) / r
            if arriving > 0.0 and finish > span:
                finish = max(span, (total + work + arriving * span) / rate)
                if start > span:
                    start = max(span, (total + arriving * span) / rate)
            own_wait = self.start_wait(a, drain)
            wait = own_wait if own_wait > blocked else blocked
            start, finish = max(start, wait), max(finish, wait)
            path = self.path_s(a, shape, left, own / unit, it, prefill, prefill_s)
            a.eta_at = now + (finish if finish > start + path else start + path)
            total += work
            prefix[k + 1] = total
            blocked = max(blocked, self.holds_back(a, held))
            blocked_at[k + 1] = now + blocked
        self.last_pass = EtaPass(now, rate, keys, prefix, blocked_at)
        self._cache_fair(agents, fair)

    @staticmethod
    def _cache_fair(agents: list[AgentState], fair: Projection | HierProjection) -> None:
        """Every agent's GPS finish from one projection (views read it between passes)."""
        if isinstance(fair, HierProjection):
            for a in agents:
                a.fair_at = fair.finish.get(a.agent_id) if a.in_reference else fair.arrival(a.charged_cost, a.tenant)
        else:
            for a in agents:
                a.fair_at = fair.finish.get(a.agent_id) if a.in_reference else fair.arrival(a.charged_cost)

    def recall(self, events: Sequence[tuple[float, float]], now: float, unit: float) -> int:
        """Replay past registrations (time, predicted KV cost) into the measured arrivals;
        `unit` converts KV cost to policy units. Returns how many were replayed."""
        arrivals = self._d.arrivals
        kept = sorted((t, c) for t, c in events if t <= now and math.isfinite(t) and math.isfinite(c) and c >= 0)
        for t, cost in kept:
            arrivals.add(t, cost * unit)
        arrivals.freeze(now)
        return len(kept)
