"""The ETA of an agent that pauses: its engine time and its client's tool time weighed apart
(server/scheduler/tool_time.py), the pauses' lengths estimated with those under way counted,
and the records the engine part and the interval are calibrated by."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from server.scheduler import AgentShape, Dispatcher, RequestSpec
from server.scheduler.eta_interval import HIGH_QUANTILE, LOW_QUANTILE, MIN_SEEN, EtaCalibration
from server.scheduler.pauses import PauseStats
from server.scheduler.time_model import TimeModel
from server.scheduler.tool_time import (
    SUM_EXACT,
    lasting_quantiles,
    level_of,
    pause_grid,
    remaining_times,
    sum_grid,
    told_with_tools,
)


def test_pauses_under_way_count_as_lasting_at_least_as_long_as_they_have() -> None:
    ended = [0.5] * 10
    assert statistics.median(lasting_quantiles(ended, [])) == pytest.approx(0.5)
    # as many pauses have lasted 5 s and go on: half of all last longer than 0.5 s
    points = sorted(lasting_quantiles(ended, [5.0] * 10))
    assert points[len(points) // 2 - 1] == pytest.approx(0.5) and points[len(points) // 2] >= 5.0
    assert lasting_quantiles([], [5.0]) == ()  # no pause ended: no length known


def test_early_in_an_episode_the_estimate_is_not_biased_to_the_pauses_that_ended_first() -> None:
    """Pauses start at random over 10 s and are looked at when the 10 s are up: those that
    ended are the short ones. Counting those under way brings the median near the true one."""
    rng = random.Random(7)
    ended, under_way = [], []
    for _ in range(400):
        start, length = rng.uniform(0.0, 10.0), rng.lognormvariate(math.log(0.8), 1.0)
        (ended if start + length <= 10.0 else under_way).append(min(length, 10.0 - start))
    true_median = 0.8
    naive = statistics.median(ended)
    estimate = statistics.median(lasting_quantiles(ended, under_way))
    assert abs(math.log(estimate / true_median)) < 0.5 * abs(math.log(naive / true_median))


def test_the_tool_time_of_several_boundaries_is_the_sum_of_their_draws() -> None:
    assert sum_grid((1.0,), (1.0,), 0) == (0.0,)
    each = pause_grid([2.0] * 20, share=1.0)
    assert sum_grid(each, each, 3) == pytest.approx((6.0,) * len(each))
    # no pause with probability 1 - share: a quarter of the points of one boundary are 0
    assert pause_grid([2.0] * 20, share=0.75).count(0.0) == 4
    assert pause_grid([], share=1.0) == (0.0,) * 16  # nothing lasted: no tool time
    three = sum_grid(pause_grid([1.0, 3.0] * 10, 1.0), pause_grid([1.0, 3.0] * 10, 1.0), 3)
    assert min(three) == pytest.approx(3.0) and max(three) == pytest.approx(9.0)


def test_the_eta_told_is_the_point_of_least_expected_relative_error() -> None:
    times = remaining_times(2.0, (0.25, 0.5, 1.0), pause_grid([0.5, 1.0, 8.0] * 5, 1.0))
    told, low, high = told_with_tools(times, 0.1, 0.9)

    def mean_relative_error(x: float) -> float:
        return sum(abs(x - t) / t for t in times) / len(times)

    assert all(mean_relative_error(told) <= mean_relative_error(x) + 1e-12 for x in times)
    assert told < statistics.fmean(times)  # below the mean: a long pause is the rare outcome
    assert low <= told <= high and low == pytest.approx(times[int(0.1 * len(times))])
    assert told_with_tools([0.0, 1.0], 0.1, 0.9)[0] == 0.0  # a remaining time of 0 is possible


def test_where_a_jct_fell_in_its_distribution() -> None:
    times = [1.0, 2.0, 3.0, 4.0]
    assert level_of(times, 0.5) == 0.0 and level_of(times, 9.0) == 1.0
    assert level_of(times, 2.5) == pytest.approx(0.5) and level_of(times, 2.0) == pytest.approx(0.375)


class _Agent:
    """What PauseStats.tool_grid reads of an agent."""

    def __init__(self, agent_id: str, idle_since: float | None = None, tool: str | None = None) -> None:
        self.agent_id, self.agent_type, self.idle_since, self.tool = agent_id, "chat", idle_since, tool


def test_the_tool_grid_counts_the_pauses_under_way_and_conditions_on_the_one_of_a_paused_agent() -> None:
    stats = PauseStats()
    for k in range(10):
        stats.observe("chat", 1.0, float(k))
    working = _Agent("w")
    alone = stats.tool_grid(working, 2, None, 10.0)
    assert alone is not None and max(alone) == pytest.approx(2.0)
    for k in range(10):  # ten agents paused 4 s ago, still paused
        stats.pause_began(_Agent(f"p{k}"), 6.0)  # type: ignore[arg-type]
    longer = stats.tool_grid(working, 2, None, 10.0)
    assert longer is not None and statistics.median(longer) > statistics.median(alone)
    # paused itself for 2 s: its pause is one of those that lasted longer, less the 2 s
    paused = stats.tool_grid(_Agent("p0", idle_since=8.0), 1, None, 10.0)
    assert paused is not None and min(paused) >= 2.0
    assert stats.tool_grid(_Agent("t", tool="search"), 2, None, 10.0) is None  # its tool's calls decide
    assert stats.tool_grid(working, 0, None, 10.0) == (0.0,)
    for k in range(10):
        stats.forget(f"p{k}")
    assert stats.tool_grid(working, 2, None, 11.0) == alone


def test_the_engine_ratios_and_the_interval_levels_come_from_the_finished_agents() -> None:
    cal = EtaCalibration()
    prior = cal.engine_ratios(0)
    assert len(prior) == 16 and statistics.median(prior) == pytest.approx(0.37, rel=0.1)
    assert cal.tool_levels() == (LOW_QUANTILE, HIGH_QUANTILE)
    for k in range(MIN_SEEN):
        cal.observe_engine(2.0 + 0.01 * k, 0)
        cal.observe_level(1.0)  # every JCT above every point of its first ETA's distribution
    assert min(cal.engine_ratios(0)) >= 2.0 and min(cal.engine_ratios(3)) >= 2.0  # pooled for a context unseen
    low, high = cal.tool_levels()
    assert high == 1.0 and low == 1.0


def _served(d: Dispatcher, aid: str, now: float, tokens: int = 20) -> float:
    """One request of the agent through the engine: admitted at `now`, done a step later."""
    d.submit(RequestSpec(f"{aid}-{now}", aid, prompt_tokens=10, max_tokens=tokens), now)
    d.admit(now)
    d.on_request_finished(f"{aid}-{now}", 10, tokens, now + 0.1)
    return now + 0.1


def test_a_finished_agent_that_paused_teaches_the_engine_ratio_and_where_its_jct_fell() -> None:
    """Agents of three stages pausing 1 s between them: each finished one leaves its engine
    time over the engine part of its first ETA, and where its JCT fell in its first ETA's
    distribution; after MIN_SEEN of them the next agent's ETA rests on those records."""
    d = Dispatcher("justitia", 4096, 0.01, time_model=TimeModel(0.005, 0.0, 0.0, 0.0))
    for k in range(16):  # the traffic pauses
        d.pauses.observe("chat", 1.0, 0.01 * k)
    now = 1.0
    for i in range(MIN_SEEN):
        aid = f"a{i}"
        d.register_agent(aid, 1000.0, now, agent_type="chat", shape=AgentShape(3, 60))
        agent = d.agents[aid]
        assert agent.eta_tools and len(agent.eta_times) == 32
        start = now
        for stage in range(3):
            now = _served(d, aid, now) + (1.0 if stage < 2 else 0.0)
        jct = now - start
        d.observe_jct(0.0, jct, aid)
        assert d.etas.calibration.engine_ratios(agent.promise_context)  # recorded
        d.finish_agent(aid, now)
    ratios = d.etas.calibration.engine_ratios(0)
    assert ratios != EtaCalibration().engine_ratios(0)  # the record's, not the prior's
    # every agent's JCT fell at the same place in its first ETA's distribution: the
    # interval's levels are that place, no longer the nominal ones
    low, high = d.etas.calibration.tool_levels()
    assert (low, high) != (LOW_QUANTILE, HIGH_QUANTILE) and low == high


