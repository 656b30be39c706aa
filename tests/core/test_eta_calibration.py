"""The ETA told is the replay's scaled by its context's record of JCT / first ETA
(server/scheduler/eta_interval.py): the scale minimises the relative error, the record stays
the replay's, and on the evaluation family the told ETA is closer than the replay's."""

from __future__ import annotations

import pytest

from server.scheduler import AgentShape, Dispatcher
from server.scheduler.eta_interval import (
    MIN_SEEN,
    PRIOR_HIGH,
    PRIOR_LOW,
    PRIOR_PAUSING_HIGH,
    PRIOR_PAUSING_LOW,
    EtaCalibration,
    weighted_median,
)
from server.shared.profiles import get_profile
from server.sim.family import run_family
from server.sim.shapes import ShapeSpec


def test_the_scale_minimises_the_relative_error_not_the_plain_median() -> None:
    ratios = sorted([0.4, 0.5, 0.6, 1.0, 1.2])
    best = min((s / 100 for s in range(20, 200)), key=lambda s: sum(abs(s - r) / r for r in ratios))
    assert weighted_median(ratios) == pytest.approx(best, abs=0.01)
    assert weighted_median(ratios) < 0.6  # the plain median: an ETA twice the JCT costs more than half of it


def test_each_context_is_scaled_by_its_own_record_and_the_interval_holds_the_eta_told() -> None:
    cal = EtaCalibration()
    for _ in range(MIN_SEEN - 1):
        cal.observe(1.0, 0.5, 3)
    assert cal.scale(3) == 1.0  # too few: a fresh server does not scale
    cal.observe(1.0, 0.5, 3)
    for _ in range(MIN_SEEN):
        cal.observe(1.0, 1.5, 0)
    assert cal.scale(3) == pytest.approx(0.5) and cal.scale(0) == pytest.approx(1.5)
    assert cal.scale(1) == pytest.approx(0.5)  # a context not seen: every context's record
    low, high = cal.interval(0.0, 10.0, context=3, scale=cal.scale(3))
    assert low <= 5.0 <= high and high < 10.0  # about the told 5 s, not the replay's 10 s


def quiet() -> Dispatcher:
    d = Dispatcher("justitia", 1000, 0.1)
    d.set_iteration_time(0.1, 0.0)  # measured: no widened promise
    return d


def test_the_eta_told_is_scaled_and_the_record_stays_the_replays() -> None:
    d = quiet()
    for _ in range(MIN_SEEN):  # head-of-queue agents that took half their ETA
        d.etas.calibration.observe(1.0, 0.5, 0)
    view = d.register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert d.agents["a"].promise_context == 0
    replay = d.eta_time("a", 0.0)
    assert view.eta_s == pytest.approx(0.5 * replay)
    assert view.eta_interval_s[0] <= view.eta_s <= view.eta_interval_s[1]
    # it took the replay's ETA: the record says 1.0, not the 2.0 it is of the ETA told
    d.observe_jct(view.eta_s, replay, "a")
    assert d.etas.calibration.upper_ratio(1.0, MIN_SEEN + 1, 0) == (pytest.approx(1.0), MIN_SEEN + 1)
    # an agent the dispatcher has forgotten (finished with requests in flight): its caller
    # says what it was scaled by
    view = d.register_agent("b", 10_000.0, 0.0, shape=AgentShape(1, 10))
    scale, replay = d.agents["b"].eta_scale, d.eta_time("b", 0.0)
    d.finish_agent("b", 0.0)
    d.observe_jct(view.eta_s, replay, "b", scale)
    assert d.etas.calibration.upper_ratio(1.0, 1, None) == (pytest.approx(1.0), 1)


def test_the_deadlines_record_is_of_the_eta_the_deadline_scaled() -> None:
    """A deadline scales the replay's ETA at registration, before the agent's own arrival
    counts among the arrivals; the ETA told is the replay's after it. Where the two differ
    (an agent after a lull, its own arrival the only one measured), the deadlines' record
    must be of the first: a factor learned on the larger ETA told and applied to the smaller
    one gave deadlines short of the JCTs (the 300-agent mix at 1x: 16 of 300 broken, 4 with
    deadlines before the ETA told). The scale's record stays the told ETA's replay."""
    cal = EtaCalibration()
    cal.observe(10.0, 20.0, 0, deadline_eta_s=4.0)
    assert cal.upper_ratio(1.0, 1, 0) == (pytest.approx(5.0), 1)  # 20 / 4, not 20 / 10
    told = EtaCalibration()
    told.observe(10.0, 20.0, 0)
    assert told.upper_ratio(1.0, 1, 0) == (pytest.approx(2.0), 1)
    assert [cal.factors_for(0)] == [told.factors_for(0)]  # the ETA's factors are the told ETA's
    # through the dispatcher: the agent's deadline scaled a replay of half its told ETA's
    d = quiet()
    view = d.register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    agent = d.agents["a"]
    assert agent.eta_replay_s == pytest.approx(d.eta_time("a", 0.0))
    agent.eta_replay_s = 0.5 * view.eta_s / agent.eta_scale
    d.observe_jct(view.eta_s, 3.0 * view.eta_s, "a")
    assert d.etas.calibration.upper_ratio(1.0, 1, 0) == (pytest.approx(6.0 * agent.eta_scale), 1)


