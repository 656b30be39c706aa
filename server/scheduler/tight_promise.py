"""The deadline promised at registration: as tight as the ETAs' own record allows.

The worst-case deadline (`Promises.promise`: the GPS finish with the most work the measured
arrivals can bring ahead, at the pessimistic rate, plus the delay bound) holds whatever the
order of arrivals, but on the family of arrival shapes it was 15-25 times the JCT: it tells
a user almost nothing. The deadline given is the tighter of that and

    now + factor x (ETA - now)     (x the prediction's p90 over the prediction, if uncertain)

where `factor` is how far first ETAs have fallen short *in the agent's context and among
agents of its size*: the largest ratio JCT / first ETA of the agents finished recently that
registered in the same context and were as large (`EtaCalibration`, the record the
intervals are set by; split conformal prediction by context, Mondrian), never below the
context's floor, which is also a fresh server's.

The context is the agent's place in the queue when it registers: the work the policy orders
ahead of it over its own work (`CONTEXT_EDGES`). An agent at the head of the queue is told
its time alone, and whatever arrives while it runs is all error; an agent deep in the queue
is told the known work ahead of it, which the arrivals change much less. The size is
whether the agent is large (`is_large`): its cost at least twice the median of the recent
arrivals' (it runs long, and a burst that arrives meanwhile goes ahead of it). A long
prompt alone does not make it large: its ETA counts the wait for the running requests to
free what its first stage's largest request needs (`EtaEstimator.request_need`), the wait
admission imposes (it is non-preemptive). On the family's tuning seeds (0-4, fresh and
taught servers, every shape, three engine profiles) the JCT of a large agent at the head
reached 5.25 times its ETA, of any other agent 2.11 times: one factor for both made every
deadline as loose as the large agents'.
The floors are the largest ratio seen in each cell among the agents a calibrated deadline
is given to, rounded up to a half, never below a deeper context's nor, for a large agent,
below a typical one's (`CONTEXT_FLOORS`, `LARGE_CONTEXT_FLOORS`), but for a large agent with
1-2x its own work ahead, whose deadline the densest burst seen (below) now holds: its floor
is chosen with that in place. Held-out figures in docs/concepts.md.

A calibrated deadline is never earlier than the agent's fair-share finish with the arrivals
its ETA expects (`fair_share_s`): an ETA inside it counts on the policy serving the agent
ahead of its fair share, which the delay bound does not promise.

Nor, for a large agent, earlier than its fair-share finish were the work arriving ahead of it
as dense as the densest stretch of the same length the server has seen (`densest_finish_s`:
the least F with F = fluid + what the history's densest F seconds brought ahead / R, the
empirical arrival curve of network calculus). The rate an ETA counts is an episode's mean,
which averages bursts with lulls; a large agent lives long enough for a burst to come, and
all of a burst of smaller agents goes ahead of it. A typical agent is not held to it: it
lives too short a time for a burst to change much, and were every agent held to it, the
members whose median deadline is at most 4x their JCT (the family's `deadline_over_jct_p50`,
tuning seeds 0-19 on six profiles) would fall from 705 to 414 of 1,200 (large agents alone:
674, then 714 with the floors below). But for the first agents of a burst within an episode
(`at_burst_head`: among the first BURST_HEAD after a gap far longer than the episode's
typical one, eta.py `WorkArrivals.burst_rank`): a lull the server did not drain across ends
no episode, and the agents registering as the next burst begins are told the episode's mean
rate, which the lull has diluted, while the whole burst is about to arrive.

Tool time is not calibrated this way: an agent that may pause between its stages (agents
have paused at recent stage boundaries, or none has been crossed lately) keeps the worst case. The
worst case stays reported beside it (`delay_bound_s`), and the record's `promise_assumes`
says what the calibrated deadline rests on: traffic ahead like the traffic behind, arrivals
no faster than measured.

Pure: no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from .eta_interval import EtaCalibration

# Contexts: the work ahead of an agent over its own, at registration, below 1 (at the head),
# 1-2, 2-3, and 3 or more (deep in the queue).
CONTEXT_EDGES = (1.0, 2.0, 3.0)
# The largest JCT / first ETA per context on the tuning seeds among the typical agents a
# calibrated deadline is given to (2.11, 1.45, 1.52 and 2.07 over the built-in profile and
# two calibrated on this machine; the members' agents of fresh and taught servers; not those whose
# deadline is the worst case whatever the factor: registered before the rate was measured, a
# guessed cost, pauses possible), rounded up to a half, none below a deeper context's: each
# context's factor on a fresh server and the least any calibration gives it.
CONTEXT_FLOORS = (2.5, 2.5, 2.5, 2.5)
# ... of a large agent: one whose cost is at least LARGE_COST times the median cost of the
# recent arrivals (it runs long, and work arriving faster than measured meanwhile goes ahead
# of it)
LARGE_COST = 2.0
# The same among the large agents (5.25 and 4.78 at the head and with 1-2x its work ahead
# on seeds 0-4: 5.5 and 5.0), none below a typical agent's, until `densest_finish_s` held
# their deadlines too; then, on the tuning seeds (0-19, six profiles, half steps), the floors
# that break the fewest promises while leaving at least as many members' median deadline at
# most 4x their JCT (`deadline_over_jct_p50`) as before (705 of 1,200): 58 of 69,120 broken
# (82 before), 714 members. Chosen again by the same rule once an episode ended where the
# server drained (eta.py `WorkArrivals`), whose ETAs expect the rest of a typical burst
# (4.5-7 and 2.5-4, half steps; before, 737 members): 34 broken (35 with the old floors,
# 54 before the change), 739 members. Chosen again once the first agents of a burst were
# held to the densest stretch (`at_burst_head`; 4.5-7 and 2.5-4, half steps): 26 broken (24
# with the old floors), 740 members (714 with the old floors).
LARGE_CONTEXT_FLOORS = (5.0, 3.0, 2.5, 2.5)
# The first agents of a burst within an episode held to the densest stretch seen (as large
# agents are): the first BURST_HEAD from its start. On the tuning seeds (0-19, six profiles,
# the floors as they were: 34 broken, 739 members at most 4x), the first 3, 6 or 10 after a
# gap of 10x the median: 31, 24, 24 broken, 720, 707, 696 members; the first 6 after 20x:
# 24 broken, 714 members, and the floors chosen again above.
BURST_HEAD = 6
MAX_SHARE = 0.99  # of the rate to arrivals, in `fair_share_s` (callers cap it lower)
PROMISE_QUANTILE = 1.0  # of the recent JCT / first-ETA ratios: the largest
MIN_SEEN = 10


def context_of(work_ahead: float, own_work: float) -> int:
    """The agent's context: how many times its own work the policy orders ahead of it."""
    if own_work <= 0.0:
        return 0 if work_ahead <= 0.0 else len(CONTEXT_EDGES)
    return bisect.bisect_right(CONTEXT_EDGES, work_ahead / own_work)


