"""Online estimate of tau, the iteration time behind the GPS rate R = M / tau.

R must be the KV token-time the engine *actually* serves per second with its memory in use,
not M divided by the raw step time: reserved-but-not-yet-used memory and prefill-heavy steps
make the real rate lower, and a too-high R lets V run ahead of the engine until every tag lies
behind V and the order degenerates to agent FCFS (docs/concepts.md, "Which tau").

Each engine step with `kv_in_use` tokens of KV cache serves `kv_in_use` units. What fills the
cache under load is `fill`: the dispatcher's reservations (`kv_reserved`, footprint policies)
or the memory in use itself (policies that let the engine fill and preempt). A step that took
`duration` with a fraction `fill / M` of the cache filled would, with the cache full and the
same use per filled token, serve `kv_in_use * M / fill` units in about the same time, so it
is worth a tau sample of `duration * fill / kv_in_use` (the raw step time when the cache is
used as full as it is filled). Steps with `fill` under `min_fill * M` are skipped (a nearly
empty cache mostly measures fixed per-step overheads). The estimate is busy time over the
full-cache iterations served (the sum of `duration / sample`), both decayed exponentially
over `half_life_s` seconds of busy time: the rate the engine sustained, not a mean of the
samples (which long prefill steps with little KV in use would dominate).

    est = TauEstimator(kv_capacity_tokens=45_000, initial_tau_s=0.040)
    est.observe_step(duration_s, kv_in_use=usage * M, kv_reserved=dispatcher.ledger.reserved_kv)
    dispatcher.set_iteration_time(est.tau_s, now, **est.promise_times())   # e.g. once a second

Deadlines must hold on the engine as it runs, not on average: `promise_times` gives the
dispatcher the bound's iteration time as the larger of the p90 of the recent raw step times
and the slowest mean over 32 consecutive steps (a critical path is a sum of many steps, and
long prefill steps make the mean heavier than the p90), and its rate from the slowest tau
sustained over 64 consecutive measured steps (at least tau). Until a step with a
full-enough cache has been measured, tau is only the initial guess: promises are then
widened (`COLD_WIDENING` times the guess) and say so.
"""

from __future__ import annotations

import collections
import itertools
import statistics
from dataclasses import dataclass, field
from typing import TypedDict

COLD_WIDENING = 3.0  # deadlines assume this many times the initial tau until tau is measured
PESSIMISTIC_QUANTILE = 0.9
RATE_STRETCH_STEPS = 64  # the bound's rate: the slowest stretch of this many measured steps


class PromiseTimes(TypedDict):
    """`TauEstimator.promise_times`: the keyword arguments of `Dispatcher.set_iteration_time`
    beyond tau."""

    bound_tau: float
    bound_iteration_s: float
    typical_iteration_s: float | None
    uncertainty: str | None


