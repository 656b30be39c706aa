"""The tool time a promise allows (server/scheduler/pauses.py, promises.py): the longest pause
seen before one boundary ahead, and a calibrated deadline only while the traffic of the
moment shows it does not pause. Pure: no engine, no server."""

from __future__ import annotations

import pytest

from server.scheduler import AgentShape, Dispatcher, RequestSpec
from server.scheduler.pauses import PauseStats
from tests.support.dispatchers import quiet_for


def server(crossed_until: float | None = None, now: float = 0.0) -> Dispatcher:
    """A quiet server with one agent queued at `now`; with `crossed_until`, an agent of 17
    stages first crossed its 16 boundaries at once (over 15 s), the last at that time."""
    d = quiet_for(Dispatcher("justitia", 1000, 0.1))
    if crossed_until is not None:
        start = crossed_until - 16.0
        d.register_agent("w", 1_000.0, start, agent_type="react", shape=AgentShape(17, 10))
        for k in range(17):
            d.submit(RequestSpec(f"w{k}", "w", prompt_tokens=10, max_tokens=10), start + k)
            d.admit(start + k)
            d.on_request_finished(f"w{k}", 10, 10, start + k + 1)  # the next goes at once
        d.finish_agent("w", crossed_until + 1.0)
    d.register_agent("other", 30_000.0, now)
    d.submit(RequestSpec("o0", "other", prompt_tokens=10, max_tokens=10), now)
    return d


def test_one_long_pause_seen_is_allowed_before_a_boundary_ahead() -> None:
    """Pauses are heavy-tailed: an allowance of the p90 per boundary is outlasted by a single
    long tool call, the sum of several seldom outlasts their p90s."""
    stats = PauseStats()
    assert stats.allowance_s("react", 2, 1.0) == 0.0  # nothing seen: nothing allowed
    for _ in range(19):
        stats.observe("react", 0.5, 1.0)
    stats.observe("search", 8.0, 1.0)  # another type's: pauses belong to the application
    assert stats.allowance_s("react", 0, 1.0) == 0.0  # no boundary ahead
    assert stats.allowance_s("react", 1, 1.0) == pytest.approx(8.0)
    assert stats.allowance_s("react", 3, 1.0) == pytest.approx(8.0 + 2 * 0.5)
    # in a deadline: the worst case (the traffic pauses) carries the whole allowance
    quiet, paused = server(), server()
    for _ in range(19):
        paused.pauses.observe("react", 0.5)
    paused.pauses.observe("search", 8.0)
    a = quiet.register_agent("a", 10_000.0, 0.0, agent_type="react", shape=AgentShape(2, 10))
    b = paused.register_agent("a", 10_000.0, 0.0, agent_type="react", shape=AgentShape(2, 10))
    assert a.promise_assumes == ""  # the worst case, no pause seen: no tool time to assume
    # the worst case with tool time rests on the client's tool calls taking no longer
    assert b.promise_assumes == ("its client's tool time before its 1 later stage(s) takes at most 8 s in all: "
                                 "the longest pause seen (8 s) before one")
    assert b.deadline_s - a.deadline_s == pytest.approx(8.0)
    assert "no pause seen" not in a.promise_reason + b.promise_reason  # a fresh server's: see the docs


class _Paused:
    """What PauseStats reads of an agent whose pause is under way."""

    def __init__(self, agent_id: str) -> None:
        self.agent_id, self.agent_type, self.idle_since, self.tool = agent_id, "react", None, None


def test_the_allowance_counts_the_pauses_under_way_as_lasting_at_least_as_long_as_they_have() -> None:
    """Early in an episode the pauses that ended are the short ones: the long ones are still
    under way. They count as lasting at least as long as they have, in the longest pause and
    in the 90th percentile (Kaplan-Meier), and the record's words name the figures used."""
    stats = PauseStats()
    for k in range(4):
        stats.observe("react", 0.5, 1.0 + k)
    assert stats.allowance_s("react", 3, 10.0) == pytest.approx(0.5 + 2 * 0.5)  # the ended ones alone
    for k in range(6):  # six agents paused at 2 s, still paused at 10 s: at least 8 s each
        stats.pause_began(_Paused(f"p{k}"), 2.0)  # type: ignore[arg-type]
    longest, each = stats.allowance_parts("react", 10.0)
    assert longest == pytest.approx(8.0) and each == pytest.approx(8.0)
    assert stats.allowance_s("react", 3, 10.0) == pytest.approx(8.0 + 2 * 8.0)
    assert stats.allowance_words("react", 3, 24.0, 10.0) == (
        "its client's tool time before its 3 later stage(s) takes at most 24 s in all: the longest pause seen "
        "(8 s) before one, and the pauses' 90th percentile (8 s) before each of the 2 other(s)")
    for k in range(6):  # gone: they are no longer pauses
        stats.forget(f"p{k}")
    assert stats.allowance_s("react", 3, 11.0) == pytest.approx(1.5)


