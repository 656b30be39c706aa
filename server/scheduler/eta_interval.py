"""ETA calibration: the ETA told scaled, and the [p10, p90] interval around it, by how far
the first ETAs of the agents that have finished fell short or long.

An ETA (eta.py) is a forecast from what the scheduler knows when it is made; its error comes
from what it cannot know (work that arrives later, costs that differ from their prediction,
an engine that speeds up or slows down) and from what its replay assumes (the work ordered
ahead of an agent served before it, when the engine in fact runs a small agent beside the
large ones ahead of it). Rather than model each source, every finished agent leaves the
ratio JCT / first ETA (the replay's ETA, before any scaling), filed under the context it
registered in (its place in the queue: tight_promise.py), and

- the ETA told is the replay's times the context's *scale*: the factor s that minimises
  the mean relative error |s ETA - JCT| / JCT over the context's last `window` ratios,
  the median of the ratios weighted by ETA / JCT (`weighted_median`). On the evaluation
  family the replay's ETAs run long (median JCT / ETA 0.70 deep in the queue), and
  relative error punishes an ETA twice the JCT (error 1) more than one half of it (0.5):
  the scale is the one the target measures, not the plain median;
- the interval spans the same ratios' 5th and 95th percentiles (split conformal
  prediction by context, Mondrian): about 85% of agents finish inside their first
  interval, provided the traffic ahead looks like the traffic behind.

Ratios are kept apart by whether the agent's first ETA expected pauses (the share of recent
stage boundaries that held one, times its type's mean pause: pauses.py): an agent is scaled by
the agents whose ETAs were made as its own was. After a lull, a server that had served agents
which paused expects their pauses of the next agents too; their ETAs run long, and scaled by
the ratios of those same first agents, the ETAs of the agents after them, which expect none,
ran at 0.13 of the replay's (`tenants` served after `sessions` on the tuning seeds: first-ETA
error p90 0.93, 0.84 with the kinds apart; held out 0.91 and 0.87). A kind with fewer than
`min_seen` ratios in the context takes the context's. A context with fewer than `min_seen`
ratios takes those of every context; with fewer than
that in all, a fresh server's: no scaling, and prior interval factors chosen on the tuning
seeds of the evaluation family (`bench family --seeds 0-4`; docs/concepts.md, ETA
intervals), wider for an ETA that expects pauses. An agent keeps the scale it was given at
registration for its whole life, so that its first ETA divided by it is the replay's again
when it finishes.

The deadlines' record (`upper_ratio`) is the same ratios less those of agents that paused.

Pure: no clock; the dispatcher asks with `now`-relative numbers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

# Prior factors (JCT / first ETA) of a fresh server: the 10th and 90th percentiles of the
# ratio over the tuning seeds 0-4 of every shape of the family (cpu-tiny, M = 4096, 48
# agents at load 0.9): docs/concepts.md, ETA intervals.
PRIOR_LOW = 0.6
PRIOR_HIGH = 1.4
# ... of an agent whose first ETA expects pauses: its JCT holds its client's tool time, whose
# spread the ETA's mean pause does not show (lognormal pauses): the same percentiles over
# the tuning seeds' agents whose first ETAs expected pauses.
PRIOR_PAUSING_LOW = 0.35
PRIOR_PAUSING_HIGH = 1.8
# The quantiles of the ratio the interval spans. Nominally [p10, p90]; but the window's
# ratios drift as a run goes on, and at 0.1 / 0.9 the tuning seeds' members covered 75-81%,
# at 0.075 / 0.925 a mean of 80% with 32 of 180 members below 75%; at 0.05 / 0.95 a mean of
# 84%, 12 below and 12 above 95% (0.04 / 0.96: 10 below, 15 above): the middle of 75-95%.
LOW_QUANTILE = 0.05
HIGH_QUANTILE = 0.95
# Finished agents the calibration uses (the most recent); fewer than MIN_SEEN: the prior.
WINDOW = 200
MIN_SEEN = 10
# Prior of the engine-time ratio (JCT less its pauses over the first ETA less the pauses
# it expected) of an agent that pauses (tool_time.py): lognormal, its median and sigma those
# of the tuning seeds' `sessions` agents (docs/concepts.md, The ETA of an agent that pauses).
PRIOR_ENGINE_MEDIAN = 0.37
PRIOR_ENGINE_SIGMA = 0.55
# Equally likely points standing for a distribution (`quantile_grid`): the tool-time ETA's
# grids (tool_time.py) and the engine ratios' (`EtaCalibration.engine_ratios`).
GRID = 16


@dataclass(frozen=True)
class Factors:
    """What a record of JCT / first-ETA ratios gives: the interval's ends (`low`, `high`)
    and the scale of the ETA told (`scale`), each a factor on the replay's ETA."""

    low: float
    high: float
    scale: float = 1.0


