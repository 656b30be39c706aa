"""The GPS virtual clock: virtual finish tags under ideal fair sharing.

GPS shares the service rate R (cost units per second) equally among the agents backlogged in
the *reference* system, B(t) = {admitted agents whose tag is still ahead of V}:

    V(0) = 0,   dV/dt = R / |B(t)| while |B(t)| > 0,   V constant while B is empty
    on arrival of agent j at time a_j with cost C_j:   F_j = V(a_j) + C_j

Advancing V from t0 to t1 processes the GPS departures in order: with the smallest tag F_min
in B, V reaches it after (F_min - V) * |B| / R seconds; pop it, shrink B, go on. B is a heap
of tags, so every arrival and departure is O(log n).

The clock never reads a wall clock: every method that depends on time takes `now` (seconds on
the caller's clock, non-decreasing). The live server passes its monotonic time, the
simulator its simulated time.

Updates (`arrive`, `extend`, `remove`, `set_rate`, `advance`) move the clock to `now`. Reads
(`peek`, `projected_time`, `finish_time`) do not: they replay the departures between the
clock's time and `now` on local variables, with the same arithmetic as `advance`, so a read
returns exactly what it would after an advance and leaves the clock as it was (a read at a
later `now`, such as an agent view or a metrics scrape, must not change the float rounding of
what the scheduler later decides). docs/concepts.md derives GPS and the tags.

Two operations go beyond the textbook:

* `extend(key, extra, now)` charges an agent more work after its arrival (an over-run). It is
  WFQ's rule for a new job of the same flow: F = max(F_old, V(now)) + extra. An agent that
  GPS had already finished re-enters B.
* `remove(key, now)` drops a cancelled agent from B (its remaining GPS work disappears).
* `settle(key, unused, now)` takes back work an agent was charged and never used (it finished
  or expired under its prediction): its tag moves down by that much, and it leaves B if V has
  passed the new tag. `flush(keys, now)` drops finished agents whose real work is all done
  when the real system runs dry (no phantom backlog while the server is idle).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple

from sortedcontainers import SortedList


class ClockReading(NamedTuple):
    """The GPS reference system at some time, computed without advancing the clock."""

    V: float
    backlog: int  # |B|
    departed: list[tuple[object, float]]  # (key, GPS finish time) since the clock's time


@dataclass
class Projection:
    """GPS finish times at `now`: of the backlogged agents (`finish`), and of an agent that
    would join with some cost. GPS serves every backlogged agent alike until it leaves, so
    V reaches x when R t = sum over B of (min(F_j, x) - V): with the tags sorted and their
    prefix sums that is one binary search; a joining agent adds its own (x - V)."""

    now: float
    V: float
    rate: float
    finish: dict[object, float]  # backlogged key -> GPS finish time
    tags: list[float]
    prefix: list[float]

    def arrival(self, cost: float) -> float:
        if cost <= 0:
            return self.now
        x = self.V + cost
        k = bisect.bisect_left(self.tags, x)
        work = self.prefix[k] - k * self.V + (len(self.tags) - k) * (x - self.V)
        return self.now + (work + cost) / self.rate


@dataclass
class VirtualClock:
    """Exact GPS virtual time with a heap of the backlogged agents' finish tags."""

    rate: float  # R: cost units served per second at full memory (M / tau)
    now: float = 0.0  # last time the clock was advanced to
    V: float = 0.0
    _heap: list[tuple[float, int, object]] = field(default_factory=list)
    _tags: dict[object, float] = field(default_factory=dict)  # key -> live tag (backlogged)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    departures: dict[object, float] = field(default_factory=dict)  # key -> GPS finish time
    _live: set[object] = field(default_factory=set)  # keys whose departure time is worth recording
    # The live tags again, in order (f, seq, key), so that reads walk only the tags they need
    # (O(k log n)) instead of sorting the whole backlog for every agent view.
    _sorted: SortedList = field(default_factory=SortedList)
    _entry: dict[object, tuple[float, int, object]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError("rate must be positive")

    # -- queries ---------------------------------------------------------------
    @property
    def backlog(self) -> int:
        """|B|: agents whose tag is still ahead of V."""
        return len(self._tags)

    def tag(self, key: object) -> float | None:
        """The live tag of a backlogged agent (None once GPS has finished it)."""
        return self._tags.get(key)

    def peek(self, now: float) -> ClockReading:
        """V, |B| and the departures at `now`, without advancing the clock."""
        if now < self.now:
            self._check_time(now)
            return ClockReading(self.V, len(self._tags), [])
        # The same walk as `advance`, on local variables: bit-identical results.
        t, v, n = self.now, self.V, len(self._tags)
        departed: list[tuple[object, float]] = []
        for f, _, key in self._sorted:  # the live tags in (tag, seq) order, as the heap pops them
            t_dep = t + (f - v) * n / self.rate
            if t_dep > now:
                break
            departed.append((key, t_dep))
            t, v, n = t_dep, f, n - 1
        if n:
            v += (now - t) * self.rate / n
        return ClockReading(v, n, departed)

    def projected_time(self, tag: float, now: float) -> float:
        """When V will reach `tag` if nothing else arrives (time on the caller's clock).

        O(k log n) for the k backlogged tags below `tag`. Used for views, not per decision.
        Does not advance the clock.
        """
        return self._project(self.peek(now), tag, now)

    def finish_time(self, key: object, tag: float, now: float) -> float:
        """GPS finish time of `key` (whose tag is `tag`) as seen at `now`: its departure time
        if GPS has finished it (`now` if that was not recorded), else the projection."""
        reading = self.peek(now)
        if key in self._tags:
            for k, t_dep in reading.departed:
                if k == key:
                    return t_dep if key in self._live else now
            return self._project(reading, tag, now)
        return self.departures.get(key, now)

    def projection(self, now: float) -> Projection:
        """The GPS finish time of every backlogged agent as seen at `now` (no further
        arrivals), in one walk of the tags: O(n) for all of them, where `finish_time` is
        O(k log n) for one; and what an arrival at `now` would get (`Projection.arrival`,
        O(log n)). A read: the clock does not move."""
        reading = self.peek(now)
        out = {key: (t_dep if key in self._live else now) for key, t_dep in reading.departed}
        t, v, n, rate = now, reading.V, reading.backlog, self.rate
        tags: list[float] = []
        prefix = [0.0]
        for f, _, key in islice(self._sorted, len(reading.departed), None):
            if f > v:
                t += (f - v) * n / rate
                v = f
            n -= 1
            out[key] = t
            tags.append(f)
            prefix.append(prefix[-1] + f)
        return Projection(now, reading.V, rate, out, tags, prefix)

    def arrival_finish_time(self, cost: float, now: float) -> float:
        """GPS finish time of an agent that would arrive at `now` with `cost` (it joins B, so
        the backlog is one larger than today's). A read: the clock does not move."""
        reading = self.peek(now)
        if cost <= 0:
            return now
        return self._project(reading, reading.V + cost, now, joining=1)

    def _project(self, reading: ClockReading, tag: float, now: float, joining: int = 0) -> float:
        v = reading.V
        if tag <= v:
            return now
        t, n, gone = now, reading.backlog + joining, len(reading.departed)
        # the live tags below `tag` that are still backlogged at `now` (departed ones come first)
        for f, _, _ in islice(self._sorted.irange(maximum=(tag, -1)), gone, None):
            t += (f - v) * n / self.rate
            v, n = f, n - 1
        return t + (tag - v) * max(n, 1) / self.rate

    def _check_time(self, now: float) -> None:
        # Callers pass a non-decreasing clock; tolerate tiny float regressions.
        if self.now - now > 1e-9:
            raise ValueError(f"time went backwards: {now} < {self.now}")

    # -- updates ---------------------------------------------------------------
    def advance(self, now: float) -> float:
        """Move V to time `now`, processing GPS departures in tag order. Returns V."""
        if now < self.now:
            self._check_time(now)
            return self.V
        t = self.now
        while self._heap:
            f, _, key = self._heap[0]
            if self._tags.get(key) != f:  # stale entry (extended or removed agent)
                heapq.heappop(self._heap)
                continue
            n = len(self._tags)
            t_dep = t + (f - self.V) * n / self.rate
            if t_dep > now:
                break
            heapq.heappop(self._heap)
            del self._tags[key]
            self._untrack(key)
            self._departed(key, t_dep)
            t, self.V = t_dep, f
        if self._tags:
            self.V += (now - t) * self.rate / len(self._tags)
        self.now = now
        return self.V

    def _departed(self, key: object, t_dep: float) -> None:
        """`advance` processed the GPS departure of `key` at `t_dep`."""
        if key in self._live:
            self.departures[key] = t_dep

    def arrive(self, key: object, cost: float, now: float) -> float:
        """Agent `key` arrives with `cost`: returns its tag F = V(now) + cost."""
        if key in self._tags:
            raise ValueError(f"{key!r} is already backlogged")
        if cost < 0:
            raise ValueError("cost must be >= 0")
        self.advance(now)
        f = self.V + cost
        self.departures.pop(key, None)
        self._live.add(key)
        if cost == 0:
            self.departures[key] = now
            return f
        self._tags[key] = f
        self._track(key, f)
        return f

    def _track(self, key: object, f: float) -> None:
        seq = next(self._seq)
        heapq.heappush(self._heap, (f, seq, key))
        self._untrack(key)
        self._entry[key] = (f, seq, key)
        self._sorted.add((f, seq, key))

    def _untrack(self, key: object) -> None:
        entry = self._entry.pop(key, None)
        if entry is not None:
            self._sorted.remove(entry)

    def extend(self, key: object, old_tag: float, extra: float, now: float) -> float:
        """Charge `extra` more work to `key`: F = max(F_old, V(now)) + extra. Returns F."""
        self.advance(now)
        f = max(old_tag, self.V) + extra
        if extra <= 0:
            return max(old_tag, f)
        self.departures.pop(key, None)
        self._tags[key] = f
        self._track(key, f)
        return f

    def shift(self, key: object, old_tag: float, extra: float, now: float) -> float:
        """Charge `extra` more work to `key` where it stands: F = F_old + extra. Unlike
        `extend`, a key whose tag V has passed does not start again from V: it keeps its
        place and moves by what it is charged (re-entering the backlog when that carries
        its tag past V). Returns F."""
        self.advance(now)
        if extra <= 0:
            return old_tag
        f = old_tag + extra
        if key in self._tags or f > self.V:
            self.departures.pop(key, None)
            self._tags[key] = f
            self._track(key, f)
        return f

    def remove(self, key: object, now: float) -> None:
        """Drop a cancelled agent from the backlog (lazy: its heap entry goes stale)."""
        self.advance(now)
        self._tags.pop(key, None)
        self._untrack(key)

    def settle(self, key: object, unused: float, now: float) -> float | None:
        """`key` ended having used `unused` less than it was charged: that work was never
        real, so it leaves the backlog. Its tag moves down by `unused`; if V has passed the
        new tag it leaves B. Returns the settled tag (None if it was not backlogged)."""
        self.advance(now)
        f = self._tags.get(key)
        if f is None:
            return None
        f = max(f - max(0.0, unused), self.V)
        if f <= self.V:
            del self._tags[key]  # its heap entry goes stale
            self._untrack(key)
            return f
        self._tags[key] = f
        self._track(key, f)
        return f

    def flush(self, keys: Iterable[object], now: float) -> None:
        """Drop `keys` from B: agents that have ended and whose real work is done, when the
        real system has nothing left to serve (their remaining fluid work is phantom)."""
        self.advance(now)
        for key in keys:
            if self._tags.pop(key, None) is not None:
                self._untrack(key)

    def set_rate(self, rate: float, now: float) -> None:
        """Change R (new tau or new capacity) from `now` on: V is piecewise linear."""
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.advance(now)
        self.rate = rate

    def forget(self, key: object) -> None:
        """Stop recording the agent's departure (it stays in B until V passes its tag)."""
        self.departures.pop(key, None)
        self._live.discard(key)