def is_large(cost: float, median_cost: float | None) -> bool:
    """Whether an agent of `cost` is large for the mix arriving (its median cost; None: no
    arrival measured)."""
    return median_cost is not None and median_cost > 0.0 and cost >= LARGE_COST * median_cost


def at_burst_head(rank: int | None) -> bool:
    """Whether an agent registering `rank` arrivals into a burst (eta.py
    `WorkArrivals.burst_rank`; None: no burst lately) is among its first."""
    return rank is not None and rank < BURST_HEAD


def floor_of(context: int, large: bool = False) -> float:
    """The least factor an agent's deadline allows in its context, and a fresh server's."""
    return (LARGE_CONTEXT_FLOORS if large else CONTEXT_FLOORS)[context]


def promise_record(calibration: EtaCalibration, context: int = 0, large: bool = False) -> tuple[float | None, int]:
    """The record an agent's deadline factor rests on beside its context's floor: the
    calibrated upper quantile of the JCT / first-ETA ratios of its context, among agents of
    its size, and how many finished agents that is of ((None, 0): too few)."""
    upper = calibration.upper_ratio(PROMISE_QUANTILE, MIN_SEEN, context, large)
    return (None, 0) if upper is None else upper


@dataclass(frozen=True)
class PromiseParts:
    """What the deadline given at registration is made of, in seconds from then: the
    tighter of the worst case and, where calibrated, the ETA (`eta_s`: the replay's engine
    time, times the prediction's p90 over the prediction) scaled by the larger of the
    context's floor and its record's largest ratio, never earlier than the fair share.
    Plain data, kept with the agent, so that how another floor would have promised is a
    computation, not another run (benchmarks/promise_tradeoff.py)."""

    worst_s: float
    eta_s: float
    fair_share_s: float
    floor: float
    record: float | None  # the record's largest JCT / first ETA (None: fewer than MIN_SEEN)
    calibrated: bool  # False: the worst case alone (guessed costs, an uncertain rate, pauses ahead)
    context: int
    large: bool

    @property
    def factor(self) -> float:
        return self.floor if self.record is None else max(self.floor, self.record)

    def tight_s(self, floor: float | None = None) -> float:
        """The calibrated deadline (the worst case where none is given), with `floor` in place
        of the context's where given."""
        if not self.calibrated:
            return self.worst_s
        factor = self.factor if floor is None else max(floor, self.record or 0.0)
        return max(factor * self.eta_s, self.fair_share_s)

    def deadline_s(self, floor: float | None = None) -> float:
        """The deadline these parts give: the tighter of the worst case and `tight_s`."""
        return min(self.worst_s, self.tight_s(floor))