def test_boundaries_crossed_without_a_pause_speak_for_the_traffic_until_a_longer_silence() -> None:
    """Agents that crossed their stage boundaries at once say the traffic of the moment does
    not pause (a calibrated deadline, no tool time) only until the server has been silent
    for longer than they took to cross: after a lull, another application's agents may
    pause (a server whose agents never paused, idle 90 s, promised the first agents of
    `sessions` as if they would not)."""
    fresh = server(17.0, 19.0).register_agent("a", 10_000.0, 19.0, agent_type="react",
                                              shape=AgentShape(3, 10))
    assert fresh.promise_assumes  # calibrated: the tighter of it and the worst case
    # silent for 20 s after 16 boundaries crossed over 15 s
    stale = server(17.0, 37.0).register_agent("a", 10_000.0, 37.0, agent_type="react", shape=AgentShape(3, 10))
    assert stale.promise_assumes == "" and stale.deadline_s > fresh.deadline_s  # the worst case
    assert "no pause seen yet: the deadline allows no tool time before its 2 later" in stale.promise_reason
    assert stale.promise == "widened"
    one_stage = server(17.0, 37.0).register_agent("b", 10_000.0, 37.0, agent_type="react",
                                                  shape=AgentShape(1, 10))
    assert one_stage.promise_assumes  # no boundary ahead: nothing to pause before


def test_pauses_seen_in_another_episode_do_not_say_this_one_pauses() -> None:
    """A server taught by traffic whose agents paused at every boundary, then silent for
    90 s: the next traffic's boundaries crossed without a pause say it does not pause
    (the teacher's pauses are another application's), and a pause of its own says it does.
    Boundaries of the earlier episode crossed without a pause count as before."""
    taught = PauseStats()
    for k in range(16):  # the teacher: a pause at each of 16 boundaries, t = 0..15
        taught.observe("chat", 2.0, float(k))
    taught.observe("react", 0.0, 106.0)  # the episode that began at 105: two boundaries, no pause
    taught.observe("react", 0.0, 107.0)
    assert not taught.unpaused_lately(107.5)  # the teacher's pauses counted
    assert taught.unpaused_lately(107.5, since=105.0)
    taught.observe("react", 1.5, 108.0)  # one of its own pauses
    assert not taught.unpaused_lately(108.5, since=105.0)

    unpaused = PauseStats()
    for k in range(16):  # a teacher that never paused
        unpaused.observe("chat", 0.0, float(k))
    assert not unpaused.unpaused_lately(105.5, since=105.0)  # stale: nothing crossed since the lull
    unpaused.observe("react", 0.0, 106.0)
    assert unpaused.unpaused_lately(106.5, since=105.0)  # one boundary of its own, none paused


