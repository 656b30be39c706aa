"""ETAs by forward replay, and the arrival allowance of ETAs and deadlines.

An agent's ETA is what the running policy will do with what is known now. `replay` walks the
agents once in the policy's order (one sort: O(N log N) for N agents) and, for each, adds up
the remaining work of the agents served before it:

    start_j = W_<j / R_j                      work ordered before j, at the rate left to it
    eta_j   = now + max((W_<j + w_j) / R_j,   all of it, served at full memory
                        start_j + cp_j)       then j's own remaining critical path
    start_j >= wait                           not before a request's memory is free,
    start_j >= held                           nor before the agents ahead waiting for theirs

where w_j is j's remaining charged work (charged minus consumed, policy cost units; with a
time model, its declared prefill added at the engine's time: `Dispatcher._replay_rates`), cp_j the
time of its remaining critical path (its declared shape, `AgentShape`, else the longest
decode of its known requests) at the time model's iteration time, and R_j = R - a_j: the
engine's rate R (`Dispatcher.eta_rate`: M / tau, or the time model's rate on the mix where
that is faster) minus the rate a_j of work that will arrive *ahead of j* while it waits (new
agents the policy orders before j: under justitia, those whose cost is below j's tag minus
V, less half of what V advances over the arrivals' span, `closing_gap`; none under fcfs),
for as long as the episode's arrivals have been measured (at least 2 s, at most the 600 s
long window), at the rate of the last 60 s: then at full rate again (`served_by`). A stream
that has lasted ten minutes is expected to last the wait of an agent deep in its queue:
capped at the 60 s the rate is measured over, the ETAs of the 300-agent mix's large agents
deep in the queue at 2-3x density fell short by up to 3.7x (they wait hundreds of seconds,
and arrivals go ahead of them throughout); capped at the long window, by up to 2.9x, with
the family of shapes unchanged (its episodes last under a minute).
An agent with no request in the engine starts no sooner than the running requests free the
memory one of its requests reserves (`MemoryDrain`): first in the order, it still waits for
them, since admission never preempts. Nor sooner than the agents ordered before it that wait
for memory (`held`): admission in strict order stops at the first request that does not fit,
so a small request behind it waits too (`EtaPass.blocked_until`; none with backfill).
The arrival rate of work and its cost distribution are measured over the recent
registrations (`WorkArrivals`).

The pass keeps its sorted keys and prefix sums, so the ETA of an agent registered since (or
a view between two passes) is one binary search: O(log N). `Dispatcher.refresh_etas(now)`
runs the pass; the live server calls it from its housekeeping loop, the simulator every
quarter second of simulated time; views read the cached value. Nothing here reads a clock.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from .declared import BatchDeclaration, DeclaredBatches

# No more than this share of the engine is assumed to go to work arriving ahead of an agent:
# beyond it the long-run load exceeds the rate, no finite promise holds, and deadlines say so.
MAX_ARRIVAL_SHARE = 0.9
PROMISE_MIN_SPAN_S = 2.0
LULL_RATIO = 4.0  # the server empty this many times an episode's length ends it (WorkArrivals)
EPISODES_KEPT = 8  # the episodes of arrivals a server remembers (WorkArrivals)
# A burst within an episode (`WorkArrivals.burst_rank`): an arrival after a gap at least
# BURST_GAP_RATIO times the median gap of the episode's last BURST_GAPS_KEPT arrivals, and at
# least BURST_MIN_GAP_S, once BURST_MIN_GAPS gaps have been measured. The ratio was chosen
# on the family's tuning seeds (10 or 20, tight_promise.py `BURST_HEAD`); four gaps and
# eight broke as many tuning promises, and four tells a burst after a short first one (the
# held-out seeds' figures: docs/concepts.md). The 0.5 s and the 64 were not tuned: a batch
# registered at once has gaps of 0, and any later registration is 20 times that.
BURST_GAP_RATIO = 20.0
BURST_MIN_GAP_S = 0.5
BURST_MIN_GAPS = 4
BURST_GAPS_KEPT = 64


class IterationTimeModel(Protocol):
    """The engine's iteration time as a function of the batch, named `iteration_s`
    (the simulator's EngineProfile): plain data, no clock."""

    def iteration_s(self, batch: int, prefill_tokens: int, kv_tokens: int) -> float:
        ...


class StepTimeModel(Protocol):
    """The same function named `step_s` (the server's fitted `time_model.TimeModel`)."""

    def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
        ...


# What the dispatcher accepts as its time model: either spelling of one engine step's time
# (`time_model.TimeModel`, the fitted model, is one of them).
StepTimeSource = IterationTimeModel | StepTimeModel
StepFunction = Callable[[int, int, int], float]  # (batch, prefill tokens, KV tokens) -> seconds


def step_function(model: StepTimeSource) -> StepFunction:
    """The model's step-time function, whichever name it has (iteration_s wins when a model
    has both: they are the same form)."""
    iteration_s = getattr(model, "iteration_s", None)
    if callable(iteration_s):
        return cast(StepFunction, iteration_s)
    # not an IterationTimeModel, so the union leaves the step_s one
    return cast(StepTimeModel, model).step_s


def chunked_function(model: StepTimeSource | None) -> Callable[[float], float] | None:
    """The model's extra for a prompt past the engine's step budget (`chunked_prefill_s`:
    seconds for a prompt of p tokens computed), None where it models none."""
    chunked = getattr(model, "chunked_prefill_s", None)
    if not callable(chunked) or getattr(model, "per_chunked_prefill_s", 0.0) <= 0.0 \
            or getattr(model, "prefill_chunk_tokens", 0) <= 0:
        return None
    return cast(Callable[[float], float], chunked)


@dataclass
class WorkArrivals:
    """Agents registered recently: the arrival rate of work and its cost distribution
    (policy cost units). ETAs use the rate over the last `window_s` (current conditions);
    promises the larger of that and the rate over `long_window_s` (a deadline looks further
    ahead than one burst or lull)."""

    window_s: float = 60.0
    long_window_s: float = 600.0
    max_samples: int = 4096
    # An ETA's rate over less history than this is noise. Shorter than a burst: over a
    # longer floor, the rate of a short burst reads as a fraction of itself while the burst
    # goes on, and its agents' ETAs come out short (docs/benchmarks.md compares the floors).
    min_window_s: float = PROMISE_MIN_SPAN_S
    # An episode is measured from its own start, as a fresh server measures its first one
    # (over the whole window, a burst after a lull would read as a sliver of itself). A
    # registration after a whole window without any begins one. So does a registration that
    # finds the server empty (every agent before it finished: a busy period ended) and
    # empty for LULL_RATIO times the episode's length, at least `min_window_s`: two bursts
    # the server drained between are two episodes, and the next burst's first agents expect
    # the rest of a typical one. While agents are in the system, a gap is traffic, not a
    # lull: the batches of a backlogged stream are one stream, whose work arrives throughout
    # the long waits of the agents deep in its queue; and agents submitted one after
    # another as the last one ends are one application's.
    _events: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)  # (t, cost)
    _origin: float | None = None  # the first arrival ever: the long window's history
    _first: float | None = None  # the first arrival of the current episode
    _last: float | None = None
    _episode_cost: float = 0.0  # work registered in the current episode
    _opening: bool = False  # an episode opened (`open_episode`) before its first arrival's work
    # the last episodes before it: (work, seconds from their first to their last arrival)
    _episodes: collections.deque[tuple[float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=EPISODES_KEPT))
    # the sorted sample and its prefix sums, rebuilt by `freeze` (once per refresh)
    _costs: list[float] = field(default_factory=list)
    _prefix: list[float] = field(default_factory=list)
    # the same events by time and their prefix sums, and the arrival curve read from them
    # (`peak_work`), built at the first ask after each `freeze`
    _times: list[float] | None = None
    _time_prefix: list[float] = field(default_factory=list)
    _peaks: dict[float, float] = field(default_factory=dict)
    # batches their clients declared, and the engine's rate their held-back work arrives at
    declared: DeclaredBatches = field(default_factory=DeclaredBatches)
    service_rate: float = 0.0
    rate: float = 0.0  # cost units arriving per second, recent window
    span_s: float = 0.0  # the episode's age, 2 s to the long window (ETAs assume `rate` goes on this long)
    promise_rate: float = 0.0  # max(rate, the long window's)

    def open_episode(self, t: float, idle_since: float | None = None) -> bool:
        """An arrival at `t` that begins an episode (after a lull) begins it now: the last
        episode is closed and this one measured from its start (`freeze`), so that the agent
        arriving is promised with the episode's forecast, as the agents after it are, not
        with what the last refresh measured of the lull. `idle_since`: the arrival found no
        other agent in the system, none since then (None: it found some, or it is not known).
        Nothing where `t` continues the current episode (idempotent: `add` calls it too).
        Returns whether it began one."""
        if self.window_s <= 0 or self._last is None:
            return False
        if t - self._last <= self.window_s and (idle_since is None or t - idle_since <= self._idle_lull_s()):
            return False
        if self._first is not None:
            self._episodes.append((self._episode_cost, self._last - self._first))
        self._first, self._last, self._episode_cost = t, t, 0.0
        self._opening = True  # measured again with its first arrival's work (`add`)
        # what the last refresh measured is of the last episode: measure this one now
        self.freeze(t)
        return True

    def add(self, t: float, cost: float) -> None:
        if self.window_s <= 0:  # allowance switched off
            return
        if self._origin is None:
            self._origin = t
        # a new episode after an earlier one (here, or by the registration just before)
        begun = self.open_episode(t) or self._opening
        self._opening = False
        if self._first is None:
            self._first, self._episode_cost = t, 0.0
        self._last = t if self._last is None else max(t, self._last)
        self._episode_cost += cost
        self._events.append((t, cost))
        if len(self._events) > self.max_samples:
            self._events.popleft()
        if begun:  # measured with its first arrival's work
            self.freeze(t)

    def declare(self, t: float, cost: float, batch: BatchDeclaration, service_rate: float) -> bool:
        """The agent just added at `t` (its cost `cost`) belongs to a batch its client
        declared (`DeclaredBatches`). The batch's 1st, 2nd, 4th, 8th ... registration
        forecasts its rest at once (a refresh's `freeze`, O(log N) of them a batch), so that
        its first agents' ETAs expect it with a sample of its costs, not only the ETAs given
        after the next refresh. Returns whether it did (the agent's ETA is then to be read
        again)."""
        if self.window_s <= 0:
            return False
        n = self.declared.add(t, cost, batch.batch_id, batch.size, batch.index)
        self.service_rate = service_rate
        if n & (n - 1) or self.declared.held_back(t) <= 0.0:
            return False
        self.freeze(t)
        return True

    def _idle_lull_s(self) -> float:
        """A time the server sat empty that ends the current episode: LULL_RATIO times the
        episode's length, at least `min_window_s`, at most the window."""
        length = 0.0 if self._first is None or self._last is None else self._last - self._first
        return min(self.window_s, max(self.min_window_s, LULL_RATIO * length))

    def _rate(self, now: float, window: float, min_span: float, since: float | None) -> float:
        """Work arrived since max(now - window, since) over that span (at least min_span)."""
        start = now - window if since is None else max(now - window, since)
        # the long window holds every event kept (freeze dropped the older ones)
        total = sum(c for t, c in reversed(self._events) if t >= start) if window < self.long_window_s \
            else self._prefix[-1]
        span = min(window, max(min_span, now - since)) if since is not None else window
        if len(self._events) == self.max_samples:  # a full sample covers less than the window
            span = min(span, max(min_span, now - self._events[0][0]))
        return total / span

    def freeze(self, now: float, service_rate: float | None = None) -> None:
        """Drop events older than the long window; sort the rest (O(K log K), K events).
        `service_rate`: the engine's rate of work now (cost units a second), which work
        held back by declared batches arrives at."""
        if service_rate is not None:
            self.service_rate = service_rate
        while self._events and self._events[0][0] < now - self.long_window_s:
            self._events.popleft()
        self._costs = sorted(c for _, c in self._events)
        self._prefix = list(itertools.accumulate(self._costs, initial=0.0))
        self._times, self._peaks = None, {}
        if not self._events:
            self.rate = self.promise_rate = 0.0
            return
        self.rate = self._rate(now, self.window_s, self.min_window_s, self._first)
        first = now if self._first is None else self._first
        self.span_s = max(self.min_window_s, min(self.long_window_s, now - first))
        self._forecast_from_episodes(now - first)
        self._forecast_from_batches(now)
        # A promise takes the rate over the history there is (a floor of 10 s would halve
        # the rate of a stream 5 s old and promise too early): pessimistic, not smooth; and
        # over the long window too, where an ETA takes the recent one.
        self.promise_rate = max(self._rate(now, self.window_s, PROMISE_MIN_SPAN_S, self._first),
                                self._rate(now, self.long_window_s, PROMISE_MIN_SPAN_S, self._origin))

    def _forecast_from_episodes(self, age: float) -> None:
        """An episode younger than the typical one of those before it is expected to bring
        their typical work (median) over their typical length: a server that has seen bursts
        of 48 agents expects the rest of the next one, where the measured rate only projects
        what has come so far. Kept only where it expects more than the measured rate does.
        An episode no older than the typical one's length still expects its rest: batches
        submitted at once (episodes of one instant) expect theirs at their first arrival."""
        if not self._episodes:
            return
        work = statistics.median(w for w, _ in self._episodes)
        length = statistics.median(d for _, d in self._episodes)
        if self.service_rate > 0.0 and work <= self.service_rate * length:
            # Episodes that arrived no faster than the engine serves were streams: the rate
            # measured now projects one as well as they do, and their length (a whole
            # stream's) would project it far ahead. Only a burst's rest is unforeseen.
            return
        left = work - self._episode_cost
        if left <= 0.0 or age > length:
            return
        span = max(self.min_window_s, length - age)
        if left > self.rate * self.span_s:
            self.rate, self.span_s = left / span, span

    def _forecast_from_batches(self, now: float) -> None:
        """Work declared batches hold back arrives as the engine serves them (a slot frees
        as an agent ends): at the engine's rate, until it has all arrived. Kept only where
        it expects more than the measured rate (or the episodes) do."""
        left = self.declared.held_back(now)
        if left <= 0.0 or self.service_rate <= 0.0:
            return
        span = max(self.min_window_s, left / self.service_rate)
        if left > self.rate * self.span_s:
            self.rate, self.span_s = left / span, span

    @property
    def episodes(self) -> int:
        """Episodes of arrivals remembered before the current one (at most EPISODES_KEPT)."""
        return len(self._episodes)

    def episode_start(self, t: float) -> float | None:
        """When the episode of an agent registered at `t` began: `t` itself where an
        arrival then begins one (after a lull), else the current episode's first arrival
        (None: no arrival yet)."""
        if self._last is None:
            return None
        return t if t - self._last > self.window_s else self._first

    def history_s(self, now: float) -> float | None:
        """How long the current episode's arrivals have been measured for (None: none
        arrived yet)."""
        return None if self._first is None else max(0.0, now - self._first)

    def median_cost(self) -> float | None:
        """The median cost of the recent arrivals (as of the last `freeze`; None: none)."""
        if not self._costs:
            return None
        return self._costs[len(self._costs) // 2]

    def expected_agents(self) -> float:
        """Agents the measured rate brings over its span, at the recent mean cost (as of the
        last `freeze`)."""
        if not self._costs or self._prefix[-1] <= 0:
            return 0.0
        return self.rate * self.span_s * len(self._costs) / self._prefix[-1]

    def ahead(self, gap: float) -> float:
        """Rate of arriving work from agents of cost below `gap` (they go entirely ahead)."""
        if not self._costs or gap <= 0 or self._prefix[-1] <= 0:
            return 0.0
        k = bisect.bisect_left(self._costs, gap)
        return self.rate * self._prefix[k] / self._prefix[-1]

    def fluid_ahead(self, gap: float) -> float:
        """Rate of arriving work GPS serves before V advances `gap` (min(cost, gap) of each),
        at the promise rate."""
        return self.promise_rate * self.share_ahead(gap)

    def burst_rank(self, t: float) -> int | None:
        """How many of the episode's arrivals came since its last burst began, for one
        arriving at `t` (0: it begins one); None where none of the episode's last arrivals
        began one. A burst begins with an arrival after a gap far longer than the episode's
        typical gap (`BURST_GAP_RATIO` times their median): a lull the server did not drain
        across, which ends no episode (its agents are still in the system) and which the
        episode's rate averages with the burst after it."""
        if self._first is None:
            return None
        times = [t]
        for when, _ in reversed(self._events):
            if when < self._first or len(times) > BURST_GAPS_KEPT:
                break
            times.append(when)
        gaps = [later - earlier for later, earlier in itertools.pairwise(times)]  # newest first
        if len(gaps) < BURST_MIN_GAPS:
            return None
        threshold = max(BURST_MIN_GAP_S, BURST_GAP_RATIO * statistics.median_high(gaps))
        return next((rank for rank, gap in enumerate(gaps) if gap >= threshold), None)

    def share_ahead(self, gap: float) -> float:
        """The share of the arriving work GPS serves before V advances `gap`: min(cost, gap)
        of each recent arrival over their costs."""
        if not self._costs or gap <= 0 or self._prefix[-1] <= 0:
            return 0.0
        k = bisect.bisect_left(self._costs, gap)
        return (self._prefix[k] + gap * (len(self._costs) - k)) / self._prefix[-1]

    def peak_work(self, window_s: float) -> float:
        """The most work registered within any `window_s` seconds of the history kept (the
        long window): the empirical arrival curve, what the densest stretch of that length
        has brought. A rate measured over an episode averages its bursts with its lulls;
        this is the burst. O(K) for K events the first time a length is asked after a
        `freeze`, then cached."""
        peak = self._peaks.get(window_s)
        if peak is not None:
            return peak
        if self._times is None:
            ordered = sorted(self._events)  # appended in time order but for a late clock
            self._times = [t for t, _ in ordered]
            self._time_prefix = list(itertools.accumulate((c for _, c in ordered), initial=0.0))
        times, prefix = self._times, self._time_prefix
        peak, end = 0.0, 0
        for i, start in enumerate(times):  # every window that opens with an arrival
            end = max(end, i)
            while end < len(times) and times[end] <= start + window_s:
                end += 1
            peak = max(peak, prefix[end] - prefix[i])
        self._peaks[window_s] = peak
        return peak


@dataclass
class EtaPass:
    """One replay: the policy order's keys and the work ahead of each position."""

    now: float
    rate: float  # R, cost units per second
    keys: list[Any] = field(default_factory=list)  # sorted policy keys
    prefix: list[float] = field(default_factory=lambda: [0.0])  # remaining work before index i
    # when the agents before index i can all have started (absolute time; `blocked_until`)
    blocked: list[float] = field(default_factory=lambda: [float("-inf")])

    def work_before(self, key: Any) -> float:
        """Remaining work of the agents ordered before `key` (O(log N))."""
        return self.prefix[bisect.bisect_left(self.keys, key)]

    def blocked_until(self, key: Any) -> float:
        """When the agents ordered before `key` that wait for memory can all have started:
        admission in strict order starts none after them sooner (O(log N))."""
        return self.blocked[bisect.bisect_left(self.keys, key)]


def served_by(work: float, rate: float, arriving: float, span_s: float) -> float:
    """Seconds until `work` is served at `rate` while work arriving ahead at `arriving`
    per second for at most `span_s` more seconds takes its share first.

    Arrivals are assumed to go on for as long as they have been measured (`span_s`), not
    forever: the rate of a burst, projected without end, would make the ETAs of its last
    agents many times their JCTs."""
    r = rate - min(arriving, MAX_ARRIVAL_SHARE * rate)
    t = work / r
    if t <= span_s or arriving <= 0.0:
        return t
    return max(span_s, (work + arriving * span_s) / rate)


@dataclass(frozen=True)
class MemoryDrain:
    """When the memory the running requests hold frees: `free` KV tokens free now, and
    `ends[i]` seconds from now `freed[i]` more (cumulative, in the order they end).

    Admission is non-preemptive: an agent first in the policy's order still waits for the
    requests in the engine to end before its own fit (one request of a long context can
    hold the whole cache for hundreds of steps)."""

    free: float = 0.0
    ends: tuple[float, ...] = ()
    freed: tuple[float, ...] = ()

    @classmethod
    def of(cls, running: Iterable[tuple[float, int]], free: float) -> MemoryDrain:
        """From the running requests' `(seconds to their end, tokens reserved)`."""
        ends = sorted(running)
        return cls(free, tuple(t for t, _ in ends), tuple(itertools.accumulate(k for _, k in ends)))

    def wait_s(self, need: float) -> float:
        """Seconds until `need` KV tokens are free (O(log n)); past the whole cache, until
        every running request has ended."""
        if need <= 0.0 or self.free >= need or not self.ends:
            return 0.0
        i = bisect.bisect_left(self.freed, need - self.free)
        return self.ends[min(i, len(self.ends) - 1)]


def eta_of(now: float, before: float, own: float, rate: float, arrivals_ahead: float,
           critical_path_s: float, span_s: float = float("inf"), wait_s: float = 0.0) -> float:
    """The ETA formula of the module docstring for one agent; it starts no sooner than
    `wait_s` (`MemoryDrain.wait_s`)."""
    start = max(wait_s, served_by(before, rate, arrivals_ahead, span_s))
    return now + max(served_by(before + own, rate, arrivals_ahead, span_s), start + critical_path_s)
