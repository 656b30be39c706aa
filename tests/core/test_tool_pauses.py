"""Tool calls a client announces (server/scheduler/pauses.py): learned per (type, tool), the
expected rest of a pause, the retention rule's horizon for them, and the ETA's tool time.
Pure: no engine, no server."""

from __future__ import annotations

import math

import pytest

from server.scheduler import AgentShape, Dispatcher, RequestSpec
from server.scheduler.pauses import PauseStats
from server.scheduler.retention import Retention
from server.scheduler.state import AgentState


def agent(agent_type: str = "react") -> AgentState:
    return AgentState(agent_id="a", seq=0, agent_type=agent_type, submitted_at=0.0, predicted_cost=1.0,
                      charged_cost=1.0, virtual_finish=1.0, bound=None,  # type: ignore[arg-type]
                      shape=AgentShape(stages=2))


def test_tool_calls_are_learned_per_type_and_tool_apart_from_pauses() -> None:
    stats = PauseStats()
    a = agent()
    for start, took in ((0.0, 2.0), (10.0, 4.0)):
        stats.tool_started(a, "search", None, start)
        assert stats.tool_ended(a, start + took) == pytest.approx(took)
    assert a.tool is None and stats.tool_ended(a, 20.0) is None  # none in progress: nothing learned
    assert stats.tool_seen("react", "search") == pytest.approx([2.0, 4.0])
    assert stats.tool_seen("other", "search") == pytest.approx([2.0, 4.0])  # any type's until its own
    assert stats.tool_seen("react", "code") == [] and not stats.any_seen  # pauses are their own series


def test_the_rest_of_a_pause_comes_from_the_declared_length_then_the_calls_seen() -> None:
    stats = PauseStats()
    a = agent()
    assert stats.remaining_s(a, 5.0) is None  # not paused
    a.idle_since = 1.0
    assert stats.remaining_s(a, 2.0) is None  # paused, nothing seen
    for x in (1.0, 3.0):
        stats.observe("react", x)
    assert stats.remaining_s(a, 1.5) == pytest.approx(1.5)  # mean of (1, 3) less 0.5 s passed
    assert stats.remaining_s(a, 3.5) == pytest.approx(0.5)  # past the 1 s pause: the 3 s one is left
    assert stats.remaining_s(a, 9.0) is None  # outlasted all seen
    stats.tool_started(a, "search", 10.0, 4.0)
    assert stats.remaining_s(a, 6.0) == pytest.approx(8.0)  # declared, from the call's start
    # outlasted the declared length: the pauses seen judge it (none this long)
    assert stats.remaining_s(a, 15.0) is None
    b = agent()
    b.idle_since = 0.0
    stats.tool_ended(a, 5.0)  # a 1 s call of "search"
    stats.tool_started(b, "search", None, 0.5)
    assert stats.remaining_s(b, 1.0) == pytest.approx(0.5)  # the call seen, not the type's pauses


def test_retention_keeps_a_declared_short_call_and_lets_a_declared_long_one_go() -> None:
    stats = PauseStats()
    rule = Retention("auto", stats)
    m, c = 4096, 0.0000193  # break-even ~0.079 s
    horizon = rule.horizon_s("react", m, c)
    a = agent()
    a.idle_since = 0.0
    stats.tool_started(a, "lookup", 0.02, 0.0)
    assert rule.keep_until_for(a, m, c) == pytest.approx(0.02 + horizon)
    stats.tool_started(a, "crawl", 5.0, 0.0)
    assert rule.keep_until_for(a, m, c) == 0.0  # not kept at all
    assert Retention("always", stats).keep_until_for(a, m, c) == math.inf
    assert Retention("never", stats).keep_until_for(a, m, c) == 0.0
    assert rule.keep_until_for(agent(), m, c) is None  # not paused


def test_an_eta_counts_the_rest_of_an_announced_tool_call() -> None:
    d = Dispatcher("justitia", kv_capacity_tokens=4096, iteration_time_s=0.02)
    d.register_agent("a", 2e5, 0.0, agent_type="react", shape=AgentShape(stages=1))
    d.submit(RequestSpec("r1", "a", prompt_tokens=100, max_tokens=10), 0.0)
    d.admit(0.0)
    d.on_request_finished("r1", 100, 10, 1.0)
    d.refresh_etas(1.0)
    before = d.eta_time("a", 1.0)
    d.pauses.tool_started(d.agents["a"], "crawl", 30.0, 1.0)
    # it declared one stage (done), yet it comes back from the call: 30 s more
    assert d.eta_time("a", 1.0) == pytest.approx(before + 30.0, abs=0.5)
    d.pauses.tool_ended(d.agents["a"], 2.0)
    assert d.eta_time("a", 2.0) < before + 30.0