def test_a_calibrated_deadline_is_never_earlier_than_the_fair_share_finish() -> None:
    """An agent the policy serves ahead of its fair share (small, behind other small ones,
    beside large ones) has an ETA far inside its GPS finish; a deadline of the context's
    factor times that ETA counts on the policy's order holding while work still arrives,
    which the bound does not promise (live on Ray, a small agent registered during a burst
    with 3x its own work ahead was given 2.5x its ETA and finished at 4.1x, before its fair
    finish). The calibrated deadline is at least the fair-share finish."""
    from server.scheduler.tight_promise import CONTEXT_FLOORS, fair_share_s

    assert fair_share_s(10.0, 0.5, 100.0) == pytest.approx(20.0)  # arrivals all along: 10 / (1 - 0.5)
    assert fair_share_s(10.0, 0.5, 4.0) == pytest.approx(12.0)  # arrivals for 4 s only: 10 + 0.5 x 4
    assert fair_share_s(10.0, 0.0, 0.0) == pytest.approx(10.0)
    d = quiet_for(Dispatcher("justitia", 1000, 0.01))
    for k in range(10):
        d.register_agent(f"big{k}", 100_000.0, 0.0, shape=AgentShape(1, 10))
        d.submit(RequestSpec(f"big{k}/0", f"big{k}", prompt_tokens=10, max_tokens=10), 0.0)
    for k in range(3):
        d.register_agent(f"small{k}", 10_000.0, 0.0, shape=AgentShape(1, 10))
        d.submit(RequestSpec(f"small{k}/0", f"small{k}", prompt_tokens=10, max_tokens=10), 0.0)
    view = d.register_agent("s", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert d.agents["s"].promise_context == 3  # 3x its own work ahead
    assert view.fair_finish_s > CONTEXT_FLOORS[3] * view.eta_s  # GPS shares the rate with the large ones
    assert view.deadline_s >= view.fair_finish_s - 1e-9
    assert view.promise_assumes  # still the calibrated deadline, inside the worst case


def test_an_agent_that_paused_does_not_loosen_the_deadlines_of_its_context() -> None:
    """A calibrated deadline scales the ETA by how far the ETAs of agents in the same context
    fell short; it is given only to agents that are not expected to pause. An agent whose
    JCT holds its client's tool time says nothing of that: it counts in the intervals'
    record, not in its context's (a server taught by `sessions`, whose agents pause, gave the
    agents of `tenants` that followed 8.6x their JCT; 6.0x without)."""
    def finish(d: Dispatcher, agent_id: str, t: float, pause_s: float) -> None:
        d.register_agent(agent_id, 10_000.0, t, shape=AgentShape(2, 10))
        # the deadlines' record is of the replay's ETA its deadline scaled
        ratios.append((0.2 + pause_s) / d.agents[agent_id].eta_replay_s)
        d.submit(RequestSpec(f"{agent_id}/0", agent_id, prompt_tokens=10, max_tokens=10), t)
        d.admit(t)
        d.on_request_finished(f"{agent_id}/0", 10, 10, t + 0.1)
        d.submit(RequestSpec(f"{agent_id}/1", agent_id, prompt_tokens=10, max_tokens=10), t + 0.1 + pause_s)
        d.admit(t + 0.1 + pause_s)
        d.on_request_finished(f"{agent_id}/1", 10, 10, t + 0.2 + pause_s)
        d.observe_jct(0.2, 0.2 + pause_s, agent_id)  # 26x its ETA with the pause, 1x without
        d.finish_agent(agent_id, t + 0.2 + pause_s)

    paused, steady = Dispatcher("justitia", 1000, 0.01), Dispatcher("justitia", 1000, 0.01)
    ratios: list[float] = []
    for k in range(10):
        finish(steady, f"s{k}", 10.0 * k, 0.0)
    steady_ratios = list(ratios)
    for k in range(10):
        finish(paused, f"p{k}", 10.0 * k, 5.0)
    assert paused.etas.calibration.seen == steady.etas.calibration.seen == 10  # the intervals see both
    assert steady.etas.calibration.upper_ratio(1.0, 10, 0) == (pytest.approx(max(steady_ratios)), 10)
    assert paused.etas.calibration.upper_ratio(1.0, 10, 0) is None  # the context's record: none


def test_a_clients_turnaround_between_stages_is_not_a_pause() -> None:
    """A live client leaves a gap of milliseconds between a stage's last response and its
    next request. Counted as pauses, these gaps made every agent of several stages one that
    pauses: the worst-case deadline for all of them, and none in its context's record (live,
    the median deadline was 13x the JCT where the simulator, with no gaps, gave 5x). A gap
    under TURNAROUND_S is a boundary crossed at once; a longer one is a pause."""
    from server.scheduler.pauses import TURNAROUND_S

    def crossed(gap_s: float) -> tuple[Dispatcher, float]:
        d = quiet_for(Dispatcher("justitia", 1000, 0.1))
        d.register_agent("w", 1_000.0, 0.0, agent_type="react", shape=AgentShape(17, 10))
        t = 0.0
        for k in range(17):
            d.submit(RequestSpec(f"w{k}", "w", prompt_tokens=10, max_tokens=10), t)
            d.admit(t)
            t += 0.5
            d.on_request_finished(f"w{k}", 10, 10, t)
            t += gap_s  # the client's way back and in (or a tool call)
        d.observe_jct(0.5 * 17, t, "w")
        d.finish_agent("w", t)
        d.register_agent("other", 30_000.0, t)
        d.submit(RequestSpec("o0", "other", prompt_tokens=10, max_tokens=10), t)
        return d, t

    (turnaround, t_turn), (tool, t_tool) = crossed(0.4 * TURNAROUND_S), crossed(4.0 * TURNAROUND_S)
    summary = turnaround.pauses.summary()
    assert summary["turnarounds"] == 16 and summary["max_s"] == 0.0
    assert summary["turnaround_max_s"] == pytest.approx(0.4 * TURNAROUND_S)
    assert tool.pauses.summary()["turnarounds"] == 0 and tool.pauses.max_s() == pytest.approx(4.0 * TURNAROUND_S)
    a = turnaround.register_agent("a", 10_000.0, t_turn, agent_type="react", shape=AgentShape(3, 10))
    assert a.promise_assumes  # calibrated: the traffic does not pause
    b = tool.register_agent("b", 10_000.0, t_tool, agent_type="react", shape=AgentShape(3, 10))
    # the traffic pauses: the worst case, with the tool time it allows
    assert b.promise_assumes.startswith("its client's tool time before its 2 later stage(s) takes at most")
    assert "90th percentile" in b.promise_assumes and "deadline =" not in b.promise_assumes
    # the agent that crossed at once counts in its context's record, the one that paused not
    assert turnaround.etas.calibration.upper_ratio(1.0, 1, 0) is not None
    assert tool.etas.calibration.upper_ratio(1.0, 1, 0) is None
