"""Pauses: the time an agent spends outside the engine between its stages (a tool call, a
user's think time), learned per agent type from what the scheduler sees.

An agent is *paused* from the moment its last request in flight finishes until it submits
its next one: it keeps its place in virtual time (it stays registered, in the GPS reference)
with nothing queued. Its ETA expects the mean pause of its type before each stage it has not
started, and the deadline promised at registration allows the longest pause seen before one
of them and the type's 90th-percentile pause before each other (`allowance_s`): a promise
that ignored tool time would be broken by every agent that calls a tool. A type never seen
pausing takes the pauses of every type; before any pause has been seen, none is expected
(the promise says so when the agent declares more than one stage).

Every stage boundary counts, a boundary crossed at once as a pause of 0 s. So does one
crossed within `TURNAROUND_S`: that gap is the client's turnaround (the last response on its
way back, the next request on its way in), not time spent outside the engine by choice. A
live client always leaves one, and counted as pauses these gaps would mark every agent of
several stages as one that pauses: its deadline would be the worst case and its ETA's
record would not calibrate deadlines (`eta_estimator.py`), while the turnaround is part of
what the first ETAs' record measures, like any other time the engine's steps do not show.
The gaps taken for turnarounds are kept apart (`summary`), so a server shows what its
clients' turnaround is. An ETA expects,
before each stage, the share of the recent boundaries of any type that held a pause
(`RECENT`) times the type's mean pause when it pauses. Pauses belong to the application
sending the agents, not to the type: a server that served agents which called tools, then
agents of the same types that do not, would otherwise expect the earlier pauses for
hundreds of boundaries (ETAs up to three times the JCTs), and a type's own recent
boundaries are too few to tell (an agent of two stages crosses one). Only the boundaries
crossed since the agent's episode of arrivals began count (`mean_s`'s `since`): after a
lull, the agents that come may be another application's. The worst case keeps the whole
record (`WINDOW`).

A client may also say when a tool call starts and ends (the SDK's `tool()`: the agent API's
pause and resume calls), with the tool's name and, optionally, how long it expects it to
take. Tool calls are learned per (type, tool), apart from the pauses: the expected rest of a
pause in a named tool comes from that tool's calls (any type's, until the type has some),
or from what the client said while the call has not outlasted it.

Pure: callers pass the times.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .eta_interval import quantile_grid
from .tool_time import lasting_quantiles, pause_grid, sum_grid

if TYPE_CHECKING:
    from .state import AgentState

# The most recent pauses kept per type (and over all types): the worst case's record.
WINDOW = 200
# The stage boundaries (of any type, the most recent) whether agents pause is read from.
RECENT = 16
# A stage boundary's gap shorter than this is the client's turnaround, not a pause. Chosen
# between what the two sides of it measured (docs/concepts.md, Pauses): live replays' gaps on
# this project's CPU hosts (median 3 ms, largest 19 ms, quiet or beside 6 busy processes on
# 2 cores) and the shortest tool pauses of the evaluation family's `sessions` shape (lognormal,
# median 0.8 s: 0.3% of them fall below 50 ms, and a pause that short is worth no promise's
# allowance).
TURNAROUND_S = 0.05


def expected_remaining_s(seen: Sequence[float], elapsed_s: float) -> float:
    """Mean of (pause - elapsed) over the pauses seen longer than `elapsed_s` (inf when none
    was: the pause has outlasted everything seen)."""
    longer = [x for x in seen if x > elapsed_s]
    return sum(longer) / len(longer) - elapsed_s if longer else float("inf")


class PauseStats:
    """Pauses seen, per agent type and over all types: mean and 90th percentile; tool calls
    announced by clients, per (type, tool) and per tool."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        self._by_type: dict[str | None, deque[float]] = {}
        self._all: deque[float] = deque(maxlen=window)
        self._tools: dict[tuple[str | None, str], deque[float]] = {}
        self._tool_any: dict[str, deque[float]] = {}
        # The last RECENT boundaries of any type, with the times they were crossed.
        self._lately: deque[tuple[float, float]] = deque(maxlen=RECENT)
        # The gaps taken for clients' turnarounds (the most recent), and how many in all.
        self._turnarounds: deque[float] = deque(maxlen=window)
        self._turnaround_count = 0
        # Pauses under way: since when each agent with stages ahead has been paused
        # (`tool_grid` counts them as lasting at least that long).
        self._under_way: dict[str, float] = {}
        # tool_grid's lengths and grids at one instant (a view of every agent asks at once)
        self._grids_at: float | None = None
        self._grids: dict[tuple[float, int], tuple[float, ...]] = {}
        self._lasting: tuple[float, ...] = ()
        self._unseen = 0.0  # the share of `_lasting` past the longest pause that ended

    def stage_started(self, agent: AgentState, now: float) -> None:
        """The agent submits a request: back from a pause, its next stage starts (the pause
        is observed; a gap the client's turnaround explains is kept apart, as a boundary
        crossed at once); its first request starts its first stage."""
        self.forget(agent.agent_id)
        if agent.idle_since is not None:
            gap = now - agent.idle_since
            if self.is_turnaround(gap):
                self._turnarounds.append(gap)
                self._turnaround_count += 1
                gap = 0.0
            self.observe(agent.agent_type, gap, now)
            if gap >= 0.0:
                agent.paused_s += gap
            agent.idle_since = None
            agent.stages_started += 1
        elif agent.stages_started == 0:
            agent.stages_started = 1

    def paused_so_far(self, agent: AgentState, now: float) -> float:
        """How long the agent has paused in all by `now`: the pauses it came back from and
        the one under way (a gap as short as the client's turnaround is none)."""
        gap = now - agent.idle_since if agent.idle_since is not None and agent.stages_started else 0.0
        return agent.paused_s + (gap if gap > 0.0 and not self.is_turnaround(gap) else 0.0)

    def pause_began(self, agent: AgentState, now: float) -> None:
        """The agent has nothing in flight and stages ahead: a pause is under way."""
        self._under_way[agent.agent_id] = now
        self._grids_at = None

    def forget(self, agent_id: str) -> None:
        """The agent is gone: its pause, if one was under way, is no longer one."""
        if self._under_way.pop(agent_id, None) is not None:
            self._grids_at = None

    @staticmethod
    def is_turnaround(gap_s: float) -> bool:
        """Whether a boundary crossed after `gap_s` was the client's turnaround (shorter
        than `TURNAROUND_S`), not a pause."""
        return 0.0 < gap_s < TURNAROUND_S

    def summary(self) -> dict[str, float | int | None]:
        """What the pauses' record holds, for the scheduler's snapshot: boundaries kept, the
        share of the recent ones that held a pause, the longest pause, and the clients'
        turnarounds (count; median, p90 and largest of the recent ones)."""
        turn = sorted(self._turnarounds)
        return {
            "boundaries": len(self._all),
            "paused_share_lately": self.share_lately(),
            "max_s": self.max_s(),
            "turnaround_limit_s": TURNAROUND_S,
            "turnarounds": self._turnaround_count,
            "turnaround_p50_s": turn[len(turn) // 2] if turn else None,
            "turnaround_p90_s": turn[int(0.9 * len(turn))] if turn else None,
            "turnaround_max_s": turn[-1] if turn else None,
        }

    def observe(self, agent_type: str | None, pause_s: float, now: float | None = None) -> None:
        """A boundary crossed after `pause_s` (at `now`, where known)."""
        if not pause_s >= 0.0:
            return
        self._by_type.setdefault(agent_type, deque(maxlen=self._window)).append(pause_s)
        self._all.append(pause_s)
        self._grids_at = None
        if now is not None:
            self._lately.append((now, pause_s))

    def unpaused_lately(self, now: float, since: float | None = None) -> bool:
        """The traffic of the moment does not pause: none of the last RECENT boundaries
        crossed held a pause, and they are not stale (the time since the last one is no
        longer than the time they took to cross). After a silence longer than its evidence,
        the traffic that comes may be another application's: a server whose agents had
        never paused, idle 90 s, promised the first agents of sessions that did as if they
        would not (7 of 240 broken on the family's held-out seeds). A pause at a boundary
        crossed before `since` (the start of the current episode of arrivals) is that other
        traffic's too, and says nothing of this one's: a server taught by `sessions` held
        the next application's agents with stages ahead to the worst case until RECENT
        boundaries of their own had pushed the teacher's pauses out. A boundary crossed
        before then without a pause still counts, as before: it is evidence of no pause
        only with a boundary of the current episode after it (the staleness rule)."""
        lately = [(t, p) for t, p in self._lately if since is None or t >= since or p <= 0.0]
        if not lately or any(p > 0.0 for _, p in lately):
            return False
        first, last = lately[0][0], lately[-1][0]
        return now - last <= last - first

    def _seen(self, agent_type: str | None) -> Iterable[float]:
        own = self._by_type.get(agent_type)
        return own if own else self._all

    def seen(self, agent_type: str | None) -> list[float]:
        """The pauses the type's estimates use (its own, else every type's)."""
        return list(self._seen(agent_type))

    @property
    def any_seen(self) -> bool:
        return bool(self._all)

    def max_s(self) -> float:
        """The longest pause of any type kept (0.0: none seen, or none that lasted)."""
        return max(self._all, default=0.0)

    def share_lately(self, since: float | None = None) -> float:
        """The share of the last RECENT stage boundaries (of any type) that held a pause;
        of those crossed at `since` or later where given (0.0: none)."""
        recent = list(itertools.islice(reversed(self._all), RECENT)) if since is None \
            else [p for t, p in self._lately if t >= since]
        return sum(p > 0.0 for p in recent) / len(recent) if recent else 0.0

    def paused_lately(self) -> bool:
        """Whether any of the last RECENT stage boundaries (of any type) held a pause."""
        return any(p > 0.0 for p in itertools.islice(reversed(self._all), RECENT))

    def mean_s(self, agent_type: str | None, since: float | None = None) -> float:
        """The pause an ETA expects before a stage: the share of recent boundaries (crossed
        at `since` or later, where given) that held one, times the type's mean pause when it
        paused (every type's, where the type has not been seen; 0 where it never paused)."""
        lasted = [p for p in self._seen(agent_type) if p > 0.0]
        return self.share_lately(since) * sum(lasted) / len(lasted) if lasted else 0.0

    def allowance_s(self, agent_type: str | None, left: int, now: float) -> float:
        """The tool time a promise made at `now` allows an agent with `left` stage boundaries
        ahead: the longest pause before one of them, the 90th percentile before each other
        (`allowance_parts`). One long tool call is what outlasts an allowance of p90 per
        boundary (pauses are heavy-tailed: the family's `sessions` agents broke their
        promises on single pauses of 6-10 s against a p90 near 3 s), while the sum of several
        pauses seldom outlasts their p90s. 0.0: no boundary ahead, or no pause seen yet."""
        if left <= 0 or not self._all:
            return 0.0
        longest, each = self.allowance_parts(agent_type, now)
        return longest + each * (left - 1)

    def allowance_parts(self, agent_type: str | None, now: float) -> tuple[float, float]:
        """The allowance's two figures at `now`: the longest pause of any type, a pause under
        way counting as long as it has lasted; and the 90th percentile of pauses, the type's
        or, where longer, every type's estimated with the pauses under way (Kaplan-Meier,
        `lasting_quantiles`). Early in an episode the pauses that have ended are the short
        ones (a long one has not ended yet): from those alone, the family's `sessions` agents
        that registered in an episode's first seconds were allowed 1-7 s against 10-18 s of
        tool time (tuning seeds, simulator: 6 of 480 promises broken, 2 with pauses under
        way counted)."""
        under_way = max((now - since for since in self._under_way.values()), default=0.0)
        self._estimate_lasting(now)
        lasting = sorted(self._lasting)
        p90_lasting = lasting[min(len(lasting) - 1, int(0.9 * len(lasting)))] if lasting else 0.0
        return max(self.max_s(), under_way), max(self.p90_s(agent_type), p90_lasting)

    def allowance_words(self, agent_type: str | None, left: int, allowed: float, now: float) -> str:
        """What a deadline that allows `allowed` (`allowance_s(agent_type, left, now)`) of
        tool time rests on, in the record's words ("": nothing allowed). The server keeps the
        engine's part of a promise; the tool calls are its client's, and one longer than any
        seen breaks it. The caller passes the allowance it added, so the words name the
        figure the deadline holds."""
        if allowed <= 0.0:
            return ""
        longest, each = self.allowance_parts(agent_type, now)
        others = (f", and the pauses' 90th percentile ({each:.3g} s) before each of the {left - 1} other(s)"
                  if left > 1 else "")
        return (f"its client's tool time before its {left} later stage(s) takes at most {allowed:.3g} s "
                f"in all: the longest pause seen ({longest:.3g} s) before one{others}")

    def tool_grid(self, agent: AgentState, left: int, since: float | None, now: float) -> tuple[float, ...] | None:
        """The tool time ahead of the agent before its `left` later stages, as equally likely
        points (tool_time.py): before each, no pause with the probability that one of the
        recent boundaries (crossed at `since` or later, as `mean_s`) held none, else a pause
        as long as those of every type (the pauses are the application's: `mean_s`), the
        ones under way counted as lasting at least as long as they have; where the agent is
        paused, the rest of its pause from the pauses that lasted longer. None where that
        is not known: no pause seen lately, a tool call its client announced (`remaining_s`
        goes by the tool's calls), or a pause that has outlasted every one seen."""
        if left <= 0:
            return (0.0,)
        share = self.share_lately(since)
        if agent.tool is not None or share <= 0.0:
            return None
        self._estimate_lasting(now)
        if not self._lasting:
            return None
        each = pause_grid(self._lasting, share)
        if agent.idle_since is None:
            grid = self._grids.get((share, left))
            if grid is None:
                grid = self._grids[(share, left)] = sum_grid(each, each, left)
            return grid
        elapsed = now - agent.idle_since
        rest = [p - elapsed for p in self._lasting if p > elapsed]
        return sum_grid(quantile_grid(rest), each, left) if rest else None

    def tail_unseen(self, left: int, since: float | None, now: float) -> float:
        """The chance that one of the `left` pauses ahead of an agent outlasts every pause
        that has ended (the pauses under way say only that some last longer, not how much):
        where it is larger than the share an interval leaves above its end, the pauses seen
        cannot place that end."""
        if left <= 0:
            return 0.0
        self._estimate_lasting(now)
        return 1.0 - (1.0 - self.share_lately(since) * self._unseen) ** left

    def _estimate_lasting(self, now: float) -> None:
        """The pauses' lengths at `now` (`lasting_quantiles`) and the share of them past the
        longest that ended, once per instant: a view of every agent asks at one `now`."""
        if self._grids_at == now:
            return
        self._grids_at, self._grids = now, {}
        ended = [p for p in self._all if p > 0.0]
        self._lasting = lasting_quantiles(ended, [now - t for t in self._under_way.values()])
        longest = max(ended, default=0.0)
        self._unseen = sum(x > longest for x in self._lasting) / len(self._lasting) if self._lasting else 0.0

    def p90_s(self, agent_type: str | None) -> float:
        seen = sorted(self._seen(agent_type))
        return seen[min(len(seen) - 1, int(0.9 * len(seen)))] if seen else 0.0

    # -- tool calls a client announced -------------------------------------------
    def tool_started(self, agent: AgentState, tool: str, expected_s: float | None, now: float) -> None:
        """The agent's client says it is in tool call `tool` from `now` (a new one replaces
        an announced call that did not end)."""
        agent.tool, agent.tool_since = tool, now
        agent.tool_expected_s = expected_s if expected_s is not None and expected_s >= 0.0 else None

    def tool_ended(self, agent: AgentState, now: float) -> float | None:
        """The announced tool call ended: its length is learned; returns it (None: none
        was in progress)."""
        if agent.tool is None or agent.tool_since is None:
            return None
        took = max(0.0, now - agent.tool_since)
        self._tools.setdefault((agent.agent_type, agent.tool), deque(maxlen=self._window)).append(took)
        self._tool_any.setdefault(agent.tool, deque(maxlen=self._window)).append(took)
        agent.tool = agent.tool_since = agent.tool_expected_s = None
        return took

    def tool_seen(self, agent_type: str | None, tool: str) -> list[float]:
        """The calls of `tool` its estimates use: the type's own, else every type's."""
        own = self._tools.get((agent_type, tool))
        return list(own if own else self._tool_any.get(tool, ()))

    def pause_basis(self, agent: AgentState) -> tuple[float, list[float], float | None] | None:
        """What the rest of the agent's current pause is judged from: since when (the
        announced tool call's start, else the pause's), the lengths seen of such pauses
        (the tool's calls, else the type's pauses) and the length its client declared (None:
        not declared). None: it is not paused."""
        if agent.tool is not None and agent.tool_since is not None:
            seen = self.tool_seen(agent.agent_type, agent.tool) or self.seen(agent.agent_type)
            return agent.tool_since, seen, agent.tool_expected_s
        if agent.idle_since is not None:
            return agent.idle_since, self.seen(agent.agent_type), None
        return None

    def remaining_s(self, agent: AgentState, now: float) -> float | None:
        """The expected rest of the agent's current pause, seconds: what its client declared
        less what has passed (while it has not outlasted it), else the mean rest of the
        pauses seen that lasted longer. None: not paused, or nothing to go on (none seen,
        or it has outlasted every one seen)."""
        basis = self.pause_basis(agent)
        if basis is None:
            return None
        since, seen, declared = basis
        elapsed = max(0.0, now - since)
        if declared is not None and elapsed <= declared:
            return declared - elapsed
        rest = expected_remaining_s(seen, elapsed)
        return rest if rest != float("inf") else None


def stages_left(declared_stages: int, started: int) -> int:
    """Stage boundaries still ahead of an agent (each may hold a pause): its declared
    stages past the ones it has started (0 when it declared none)."""
    return max(0, declared_stages - max(1, started))
