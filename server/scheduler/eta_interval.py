"""ETA intervals: [p10, p90] around an ETA, calibrated on the agents that have finished.

An ETA is a forecast from what the scheduler knows when it is made; its error comes from
what it cannot know (work that arrives later, costs that differ from their prediction, an
engine that speeds up or slows down). Rather than model each source, the interval is set by
how wrong the forecasts have been (split conformal prediction): every finished agent leaves
the ratio JCT / first ETA; an agent's interval is its remaining time scaled by the 10th and
90th percentiles of the last `window` ratios. Whatever the traffic, about 80% of agents then
finish inside their first interval, provided the traffic ahead looks like the traffic
behind (the record's promise says so when it does not).

Until `min_seen` agents have finished, the interval takes prior factors, chosen on the
tuning seeds of the evaluation family (`bench family --seeds 0-4`) and reported on held-out
ones (docs/concepts.md, ETA intervals).

Pure: no clock; the dispatcher asks with `now`-relative numbers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Prior factors (JCT / first ETA) of a fresh server: the 10th and 90th percentiles of the
# ratio over the tuning seeds 0-4 of every shape of the family (cpu-tiny, M = 4096, 48
# agents at load 0.9): docs/concepts.md, ETA intervals.
PRIOR_LOW = 0.6
PRIOR_HIGH = 1.4
# The quantiles of the ratio the interval spans. Nominally [p10, p90]; at 0.1 / 0.9 the
# tuning seeds covered 75-81% (the window's ratios drift as a run goes on), so the ends are
# taken a little further out, 0.075 / 0.925, to aim at the middle of 75-95%.
LOW_QUANTILE = 0.075
HIGH_QUANTILE = 0.925
# Finished agents the calibration uses (the most recent); fewer than MIN_SEEN: the prior.
WINDOW = 200
MIN_SEEN = 10


@dataclass(frozen=True)
class Factors:
    low: float
    high: float


def _conformal_quantile(sorted_ratios: list[float], q: float) -> float:
    """The split-conformal quantile: the ceil((n + 1) q)-th smallest of n (clipped)."""
    n = len(sorted_ratios)
    k = min(n, max(1, math.ceil((n + 1) * q)))
    return sorted_ratios[k - 1]


class EtaCalibration:
    """JCT / first-ETA ratios of finished agents, and the interval factors they give."""

    def __init__(self, window: int = WINDOW, min_seen: int = MIN_SEEN,
                 prior: Factors = Factors(PRIOR_LOW, PRIOR_HIGH)) -> None:
        self._window = window
        self._ratios: deque[float] = deque(maxlen=window)
        # the same ratios by the context the agent registered in (tight_promise.py; None:
        # observed without one)
        self._by_context: dict[int | None, deque[float]] = {}
        self._min_seen = min_seen
        self._prior = prior
        self._factors = prior

    @property
    def seen(self) -> int:
        return len(self._ratios)

    @property
    def factors(self) -> Factors:
        return self._factors

    def observe(self, first_eta_s: float, jct_s: float, context: int | None = None, by_context: bool = True) -> None:
        """A finished agent: its JCT against the ETA it was given at registration, and the
        context it registered in (None: unknown). `by_context` False: the intervals' record
        only, not the context's (`upper_ratio`, which deadlines are scaled by): an agent that
        paused, whose JCT holds its client's tool time, is no measure of how far the ETAs of
        agents that do not pause fall short (a calibrated deadline is given only to those)."""
        if not (first_eta_s > 0 and jct_s > 0 and math.isfinite(first_eta_s) and math.isfinite(jct_s)):
            return
        self._ratios.append(jct_s / first_eta_s)
        if by_context:
            self._by_context.setdefault(context, deque(maxlen=self._window)).append(jct_s / first_eta_s)
        if len(self._ratios) >= self._min_seen:
            ordered = sorted(self._ratios)
            # The lower end of a fresh calibration stays below 1 and the upper above it:
            # a handful of agents that all beat (or all missed) their ETA is no proof that
            # the next will.
            self._factors = Factors(min(_conformal_quantile(ordered, LOW_QUANTILE), 1.0),
                                    max(_conformal_quantile(ordered, HIGH_QUANTILE), 1.0))

    def upper_ratio(self, q: float, min_seen: int, context: int | None = None) -> tuple[float, int] | None:
        """The split-conformal q-quantile of the recent JCT / first-ETA ratios of agents
        registered in `context` (those observed without a context where fewer than
        `min_seen` of it have finished), and how many it is of; None: too few of either.
        Contexts are not pooled: a context's ratios say nothing of another's tail."""
        for key in (context, None):
            ratios = self._by_context.get(key)
            if ratios is not None and len(ratios) >= min_seen:
                return _conformal_quantile(sorted(ratios), q), len(ratios)
        return None

    def interval(self, elapsed_s: float, eta_s: float, deadline_s: float | None = None) -> tuple[float, float]:
        """[p10, p90] in seconds from the agent's submission: its elapsed time plus its
        remaining time (`eta_s - elapsed_s`) scaled by the factors; p90 no later than the
        deadline it was promised when that is later than the ETA."""
        remaining = max(0.0, eta_s - elapsed_s)
        low = elapsed_s + remaining * self._factors.low
        high = elapsed_s + remaining * self._factors.high
        if deadline_s is not None and deadline_s >= eta_s:
            high = min(high, deadline_s)
        return (low, max(high, eta_s))