def fair_share_s(fluid_s: float, share: float, span_s: float) -> float:
    """Seconds to an agent's fair-share finish: `fluid_s` of GPS service at the measured
    rate, while work arriving ahead of it takes `share` of the rate for `span_s` (the span
    the ETA expects arrivals over), then none."""
    share = min(max(share, 0.0), MAX_SHARE)
    stretched = fluid_s / (1.0 - share)
    return stretched if stretched <= span_s else fluid_s + share * span_s


# The window lengths the arrival curve is read at: a geometric grid, each 2^(1/4) the last
# (a window rounded up to it reads no less work than the exact one).
CURVE_GRID = 2.0 ** 0.25


def densest_finish_s(fluid_s: float, peak_ahead: Callable[[float], float], rate: float) -> float:
    """Seconds to an agent's fair-share finish F were the work arriving ahead of it the most
    the history has brought in any F seconds: the least F >= fluid + peak_ahead(F) / rate
    (`fluid_s`: its GPS finish with no arrivals; `peak_ahead(w)`: the most work a window of
    w seconds brought ahead of it; `rate`: the engine's). Found by iterating from `fluid_s`
    (F only grows), each window rounded up on CURVE_GRID. Where no fixed point is met
    within the iterations (arrivals as dense as the engine), the last F."""
    if rate <= 0.0 or fluid_s <= 0.0:
        return max(0.0, fluid_s)
    finish = fluid_s
    for _ in range(64):
        # (less a hair: a finish on the grid reads its own window, not the next)
        window = CURVE_GRID ** math.ceil(math.log(max(finish, 1e-3), CURVE_GRID) - 1e-9)
        finish = max(finish, fluid_s + peak_ahead(window) / rate)
        if finish <= window:
            return finish
    return finish


def assumption(factor: float, seen: int, arrival_rate: float, context: int, iteration_s: float,
               large: bool = False) -> str:
    """What a calibrated deadline rests on, in the record's words: the record of ETAs behind
    its factor, the arrivals, and the engine's speed (a host slower than when the deadline
    was given makes every step longer than the ETA counted)."""
    place = ("a large " if large else "an ") + f"agent {_context_words(context)}"
    basis = (f"the largest JCT / first ETA of the last {seen} agents finished, at least "
             f"{floor_of(context, large):g} for {place}" if seen >= MIN_SEEN
             else f"a fresh server's prior for {place}")
    return (f"deadline = {factor:.2g} x the ETA ({basis}); holds while work arrives no faster than measured "
            f"({arrival_rate:.4g} units/s), the engine keeps the speed measured (tau = {1000 * iteration_s:.3g} ms "
            f"per iteration) and the traffic ahead is like the traffic behind; "
            f"without those assumptions: fair_finish_s + delay_bound_s")


def _context_words(context: int) -> str:
    if context == 0:
        return f"with less than {CONTEXT_EDGES[0]:g}x its own work ahead"
    if context == len(CONTEXT_EDGES):
        return f"with {CONTEXT_EDGES[-1]:g}x its own work or more ahead"
    return f"with {CONTEXT_EDGES[context - 1]:g}-{CONTEXT_EDGES[context]:g}x its own work ahead"