@dataclass
class TauEstimator:
    kv_capacity_tokens: int
    initial_tau_s: float
    half_life_s: float = 30.0
    min_fill: float = 0.5
    step_window: int = 512  # raw step durations kept for the percentiles
    # The initial guess counts as this many full-cache iterations of evidence, decayed with
    # the rest, so that no single step sets tau alone: a first step is often one long
    # prefill (tens of times a decode step), and R read from it alone would be a fraction of
    # the engine's until the next update, with every ETA given meanwhile as many times long.
    prior_iterations: float = 32.0
    _weight: float = 0.0  # decayed busy seconds observed (the prior's included)
    _weighted_tau: float = 0.0  # decayed full-cache iterations served (sum of duration / sample)
    _measured: bool = False  # a step with a full-enough cache has been observed
    _steps: collections.deque[float] = field(default_factory=collections.deque)
    # recent measured steps: (duration, full-cache iterations served)
    _samples: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        self._steps = collections.deque(maxlen=self.step_window)
        self._samples = collections.deque(maxlen=self.step_window)
        self._weight = self.prior_iterations * self.initial_tau_s
        self._weighted_tau = self.prior_iterations

    def observe_step(self, duration_s: float, kv_in_use: float, kv_reserved: float | None = None) -> None:
        """Record one engine step: its duration, the KV tokens it held and, for footprint
        policies, the KV tokens the dispatcher had reserved."""
        self.observe_steps(1, duration_s, kv_in_use, kv_reserved)

    def observe_steps(self, n: int, duration_s: float, kv_in_use: float, kv_reserved: float | None = None) -> None:
        """`n` steps alike, each of `duration_s` (the simulator's stretches of decode
        iterations): the same as `n` calls of `observe_step`, in O(min(n, step_window))."""
        if n <= 0:
            return
        if duration_s > 0 and kv_in_use > 0:
            self._steps.extend(itertools.repeat(duration_s, min(n, self.step_window)))
        fill = kv_in_use if kv_reserved is None else max(kv_reserved, kv_in_use)
        if duration_s <= 0 or kv_in_use <= 0 or fill < self.min_fill * self.kv_capacity_tokens:
            return
        # A step is worth a tau sample of duration x fill / in use; what a full cache serves
        # in it, in full-cache iterations, is duration / sample = in use / fill, and tau is
        # busy time over that, the rate's own definition. (Not a mean of the samples weighted
        # by duration: a few long prefill steps with little KV in use would weigh like many
        # decode steps, and tau would read many times the engine's.)
        served = kv_in_use / fill
        self._measured = True
        self._samples.extend(itertools.repeat((duration_s, served), min(n, self.step_window)))
        decay = 0.5 ** (duration_s / self.half_life_s)
        decay_n = decay ** n
        total = n if decay >= 1.0 else (1.0 - decay_n) / (1.0 - decay)  # sum of decay^k, k < n
        self._weight = self._weight * decay_n + duration_s * total
        self._weighted_tau = self._weighted_tau * decay_n + served * total

    def state(self) -> tuple[float, float]:
        """The decayed evidence tau is made of: (busy seconds, full-cache iterations served)."""
        return self._weight, self._weighted_tau

    def resume(self, weight: float, weighted_tau: float) -> bool:
        """Continue from the evidence a previous run on the same engine left (`state`), as if
        its steps had been seen here; promises stay widened until a step is measured here
        (False: not usable evidence, nothing changed)."""
        if not (0.0 < weight < float("inf") and 0.0 < weighted_tau < float("inf")):
            return False
        self._weight, self._weighted_tau = float(weight), float(weighted_tau)
        return True

    def set_kv_capacity(self, kv_capacity_tokens: int) -> None:
        """Replicas changed: samples already taken stay valid (they are per full cache)."""
        self.kv_capacity_tokens = int(kv_capacity_tokens)

    @property
    def tau_s(self) -> float:
        """The current estimate: the initial guess until a step with a full-enough cache,
        then busy time over full-cache iterations, the guess counting as `prior_iterations`."""
        if self._weight <= 0 or self._weighted_tau <= 0:
            return self.initial_tau_s
        return self._weight / self._weighted_tau

    @property
    def measured(self) -> bool:
        """True once a step with a full-enough cache has been observed (else tau is the guess)."""
        return self._measured

    def step_quantile(self, q: float) -> float | None:
        """The q-quantile of the recent raw step durations (None before any step)."""
        if not self._steps:
            return None
        if len(self._steps) == 1:
            return self._steps[0]
        return statistics.quantiles(self._steps, n=100, method="inclusive")[min(98, max(0, round(q * 100) - 1))]

    def _slowest_stretch(self, steps: int = 32) -> float:
        """The slowest mean over `steps` consecutive recent steps. An agent's critical path
        is a sum of many steps, and step times have a heavy tail (prefill steps are many
        times a decode step): their mean can exceed the p90 of single steps."""
        xs = list(self._steps)
        if len(xs) < steps:
            return sum(xs) / len(xs) if xs else 0.0
        return max(sum(xs[i:i + steps]) / steps for i in range(0, len(xs) - steps + 1, steps))

    def _slowest_rate_stretch(self, steps: int = RATE_STRETCH_STEPS) -> float:
        """The slowest tau over `steps` consecutive measured steps (busy time over the
        full-cache iterations they served). Not a percentile of single samples: a step that
        prefills a newly admitted stage holds little of the memory reserved for it, and its
        sample reads many times the tau a stretch sustains, and a percentile of such samples
        would make deadlines orders of magnitude past the JCTs."""
        pairs = list(self._samples)
        if not pairs:
            return self.tau_s
        if len(pairs) < steps:
            steps = len(pairs)
        # windows aligned on the newest step: the latest stretch always counts
        return max(sum(d for d, _ in pairs[i:i + steps]) / sum(it for _, it in pairs[i:i + steps])
                   for i in range(len(pairs) % steps, len(pairs) - steps + 1, steps))

    def promise_times(self) -> PromiseTimes:
        """Keyword arguments of `Dispatcher.set_iteration_time` beyond tau: the pessimistic
        rate and iteration time of the bound, the typical step for ETAs, and the uncertainty
        that widens promises (None when they are firm)."""
        median = self.step_quantile(0.5)
        high = self.step_quantile(PESSIMISTIC_QUANTILE)
        if not self.measured:
            guess = COLD_WIDENING * self.tau_s
            return {
                "bound_tau": guess,
                "bound_iteration_s": max(guess, high or 0.0),
                "typical_iteration_s": median,
                "uncertainty": (f"the engine's rate is not measured yet: the deadline assumes "
                                f"{COLD_WIDENING:g}x the initial iteration time"),
            }
        # The rate a promise may count on: the slowest stretch of measured steps. Not tau
        # scaled by the spread of single steps (p90 over median): on a mix of prefill and
        # decode steps that ratio reads 10-20 whatever the rate, and tau already averages
        # the two kinds of step; how much KV time a step serves varies with how full the
        # cache is of reservations not yet in use, which a stretch of steps measures.
        # measured: a step was recorded (observe_step keeps every step it measures by)
        assert high is not None
        return {
            "bound_tau": max(self.tau_s, self._slowest_rate_stretch()),
            "bound_iteration_s": max(high, self._slowest_stretch()),
            "typical_iteration_s": median,
            "uncertainty": None,
        }