def test_an_agent_of_a_million_stages_is_told_its_tool_time_without_a_million_sums() -> None:
    """Past SUM_EXACT boundaries the rest of the sum is normal: the median of a million
    pauses is a million times their mean, and the agent registers and is viewed at once."""
    each = pause_grid([0.5, 1.0, 4.0] * 10, 1.0)
    many = sum_grid(each, each, 1_000_000)
    assert statistics.median(many) == pytest.approx(1_000_000 * statistics.fmean(each), rel=0.01)
    exact = sum_grid(each, each, SUM_EXACT)
    assert statistics.median(sum_grid(each, each, SUM_EXACT + 1)) > statistics.median(exact)
    d = Dispatcher("justitia", 4096, 0.01)
    d.register_agent("x", 1.0, 0.0, agent_type="chat")
    for k in range(16):
        d.pauses.observe("chat", 1.0, 0.01 * k)
    view = d.register_agent("huge", 1000.0, 1.0, agent_type="chat", shape=AgentShape(1_000_000, 60))
    assert d.agents["huge"].eta_tools and view.eta_s >= 999_999 * 1.0


def test_where_the_pauses_seen_cannot_place_the_interval_end_the_deadline_does() -> None:
    """Early in an episode every pause that ended is short while longer ones are under way:
    how long the pauses ahead may last is not known, and the interval's high end is the
    deadline promised (which allows the longest pause seen and the p90s). Once those pauses
    have ended, their lengths place it."""
    def server(under_way: int) -> Dispatcher:
        d = Dispatcher("justitia", 4096, 0.01)
        d.register_agent("x", 1.0, 0.0, agent_type="chat")
        for k in range(16):
            d.pauses.observe("chat", 0.2, 0.01 * k)
        for k in range(under_way):  # paused since 0.5 s, still paused at 3 s
            d.register_agent(f"p{k}", 1.0, 0.4, agent_type="chat", shape=AgentShape(3, 10))
            d.pauses.pause_began(d.agents[f"p{k}"], 0.5)
        return d

    early = server(under_way=16).register_agent("a", 1000.0, 3.0, agent_type="chat", shape=AgentShape(3, 10))
    assert early.eta_interval_s[1] == pytest.approx(early.deadline_s) and early.deadline_s > early.eta_s
    known = server(under_way=0).register_agent("a", 1000.0, 3.0, agent_type="chat", shape=AgentShape(3, 10))
    assert known.eta_interval_s[1] < known.deadline_s
    assert known.eta_interval_s[1] >= 0.4  # its two pauses of 0.2 s
