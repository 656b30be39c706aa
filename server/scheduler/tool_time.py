"""The ETA told to an agent that will pause: its time in the engine and its client's tool
time as two uncertain parts, and the point that minimises the expected relative error.

An agent that calls tools between its stages finishes after `T = E + S`: E its time in the
engine (its work and the work served before it), S the sum of its pauses. Both are uncertain
when the ETA is made, in different ways:

- S is drawn by its client, one pause per stage boundary ahead (lognormal tool calls on the
  family's `sessions` shape: median 0.8 s, a tail of 10 s and more). Its distribution is what
  the scheduler has seen (`PauseStats.tool_grid`): the share of recent boundaries that held
  a pause, and the pauses of every type, those under way counted as lasting at least as
  long as they have (`lasting_quantiles`);
- E is the replay's ETA without the pauses, times how far such ETAs fell short or long: the
  ratio (JCT - paused) / (first ETA - the pauses it expected) of the agents told this way
  (`EtaCalibration.engine_ratios`). It is its own record because it is far below the
  ratio of agents that do not pause: the replay serves every agent ordered ahead before
  this one, while the agents ahead that pause are away for much of it (on the tuning seeds
  the median ratio was 0.37 against 0.5-0.7).

Scaling E + mean(S) by one factor, as the ETAs of agents that do not pause are, mixes the
two: a pause's mean is far above its median, and one factor cannot fit agents of one stage
and of five. Here both parts are kept as distributions on small grids of equally likely
points (`GRID`), T's grid is every sum of one point of each, and the ETA told is the T
minimising the mean of |x - T| / T, the median weighted by 1 / T (`eta_interval.
weighted_median`, the rule every ETA's scale follows); the interval is T's quantiles, at
levels recalibrated by where finished agents' JCTs fell in theirs (`level_of`), its high end
the deadline where the pauses seen cannot place it (`PauseStats.tail_unseen`). On the
`sessions` shape the oracle that knows E exactly and S's true distribution reaches a
first-ETA error of 0.29 / 0.60 (p50 / p90, `benchmarks/eta_pause_oracle.py`): no ETA of
this traffic does better.

Pure: callers pass the records.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence

from .eta_interval import GRID, quantile_grid, weighted_median

LASTING_POINTS = 64  # pause lengths kept of the Kaplan-Meier estimate (`lasting_quantiles`)
SUM_EXACT = 16  # boundaries whose draws are summed point by point (`sum_grid`)


def lasting_quantiles(ended: Sequence[float], under_way: Sequence[float],
                      points: int = LASTING_POINTS) -> tuple[float, ...]:
    """`points` equally likely pause lengths, from the pauses that ended (`ended`) and those
    under way (`under_way`: how long each has lasted so far, all that is known of it): the
    Kaplan-Meier estimate. Early in an episode the pauses that have ended are the short ones
    (a long one has not ended yet); counting those under way as "at least this long" keeps
    the estimate from that bias. Where it stops short of a quantile (every pause longer than
    the longest that ended is still under way), the longest length seen stands for it: an
    exponential tail past it, at the rate the pauses seen ended at, covered 2% more of the
    tuning seeds' JCTs and made the ETAs' errors larger (0.33 / 0.75 against 0.31 / 0.72)."""
    if not ended:
        return ()
    # ended before under way at a tie: the usual convention (a pause under way at t has
    # outlasted those that ended at t)
    events = sorted([(x, 0) for x in ended] + [(x, 1) for x in under_way])
    at_risk = len(events)
    surviving = 1.0
    steps: list[tuple[float, float]] = []  # (length, share ended by then)
    for length, censored in events:
        if not censored:
            surviving *= 1.0 - 1.0 / at_risk
            steps.append((length, 1.0 - surviving))
        at_risk -= 1
    longest = events[-1][0]
    out = []
    k = 0
    for i in range(points):
        q = (i + 0.5) / points
        while k < len(steps) and steps[k][1] < q:
            k += 1
        out.append(steps[k][0] if k < len(steps) else longest)
    return tuple(out)


def pause_grid(paused: Sequence[float], share: float, points: int = GRID) -> tuple[float, ...]:
    """One boundary's tool time: no pause with probability 1 - `share`, else one of the
    pauses seen (`paused`, those that lasted)."""
    zeros = round((1.0 - min(max(share, 0.0), 1.0)) * points)
    if not paused:
        zeros = points
    return (0.0,) * zeros + quantile_grid(paused, points - zeros)


def sum_grid(first: Sequence[float], each: Sequence[float], boundaries: int,
             points: int = GRID) -> tuple[float, ...]:
    """The tool time of `boundaries` boundaries: `first`'s draw before the next stage (the
    rest of a pause under way, else a boundary like the others) and `each`'s before every
    later one, drawn independently; kept to `points` values after each sum. Past
    `SUM_EXACT` boundaries the sum of the others is taken as normal (the central limit):
    an agent may declare up to a million stages, and its ETA must not cost a million sums."""
    if boundaries <= 0:
        return (0.0,)
    exact = min(boundaries, SUM_EXACT)
    total = tuple(first)
    for _ in range(exact - 1):
        total = quantile_grid([a + b for a in total for b in each], points)
    rest = boundaries - exact
    if rest > 0 and each:
        mean, spread = statistics.fmean(each), math.sqrt(rest * statistics.pvariance(each))
        normal = statistics.NormalDist(rest * mean, spread) if spread > 0.0 else None
        tail = (tuple(max(0.0, normal.inv_cdf((i + 0.5) / points)) for i in range(points)) if normal is not None
                else (rest * mean,))
        total = quantile_grid([a + b for a in total for b in tail], points)
    return total


def remaining_times(engine_s: float, ratios: Sequence[float], tool: Sequence[float]) -> list[float]:
    """The agent's remaining time T = r x `engine_s` + S, as equally likely points (sorted):
    the replay's engine time off by each of `ratios`, plus each of the tool times `tool`."""
    return sorted(r * engine_s + s for r in ratios for s in tool)


def told_with_tools(times: Sequence[float], low_q: float, high_q: float) -> tuple[float, float, float]:
    """(ETA, interval low, interval high), seconds from now, of an agent whose remaining
    time is distributed as `times` (sorted equally likely points, `remaining_times`): the
    point of least expected relative error, and the `low_q` and `high_q` quantiles."""
    if not times or times[-1] <= 0.0:
        return 0.0, 0.0, 0.0
    # a remaining time of 0 weighs infinitely in a relative error: told 0 if any can be
    told = weighted_median(list(times)) if times[0] > 0.0 else 0.0
    n = len(times)
    low = times[min(n - 1, int(low_q * n))]
    high = times[min(n - 1, int(high_q * n))]
    return told, min(low, told), max(high, told)


def level_of(times: Sequence[float], x: float) -> float:
    """Where `x` falls in the distribution `times` (sorted equally likely points): the share
    below it, ties counted half (the probability integral transform the interval's levels
    are recalibrated by: `EtaCalibration.tool_levels`)."""
    below = bisect.bisect_left(times, x)
    ties = bisect.bisect_right(times, x) - below
    return (below + 0.5 * ties) / len(times) if times else 0.5