def test_no_record_learns_from_an_eta_made_of_a_guessed_cost() -> None:
    """A cold start's guess for a type no predictor knows is tens of times off: a new
    server's first agents of an unseen type, told 0.09-2.6 s for jobs of 0.03 s, set the
    scale at a fiftieth and the next agents were told 2 ms for 25 ms jobs. Their ratios
    enter no record; an agent of a predicted cost still does."""
    d = quiet()
    for i in range(2 * MIN_SEEN):
        view = d.register_agent(f"g{i}", 10_000.0, float(i), shape=AgentShape(1, 10), cost_guessed=True)
        assert d.agents[f"g{i}"].cost_guessed
        d.observe_jct(view.eta_s, view.eta_s / 50.0, f"g{i}")  # the guess 50x long
        d.finish_agent(f"g{i}", float(i))
    assert d.etas.calibration.seen == 0
    assert d.etas.calibration.scale(0) == pytest.approx(1.0)  # the prior: nothing learned
    view = d.register_agent("p", 10_000.0, 100.0, shape=AgentShape(1, 10))
    assert not d.agents["p"].cost_guessed
    d.observe_jct(view.eta_s, 2.0 * view.eta_s, "p")
    assert d.etas.calibration.seen == 1


def test_on_a_tuning_seed_the_eta_told_is_within_the_targets() -> None:
    # Poisson, seed 1: the replay's ETAs ran long (error p50 0.44, p90 0.78); scaled, 0.20 / 0.58
    row, = run_family([ShapeSpec("poisson", 48, 0.9, 1)], ["justitia"], get_profile("cpu-tiny"), 4096)
    assert row.eta_error_p50 is not None and row.eta_error_p90 is not None
    assert row.eta_error_p50 < 0.3 and row.eta_error_p90 < 0.65, row
    assert row.promises_kept == row.promises


def test_agents_are_scaled_by_agents_whose_etas_expected_pauses_as_their_own_did() -> None:
    """An ETA that expects pauses and one that does not fall short by different factors: after
    agents that paused, the next ones' ETAs expect pauses they may not take. Each kind keeps
    its own record in the context; a kind seen too little takes the context's."""
    cal = EtaCalibration()
    for _ in range(MIN_SEEN):
        cal.observe(1.0, 0.2, 0, pausing=True)  # ETAs that expected pauses not taken
        cal.observe(1.0, 1.0, 0)
    assert cal.scale(0) == pytest.approx(1.0) and cal.scale(0, pausing=True) == pytest.approx(0.2)
    for _ in range(MIN_SEEN - 1):
        cal.observe(1.0, 0.5, 3, pausing=True)
    cal.observe(1.0, 0.5, 3)
    assert cal.scale(3) == pytest.approx(0.5)  # one of its kind: the context's record

    d = quiet()
    for _ in range(MIN_SEEN):
        d.etas.calibration.observe(1.0, 0.2, 0, pausing=True)
        d.etas.calibration.observe(1.0, 1.0, 0)
    one_stage = d.register_agent("a", 10_000.0, 0.0, agent_type="chat", shape=AgentShape(1, 10))
    assert not d.agents["a"].eta_pausing and one_stage.eta_s == pytest.approx(d.eta_time("a", 0.0))
    d.finish_agent("a", 0.5)
    for k in range(16):  # the traffic pauses: an agent of three stages expects two pauses
        d.pauses.observe("chat", 2.0, 0.1 * k)
    d.register_agent("b", 10_000.0, 2.0, agent_type="chat", shape=AgentShape(3, 10))
    assert d.agents["b"].promise_context == 0 and d.agents["b"].eta_pausing
    assert d.agents["b"].eta_scale == pytest.approx(0.2)
    # its ratio is filed with its kind's: the scale of agents that expect no pause stays
    d.observe_jct(d.eta_time("b", 2.0), 4.0, "b")
    assert d.etas.calibration.scale(0) == pytest.approx(1.0)


def test_before_any_record_an_eta_that_expects_pauses_spans_its_tool_time() -> None:
    """A fresh server has no record of how far ETAs fall short. An agent whose ETA expects
    no pause is given the prior interval around it; one whose ETA expects pauses is told
    its tool time apart from its engine time (tool_time.py): two pauses ahead of it, every
    pause seen 2 s long, make 4 s in every outcome, and its engine time is off by the
    prior's ratios. Where its tool time is not known that way, an ETA that expects pauses
    has a wider prior interval than one that does not (its JCT holds its client's tool time)."""
    d = quiet()
    plain = d.register_agent("a", 10_000.0, 0.0, agent_type="chat", shape=AgentShape(1, 10))
    for k in range(16):  # the traffic pauses: an agent of three stages expects two pauses
        d.pauses.observe("chat", 2.0, 0.1 * k)
    pausing = d.register_agent("b", 10_000.0, 2.0, agent_type="chat", shape=AgentShape(3, 10))
    assert not d.agents["a"].eta_pausing and d.agents["b"].eta_pausing
    assert not d.agents["a"].eta_tools and d.agents["b"].eta_tools

    low, high = plain.eta_interval_s
    assert (low / plain.eta_s, high / plain.eta_s) == pytest.approx((PRIOR_LOW, PRIOR_HIGH))
    engine = d.agents["b"].eta_engine_s
    ratios = d.etas.calibration.engine_ratios(d.agents["b"].promise_context)
    low, high = pausing.eta_interval_s
    assert 4.0 + min(ratios) * engine <= low < pausing.eta_s < high <= 4.0 + max(ratios) * engine
    cal = EtaCalibration()
    assert cal.interval(0.0, 10.0, None, 0, pausing=True) == pytest.approx((10.0 * PRIOR_PAUSING_LOW,
                                                                             10.0 * PRIOR_PAUSING_HIGH))
    assert cal.interval(0.0, 10.0, None, 0) == pytest.approx((10.0 * PRIOR_LOW, 10.0 * PRIOR_HIGH))