def _conformal_quantile(sorted_ratios: list[float], q: float) -> float:
    """The split-conformal quantile: the ceil((n + 1) q)-th smallest of n (clipped)."""
    n = len(sorted_ratios)
    k = min(n, max(1, math.ceil((n + 1) * q)))
    return sorted_ratios[k - 1]


def quantile_grid(values: Sequence[float], points: int = GRID) -> tuple[float, ...]:
    """`points` equally likely values standing for the distribution of `values`: the order
    statistics at the middle of each of `points` equal slices (() when there are none)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0 or points <= 0:
        return ()
    return tuple(xs[min(n - 1, int((i + 0.5) * n / points))] for i in range(points))


def weighted_median(sorted_ratios: list[float]) -> float:
    """The factor s minimising the sum of |s - r| / r over the ratios r = JCT / ETA, which is
    the sum of the relative errors |s ETA - JCT| / JCT: the median of the ratios weighted by
    1 / r (the first ratio at which the weights reach half their total)."""
    total = sum(1.0 / r for r in sorted_ratios)
    acc = 0.0
    for r in sorted_ratios:
        acc += 1.0 / r
        if acc >= total / 2.0:
            return r
    return sorted_ratios[-1]


def factors_of(sorted_ratios: list[float]) -> Factors:
    """A record's factors. The interval holds the scaled ETA: a handful of agents that all
    beat (or all missed) it is no proof that the next will."""
    scale = weighted_median(sorted_ratios)
    return Factors(min(_conformal_quantile(sorted_ratios, LOW_QUANTILE), scale),
                   max(_conformal_quantile(sorted_ratios, HIGH_QUANTILE), scale), scale)


class EtaCalibration:
    """JCT / first-ETA ratios of finished agents, by the context they registered in, and the
    scale and interval factors they give."""

    def __init__(self, window: int = WINDOW, min_seen: int = MIN_SEEN,
                 prior: Factors = Factors(PRIOR_LOW, PRIOR_HIGH),
                 prior_pausing: Factors = Factors(PRIOR_PAUSING_LOW, PRIOR_PAUSING_HIGH)) -> None:
        self._window = window
        self._ratios: deque[float] = deque(maxlen=window)
        # every ratio by the context the agent registered in (tight_promise.py; None:
        # observed without one)
        self._all_by_context: dict[int | None, deque[float]] = {}
        # the same less the agents that paused, by context and size: the deadlines' record
        # (`upper_ratio`)
        self._by_context: dict[tuple[int | None, bool], deque[float]] = {}
        # by context and whether the agent's ETA expected pauses: the scale and interval
        self._by_kind: dict[tuple[int | None, bool], deque[float]] = {}
        self._min_seen = min_seen
        self._prior = prior
        self._prior_pausing = prior_pausing
        # per (context, pausing), emptied by `observe`
        self._cache: dict[tuple[int | None, bool], Factors] = {}
        # engine-time ratios of the agents that paused, by context (`engine_ratios`), and
        # their grids, emptied by `observe_engine`
        self._engine: deque[float] = deque(maxlen=window)
        self._engine_by_context: dict[int | None, deque[float]] = {}
        self._engine_grids: dict[int | None, tuple[float, ...]] = {}
        # where the JCTs of those agents fell in their first ETA's distribution (`tool_levels`)
        self._levels: deque[float] = deque(maxlen=window)

    @property
    def seen(self) -> int:
        return len(self._ratios)

    @property
    def factors(self) -> Factors:
        """The factors of every context's ratios pooled (the prior until `min_seen`)."""
        return self.factors_for(None)

    def factors_for(self, context: int | None, pausing: bool = False) -> Factors:
        """The factors of an agent registering in `context` whose ETA expects pauses, or
        none (`pausing`): the ratios of the agents of its context whose first ETAs were made
        the same way; all its context's where those are fewer than `min_seen`; every
        context's where those are; the prior where all are."""
        key = (context, pausing)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        ratios: deque[float] = self._ratios
        if context is not None:
            for mine in (self._by_kind.get(key), self._all_by_context.get(context)):
                if mine is not None and len(mine) >= self._min_seen:
                    ratios = mine
                    break
        if len(ratios) >= self._min_seen:
            factors = factors_of(sorted(ratios))
        else:
            factors = self._prior_pausing if pausing else self._prior
        self._cache[key] = factors
        return factors

    def scale(self, context: int | None, pausing: bool = False) -> float:
        """The factor the ETA told to an agent registering in `context` is the replay's times."""
        return self.factors_for(context, pausing).scale

    def observe(self, first_eta_s: float, jct_s: float, context: int | None = None, by_context: bool = True,
                pausing: bool = False, large: bool = False, deadline_eta_s: float | None = None) -> None:
        """A finished agent: its JCT against the replay's ETA at its registration (before
        any scaling), and the context it registered in (None: unknown). `by_context` False:
        not in the deadlines' record (`upper_ratio`): an agent that paused, whose JCT holds
        its client's tool time, is no measure of how far the ETAs of agents that do not
        pause fall short (a calibrated deadline is given only to those). Its ETA's scale and
        interval count it: its own ETA expected pauses too. `pausing`: its first ETA
        expected pauses (the scale's record of its kind). `large`: it was large when it
        registered (tight_promise.is_large: the deadlines' record keeps large agents apart).
        `deadline_eta_s`: the replay's ETA its deadline scaled, where that was another (the
        deadlines' record is of that one: the factor must scale the ETA it was learned on)."""
        if not (first_eta_s > 0 and jct_s > 0 and math.isfinite(first_eta_s) and math.isfinite(jct_s)):
            return
        ratio = jct_s / first_eta_s
        self._ratios.append(ratio)
        self._all_by_context.setdefault(context, deque(maxlen=self._window)).append(ratio)
        self._by_kind.setdefault((context, pausing), deque(maxlen=self._window)).append(ratio)
        if by_context:
            if deadline_eta_s is not None and deadline_eta_s > 0 and math.isfinite(deadline_eta_s):
                ratio = jct_s / deadline_eta_s
            self._by_context.setdefault((context, large), deque(maxlen=self._window)).append(ratio)
        self._cache.clear()

    def observe_engine(self, ratio: float, context: int | None = None) -> None:
        """A finished agent whose ETA counted tool time apart: its JCT less the time it
        paused, over its first ETA less the pauses that ETA expected (tool_time.py)."""
        if not (ratio > 0.0 and math.isfinite(ratio)):
            return
        self._engine.append(ratio)
        self._engine_by_context.setdefault(context, deque(maxlen=self._window)).append(ratio)
        self._engine_grids.clear()

    def observe_level(self, level: float) -> None:
        """Where a finished agent's remaining time at registration fell in the distribution
        its first ETA gave it (tool_time.py `level_of`): 0 below every point, 1 above."""
        if 0.0 <= level <= 1.0:
            self._levels.append(level)

    def tool_levels(self) -> tuple[float, float]:
        """The quantiles of an ETA's distribution (tool_time.py) its interval spans: where the
        recent JCTs fell in theirs, at LOW_QUANTILE and HIGH_QUANTILE (split conformal:
        however far the distributions were off, the interval's ends move so that the recent
        JCTs fell inside as often as it aims at); those levels themselves until `min_seen`
        have finished."""
        if len(self._levels) < self._min_seen:
            return LOW_QUANTILE, HIGH_QUANTILE
        levels = sorted(self._levels)
        return _conformal_quantile(levels, LOW_QUANTILE), _conformal_quantile(levels, HIGH_QUANTILE)

    def engine_ratios(self, context: int | None = None) -> tuple[float, ...]:
        """How far the engine part of the ETAs of agents that pause falls short or long,
        as equally likely points: the context's ratios, every context's where those are
        fewer than `min_seen`, the prior (lognormal) where those are."""
        cached = self._engine_grids.get(context)
        if cached is not None:
            return cached
        ratios = self._engine_by_context.get(context)
        if ratios is None or len(ratios) < self._min_seen:
            ratios = self._engine
        if len(ratios) >= self._min_seen:
            grid = quantile_grid(list(ratios))
        else:
            normal = NormalDist()
            grid = tuple(PRIOR_ENGINE_MEDIAN * math.exp(PRIOR_ENGINE_SIGMA * normal.inv_cdf((i + 0.5) / GRID))
                         for i in range(GRID))
        self._engine_grids[context] = grid
        return grid

    def upper_ratio(self, q: float, min_seen: int, context: int | None = None,
                    large: bool = False) -> tuple[float, int] | None:
        """The split-conformal q-quantile of the recent JCT / first-ETA ratios of agents
        registered in `context` of the same size (`large`; those observed without a context
        where fewer than `min_seen` of it have finished), and how many it is of; None: too
        few of either. Contexts are not pooled: a context's ratios say nothing of another's
        tail, nor a typical agent's of a large one's."""
        for key in ((context, large), (None, False)):
            ratios = self._by_context.get(key)
            if ratios is not None and len(ratios) >= min_seen:
                return _conformal_quantile(sorted(ratios), q), len(ratios)
        return None

    def interval(self, elapsed_s: float, eta_s: float, deadline_s: float | None = None,
                 context: int | None = None, scale: float = 1.0, pausing: bool = False) -> tuple[float, float]:
        """[p10, p90] in seconds from the agent's submission: its elapsed time plus its
        remaining time by the replay (`eta_s - elapsed_s`) scaled by its context's factors;
        never without the ETA told (the remaining time times `scale`, the agent's), p90 no
        later than the deadline it was promised when that is later than the ETA told."""
        remaining = max(0.0, eta_s - elapsed_s)
        factors = self.factors_for(context, pausing)
        told = elapsed_s + remaining * scale
        low = min(elapsed_s + remaining * factors.low, told)
        high = elapsed_s + remaining * factors.high
        if deadline_s is not None and deadline_s >= told:
            high = min(high, deadline_s)
        return (low, max(high, told))
