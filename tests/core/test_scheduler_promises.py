"""Promises the scheduler can keep: ETAs by forward replay, the
settlement of the GPS reference, idle registrations, bound constants no other tenant can
widen, and the pessimistic, widened deadlines. Fast: the scheduler core only."""

from __future__ import annotations

import time

import pytest

from server.scheduler import AgentShape, BoundLimits, Dispatcher, RequestSpec, TauEstimator, kv_cost
from server.scheduler.eta import WorkArrivals, served_by
from server.scheduler.policies import POLICIES, closing_gap
from tests.support.dispatchers import quiet_for, worst_case_promises


def req(rid: str, agent: str, p: int, d: int) -> RequestSpec:
    return RequestSpec(rid, agent, prompt_tokens=p, max_tokens=d, expected_output_tokens=d)


# -- ETA by forward replay ---------------------------------------------------------------
def test_replay_eta_is_exact_on_a_simple_queue() -> None:
    # R = 10,000 per second, one step 0.1 s; no arrival allowance (tested below)
    d = Dispatcher("justitia", 1000, 0.1, arrival_window_s=0)
    d.register_agent("a", 20_000.0, 0.0)
    d.submit(req("a0", "a", 10, 10), 0.0)
    d.register_agent("b", 50_000.0, 0.0, shape=AgentShape(2, 100))
    d.submit(req("b0", "b", 10, 10), 0.0)
    d.register_agent("c", 5_000.0, 0.0, shape=AgentShape(3, 200))
    d.submit(req("c0", "c", 10, 10), 0.0)
    d.refresh_etas(0.0)
    # order by tag: c (5k), a (20k), b (50k)
    # c: nothing before; its own work 0.5 s, its critical path (200 + 3) steps = 20.3 s
    assert d.view("c", 0.0).eta_s == pytest.approx(20.3)
    # a: 5k before (0.5 s), then its longest decode (10 + 1 steps): max(2.5, 0.5 + 1.1)
    assert d.view("a", 0.0).eta_s == pytest.approx(2.5)
    # b: 25k before (2.5 s), then (100 + 2) steps: max(7.5, 2.5 + 10.2)
    assert d.view("b", 0.0).eta_s == pytest.approx(12.7)


def test_replay_eta_of_an_agent_registered_after_the_pass_is_its_place_in_it() -> None:
    d = Dispatcher("fcfs", 1000, 0.1, arrival_window_s=0)
    for i, cost in enumerate((10_000.0, 30_000.0)):
        d.register_agent(f"a{i}", cost, 0.0)
        d.submit(req(f"r{i}", f"a{i}", 10, 10), 0.0)
    d.refresh_etas(0.0)
    v = d.view(d.register_agent("late", 20_000.0, 0.0).agent_id, 0.0)
    assert v.eta_s == pytest.approx((10_000 + 30_000 + 20_000) / 10_000)  # fcfs: last in line
    d.refresh_etas(0.0)  # a full pass agrees (the new agent has no request yet: no path)
    assert d.view("late", 0.0).eta_s == pytest.approx(v.eta_s)


def test_a_burst_registered_between_two_passes_is_counted_in_each_others_etas() -> None:
    """`make demo` submits 18 agents at once, faster than ETA passes run: each got the ETA
    of an agent alone (0.0 s on the demo's table, JCTs of 0.5-1.7 s)."""
    d = Dispatcher("fcfs", 1000, 0.1, arrival_window_s=0)  # R = 10,000 per second
    etas = [d.register_agent(f"a{i}", 10_000.0, 0.0).eta_s for i in range(3)]
    assert etas == pytest.approx([1.0, 2.0, 3.0])  # fcfs: each behind the ones before
    d.finish_agent("a1", 0.0)  # gone: no longer ahead of anyone
    assert d.register_agent("late", 10_000.0, 0.0).eta_s == pytest.approx(3.0)
    d.refresh_etas(0.0)  # the pass agrees
    assert [d.view(a, 0.0).eta_s for a in ("a0", "a2", "late")] == pytest.approx([1.0, 2.0, 3.0])
    j = Dispatcher("justitia", 1000, 0.1, arrival_window_s=0)
    j.register_agent("big", 30_000.0, 0.0)
    assert j.register_agent("small", 10_000.0, 0.0).eta_s == pytest.approx(1.0)  # ahead of big


def test_replay_eta_counts_the_work_that_will_arrive_ahead() -> None:
    d = Dispatcher("justitia", 1000, 0.1)  # R = 10,000 per second
    # a stream of small agents over 20 s: 2,000 units each, one per second
    for i in range(20):
        d.register_agent(f"s{i}", 2_000.0, float(i))
        d.finish_agent(f"s{i}", float(i))
    d.register_agent("big", 100_000.0, 20.0)
    d.submit(req("b0", "big", 10, 10), 20.0)
    d.refresh_etas(20.0)
    # 140,000 units registered over 20 s (big's own included): 7,000 per second, of which
    # the small agents' 2,000 per second are below big's gap (100,000, less half of what V
    # closes over the 20 s: 8,700) and go ahead of it, so big is left 8,000 per second: its
    # 100,000 take 12.5 s
    assert d.arrivals.rate == pytest.approx(7_000.0)
    assert d.view("big", 20.0).eta_s == pytest.approx(100_000 / 8_000)


def test_the_gap_a_newcomer_must_stay_below_closes_as_v_advances() -> None:
    """A newcomer goes ahead of j if V(t) + c < F_j; over the arrivals' span V closes the gap
    G = F_j - V by `closing`: the mean gap is G - closing / 2 while V stays below F_j, and
    G^2 / (2 closing) once V reaches F_j within the span (later newcomers go behind)."""
    assert closing_gap(100.0, 0.0) == 100.0  # arrivals that end now see the whole gap
    assert closing_gap(100.0, 40.0) == pytest.approx(80.0)
    assert closing_gap(100.0, 100.0) == pytest.approx(50.0)  # both forms agree at the seam
    assert closing_gap(100.0, 400.0) == pytest.approx(100.0 * 100.0 / 800.0)
    assert closing_gap(-5.0, 10.0) == 0.0  # V already past F_j: nothing goes ahead
    d = Dispatcher("justitia", 1000, 0.1)
    d.register_agent("j", 100.0, 0.0)
    agent = d.agents["j"]
    g = agent.virtual_finish  # V = 0
    assert POLICIES["justitia"].arrival_gap(agent, 0.0, 40.0) == pytest.approx(g - 20.0)
    assert POLICIES["sjf"].arrival_gap(agent, 0.0, 40.0) == 100.0  # a cost gap: V does not close it


def test_a_bursts_newcomers_count_against_the_whole_gap_of_a_long_wait() -> None:
    """While 40 large agents share GPS, V crawls: the newcomers of the next two seconds meet
    a gap of nearly F_j - V. Halving the gap for the wait would let none of them ahead of
    `big`: simulated, a burst after another burst is told ETAs 0.38 of its JCT off at the
    median with the half gap, 0.17 with the closing one."""
    d = Dispatcher("justitia", 1000, 0.1)  # R = 10,000 per second
    for i in range(40):
        d.register_agent(f"w{i}", 1e6, 0.01 * i)
        d.submit(req(f"w{i}r", f"w{i}", 10, 10), 0.01 * i)
    for i in range(4):
        d.register_agent(f"s{i}", 60_000.0, 0.4 + 0.05 * i)
        d.submit(req(f"s{i}r", f"s{i}", 10, 10), 0.4 + 0.05 * i)
    d.register_agent("big", 100_000.0, 0.6)
    d.submit(req("b0", "big", 10, 10), 0.6)
    d.refresh_etas(0.6)
    v = d.clock.peek(0.6).V
    gap = d.agents["big"].virtual_finish - v
    assert 60_000.0 > gap / 2  # the newcomers like s* cost more than half the gap
    assert closing_gap(gap, d.etas.gap_closing(d.clock.backlog)) > 60_000.0  # but less than the mean gap
    known = 4 * 60_000.0 + 100_000.0  # the s* agents are ahead, then big's own
    span, arriving = d.arrivals.span_s, d.arrivals.ahead(60_001.0)
    assert arriving > 0.9 * 10_000  # capped while it lasts, then counted whole
    assert d.view("big", 0.6).eta_s == pytest.approx((known + arriving * span) / 10_000)
    assert d.view("big", 0.6).eta_s > known / 10_000 + 20.0  # the half gap gave known / R


def test_an_eta_reads_a_young_burst_at_its_rate() -> None:
    """Over a floor of 10 s, the first second of a burst read as a tenth of its rate and
    the ETAs of its agents came out short; the floor is 2 s, as for promises."""
    w = WorkArrivals(window_s=60.0)
    for t in (0.0, 0.5, 1.0):
        w.add(t, 1000.0)
    w.freeze(1.0)
    assert w.rate == pytest.approx(3000.0 / 2.0) and w.span_s == pytest.approx(2.0)
    w.freeze(5.0)  # past the floor: the history there is
    assert w.rate == pytest.approx(3000.0 / 5.0) and w.span_s == pytest.approx(5.0)


def test_an_eta_expects_a_long_stream_to_go_on_for_as_long_as_it_has_lasted() -> None:
    """A stream that has run for five minutes is expected to run through the wait of an agent
    deep in its queue: the span arrivals are assumed over is the episode's age, up to the long
    window, at the rate of the last minute (capped at that minute, the ETAs of large agents
    waiting hundreds of seconds counted a sixth of the arrivals that went ahead of them)."""
    w = WorkArrivals(window_s=60.0, long_window_s=600.0)
    for i in range(301):
        w.add(float(i), 100.0)  # one agent a second, for 300 s
    w.freeze(300.0)
    assert w.rate == pytest.approx(100.0 * 61 / 60.0, rel=0.02)  # the last minute's rate
    assert w.span_s == pytest.approx(300.0)  # the stream's age, not the minute
    # 20,000 units of work ahead at 200 a second, with 100 a second arriving ahead: arrivals
    # for the whole 200 s the wait lasts, not 60 of them
    assert served_by(20_000.0, 200.0, 100.0, w.span_s) == pytest.approx(200.0)
    assert served_by(20_000.0, 200.0, 100.0, 60.0) == pytest.approx(130.0)
    for i in range(301, 701):
        w.add(float(i), 100.0)
    w.freeze(700.0)  # a stream older than the long window: the span is that window
    assert w.span_s == pytest.approx(600.0)


def test_work_arrivals_rate_and_shares() -> None:
    w = WorkArrivals(window_s=60.0)
    for t, c in ((0.0, 100.0), (5.0, 300.0), (10.0, 600.0)):
        w.add(t, c)
    w.freeze(20.0)
    assert w.rate == pytest.approx(1000.0 / 20.0)
    assert w.ahead(400.0) == pytest.approx(50.0 * 400.0 / 1000.0)  # 100 + 300 go ahead
    assert w.fluid_ahead(400.0) == pytest.approx(50.0 * (100 + 300 + 400) / 1000.0)  # min(c, gap)
    assert w.ahead(0.0) == 0.0


def test_the_arrival_curve_is_the_densest_stretch_of_each_length() -> None:
    """`peak_work`: a stream of 100 units a second for 16 s, then a burst of ten in 0.45 s:
    the burst is the densest stretch over short windows, the stream over windows of 10 s on."""
    w = WorkArrivals(window_s=60.0)
    for i in range(16):
        w.add(float(i), 100.0)
    burst(w, 30.0, 10)
    w.freeze(31.0)
    assert w.peak_work(0.5) == pytest.approx(1000.0)
    assert w.peak_work(0.2) == pytest.approx(500.0)  # 30.0 to 30.2: five of the ten
    assert w.peak_work(10.0) == pytest.approx(1100.0)  # eleven of the stream's (0 to 10 s) beat it
    assert w.peak_work(15.0) == pytest.approx(1600.0)  # the stream's 16, 0 to 15 s
    assert w.peak_work(100.0) == pytest.approx(2600.0)  # the whole history
    # a denser burst, measured at the next freeze (a length asked is cached until then)
    burst(w, 40.0, 20, gap=0.01)
    assert w.peak_work(0.5) == pytest.approx(1000.0)
    w.freeze(41.0)
    assert w.peak_work(0.5) == pytest.approx(2000.0)
    # the share of it that goes ahead of an agent GPS finishes after V advances `gap`
    assert w.share_ahead(50.0) == pytest.approx(0.5)
    assert w.share_ahead(100.0) == pytest.approx(1.0)
    assert w.share_ahead(0.0) == 0.0
    assert WorkArrivals().peak_work(1.0) == 0.0  # no history: nothing seen arrive


def test_the_densest_finish_is_the_fixed_point_of_the_arrival_curve() -> None:
    from server.scheduler.tight_promise import densest_finish_s

    # a burst of 300 units seen, at 100 a second: 1 s of its own and 3 of the burst's
    assert densest_finish_s(1.0, lambda window: 300.0, 100.0) == pytest.approx(4.0)
    # a stream at half the rate: the agent is served at the other half, F = 1 / (1 - 0.5)
    assert densest_finish_s(1.0, lambda window: 50.0 * window, 100.0) == pytest.approx(2.0)
    # never sooner than the agent's own service, and nothing to serve is no time
    assert densest_finish_s(1.0, lambda window: 0.0, 100.0) == pytest.approx(1.0)
    assert densest_finish_s(0.0, lambda window: 300.0, 100.0) == 0.0
    # arrivals as dense as the engine: no fixed point, a finite answer past every window read
    assert densest_finish_s(1.0, lambda window: 100.0 * window, 100.0) > 1e3


def burst(w: WorkArrivals, start: float, n: int, gap: float = 0.05) -> None:
    """`n` registrations of 100 units, `gap` seconds apart from `start` on."""
    for i in range(n):
        w.add(start + gap * i, 100.0)


def test_a_burst_after_a_lull_is_measured_from_its_own_start() -> None:
    """A server that served a burst long ago reads a new burst as a fresh server would: over
    the whole window, the new one's rate would be a sliver of itself and its ETAs short."""
    fresh, taught = WorkArrivals(window_s=60.0), WorkArrivals(window_s=60.0)
    burst(taught, 0.0, 5)  # smaller than the new one: nothing more is expected of it
    burst(fresh, 200.0, 10)
    burst(taught, 200.0, 10)  # 199.8 s after the last arrival: more than a window
    for w in (fresh, taught):
        w.freeze(200.5)
    assert taught.rate == pytest.approx(fresh.rate) == pytest.approx(1000.0 / 2.0)  # the 2 s floor
    assert taught.span_s == fresh.span_s == 2.0
    assert taught.history_s(200.5) == pytest.approx(0.5)  # a young burst: its promises widen
    # a gap shorter than the window is traffic, not a lull: one episode from t = 0
    steady = WorkArrivals(window_s=60.0)
    burst(steady, 0.0, 10)
    burst(steady, 40.0, 10)
    steady.freeze(40.5)
    assert steady.history_s(40.5) == pytest.approx(40.5)
    assert steady.rate == pytest.approx(2000.0 / 40.5)


def test_a_batch_submitted_at_once_after_a_lull_expects_its_rest_from_its_first_arrival() -> None:
    """Batches of agents submitted at one instant are episodes of no length: the next one's
    rest is expected at its first arrival, and an arrival that begins an episode can be
    measured with it before its own promise (`open_episode`)."""
    w = WorkArrivals(window_s=60.0)
    burst(w, 0.0, 10, gap=0.0)
    burst(w, 100.0, 10, gap=0.0)
    w.freeze(110.0)
    assert w.open_episode(200.0)  # 100 s after the last arrival: a lull, a new episode
    assert not w.open_episode(200.0)  # once
    assert w.rate * w.span_s == pytest.approx(1000.0)  # a typical batch, its first agent's included
    assert w.span_s == pytest.approx(2.0)
    w.add(200.0, 100.0)
    assert w.rate * w.span_s == pytest.approx(900.0)  # the nine others of a typical batch
    w.add(200.0, 100.0)  # at the same instant: the episode goes on
    assert w.history_s(200.0) == pytest.approx(0.0)


def test_the_first_agent_of_a_batch_after_a_lull_is_promised_with_the_batch_ahead() -> None:
    """The 300-agent mix submits batches of 5-22 agents at once, 69 s apart; the first agent
    of a batch was promised with what the last refresh had measured of the lull, its
    deadline a calibrated one as if nothing would arrive, and the smaller agents of its own
    batch, registered an instant later, went ahead of it (4 of 300 promises broken)."""
    d = Dispatcher("justitia", 1000, 0.1)  # R = 10,000 a second
    for b, t in enumerate((0.0, 100.0)):
        for i in range(10):
            d.register_agent(f"b{b}-{i}", 2_000.0, t)
        for i in range(10):
            d.finish_agent(f"b{b}-{i}", t + 10.0)
        d.refresh_etas(t + 10.0)
    v = d.register_agent("first", 20_000.0, 200.0)
    # its batch's 20,000 units go ahead of it: 4 s of work with its own 20,000 at best
    assert v.deadline_s >= 2 * (20_000.0 + 20_000.0) / 10_000.0
    assert v.promise == "widened" and "arrivals measured over 0.0 s" in v.promise_reason


def test_a_burst_after_a_lull_is_expected_to_be_like_the_ones_before() -> None:
    """A server that has seen a burst of 48 agents expects the rest of the next one from its
    first registration on, where the measured rate projects only what has come so far."""
    taught = WorkArrivals(window_s=60.0)
    burst(taught, 0.0, 48)
    taught.add(300.0, 100.0)  # a new episode: measured at once, without waiting for a refresh
    assert taught.rate * taught.span_s == pytest.approx(4700.0)  # the 47 others of a typical burst
    assert taught.span_s == pytest.approx(2.35)  # over a typical burst's length
    for i in range(1, 48):
        taught.add(300.0 + 0.05 * i, 100.0)
    taught.freeze(302.4)  # the burst has come: back to the measured rate
    assert taught.rate == pytest.approx(4800.0 / 2.4)
    fresh = WorkArrivals(window_s=60.0)
    fresh.add(0.0, 100.0)
    fresh.freeze(0.0)
    assert fresh.rate * fresh.span_s == pytest.approx(100.0)  # no episode seen: what has come


def test_only_an_episode_that_came_faster_than_the_engine_serves_is_expected_again() -> None:
    """A stream of 48 agents over 47 s (100 units each, about 100 a second) the engine
    served as it came (at 150 a second) is no burst: the next episode's first agent expects
    only what has come, as on a fresh server; projected over the stream's length, the rest
    of a stream would lengthen every early ETA (the family's members taught by another
    shape). On an engine of 50 a second the same episode came faster than it was served:
    the rest of it is expected."""
    def taught_by_a_stream(service_rate: float) -> WorkArrivals:
        w = WorkArrivals(window_s=60.0)
        burst(w, 0.0, 48, gap=1.0)
        w.freeze(47.0, service_rate)
        w.add(200.0, 100.0)  # a new episode
        return w

    kept_up = taught_by_a_stream(150.0)
    assert kept_up.episodes == 1
    assert kept_up.rate * kept_up.span_s == pytest.approx(100.0)  # what has come
    outpaced = taught_by_a_stream(50.0)
    assert outpaced.rate * outpaced.span_s == pytest.approx(4700.0)  # the 47 others
    assert outpaced.span_s == pytest.approx(47.0)


def test_a_server_empty_four_times_an_episodes_length_ends_it() -> None:
    """A burst of 2.35 s, then the next: a new episode where the server sat empty for four
    times the burst's length (2 s at least), expected like the first; the same while an
    agent was still in the system, or empty for less, is traffic. A stream that went on for
    20 s keeps its episode through 50 s empty; a whole window without arrivals ends any."""
    def after(length: float, gap: float, idle_since: float | None) -> WorkArrivals:
        w = WorkArrivals(window_s=60.0)
        burst(w, 0.0, 48, gap=length / 47)
        w.open_episode(length + gap, idle_since)
        w.add(length + gap, 100.0)
        return w

    drained = after(2.35, 10.0, idle_since=2.35 + 0.5)  # empty for 9.5 s > 4 x 2.35 s
    assert drained.episodes == 1 and drained.history_s(12.35) == pytest.approx(0.0)
    assert drained.rate * drained.span_s == pytest.approx(4700.0)  # the 47 others of the burst
    assert after(2.35, 10.0, idle_since=None).episodes == 0  # an agent still in the system
    assert after(2.35, 10.0, idle_since=2.35 + 1.0).episodes == 0  # empty for 9 s
    assert after(0.0, 2.5, idle_since=0.3).episodes == 1  # a batch at once: 2 s at least
    assert after(0.0, 2.5, idle_since=0.6).episodes == 0
    assert after(20.0, 50.0, idle_since=20.0).episodes == 0  # a stream: 50 s < 4 x 20 s
    assert after(20.0, 61.0, idle_since=None).episodes == 1  # a whole window


def test_an_episode_ends_where_the_server_drained_not_between_agents_one_after_another() -> None:
    """Through the dispatcher: agents submitted one after another as the last one ends are
    one episode; a burst after the server sat empty long enough begins one."""
    d = Dispatcher("justitia", 1000, 0.1)
    now = 0.0
    for i in range(5):  # one at a time, each 3 s long
        d.register_agent(f"s{i}", 1_000.0, now)
        now += 3.0
        d.finish_agent(f"s{i}", now)
    assert d.arrivals.episodes == 0  # the server never sat empty: one stream
    d.register_agent("late", 1_000.0, now + 20.0)  # 20 s empty < 4 x 12 s, the stream's length
    assert d.arrivals.episodes == 0
    b = Dispatcher("justitia", 1000, 0.1)
    for burst_start in (0.0, 10.0):  # bursts of 0.1 s, drained at +1 s, then 9 s empty (> 2 s)
        for i in range(3):
            b.register_agent(f"b{burst_start}-{i}", 1_000.0, burst_start + 0.05 * i)
        for i in range(3):
            b.finish_agent(f"b{burst_start}-{i}", burst_start + 1.0)
    assert b.arrivals.episodes == 1 and b.arrivals.history_s(10.1) == pytest.approx(0.1)
    b.register_agent("held", 1_000.0, 11.5)  # one stays: the next burst is the same episode
    b.register_agent("next", 1_000.0, 20.0)
    assert b.arrivals.episodes == 1


def test_a_burst_begins_after_a_gap_far_longer_than_the_episodes_typical_one() -> None:
    """Eight arrivals 0.05 s apart, then 3 s without any (the server still busy: one
    episode): the next arrival begins a burst, and the ones after it count from it. A gap
    of 0.5 s (10x the typical) begins none, nor does any before four gaps were measured, nor
    one under BURST_MIN_GAP_S however long against a batch's gaps of 0."""
    from server.scheduler.eta import BURST_MIN_GAP_S

    w = WorkArrivals(window_s=60.0)
    assert w.burst_rank(0.0) is None  # nothing arrived
    burst(w, 0.0, 8, gap=0.05)
    assert w.burst_rank(0.4) is None  # the same stream
    assert w.burst_rank(0.35 + 0.5) is None  # 10x the typical gap
    assert w.burst_rank(3.35) == 0  # it begins one
    for k in range(3):
        w.add(3.35 + 0.05 * k, 100.0)
    assert w.burst_rank(3.5) == 3  # three arrived since it began
    young = WorkArrivals(window_s=60.0)
    burst(young, 0.0, 3, gap=0.05)
    assert young.burst_rank(5.0) is None  # two gaps then this one: too few to tell
    batch = WorkArrivals(window_s=60.0)
    burst(batch, 0.0, 8, gap=0.0)
    assert batch.burst_rank(0.9 * BURST_MIN_GAP_S) is None
    assert batch.burst_rank(BURST_MIN_GAP_S) == 0
    # a new episode (a whole window later) measures its gaps afresh
    assert w.open_episode(100.0) and w.burst_rank(100.0) is None


@pytest.mark.slow
def test_refresh_is_one_pass_and_views_read_its_cache() -> None:
    """ETA upkeep is O(N log N) per pass, and views are O(1) (a view that walked every agent
    would make GET /v1/agents O(N^2))."""
    n = 10_000
    d = Dispatcher("justitia", 10**7, 0.025)
    for i in range(n):  # each new tag is the smallest: registration's projection walks none
        d.register_agent(f"a{i}", 10_000.0 + n - i, 0.0)  # above its request: no over-run
        d.submit(req(f"r{i}", f"a{i}", 100, 50), 0.0)
    calls = 0
    static_key = d.policy.static_key

    def counting(agent):
        nonlocal calls
        calls += 1
        return static_key(agent)

    object.__setattr__(d.policy, "static_key", counting)  # the bound instance, this test only
    t0 = time.perf_counter()
    d.refresh_etas(0.001)
    refresh_s = time.perf_counter() - t0
    assert calls == n
    calls = 0
    t0 = time.perf_counter()
    etas = [d.view(f"a{i}", 0.002).eta_s for i in range(0, n, 10)]
    views_s = time.perf_counter() - t0
    assert calls == 0  # cached: no walk over the other agents
    assert etas == sorted(etas, reverse=True)  # tag order is cost order here
    # generous wall-clock limits (the machine is shared): ~20-60 ms and ~5 ms measured
    assert refresh_s < 2.0 and views_s < 1.0


# -- settlement and idle registrations ------------------------------------------------------
def test_unused_charge_leaves_the_backlog_when_an_agent_finishes_early() -> None:
    d = Dispatcher("justitia", 1000, 0.1)  # R = 10,000 per second
    d.register_agent("a", 50_000.0, 0.0)
    d.submit(req("a0", "a", 10, 10), 0.0)
    d.register_agent("b", 50_000.0, 0.0)
    d.submit(req("b0", "b", 10, 10), 0.0)
    d.admit(0.0)
    used = kv_cost(10, 10)
    d.on_request_finished("a0", 10, 10, 1.0)
    d.finish_agent("a", 1.0)  # used 155 of its 50,000
    # at t=1 V = 5,000: a's settled tag (155) is behind V, so a leaves B; b alone has
    # 45,000 left at the full rate
    assert d.clock.backlog == 1
    assert d.view("b", 1.0).fair_finish_s == pytest.approx(1.0 + 45_000 / 10_000)
    assert used < 50_000


def test_no_phantom_backlog_once_the_real_system_is_idle() -> None:
    d = Dispatcher("justitia", 1000, 0.1)
    for i in range(5):
        d.register_agent(f"a{i}", 40_000.0, 0.0)  # over-predicted: each uses 155
        d.submit(req(f"r{i}", f"a{i}", 10, 10), 0.0)
    for spec in d.admit(0.0):
        d.on_request_finished(spec.request_id, 10, 10, 0.2)
    for i in range(5):
        d.finish_agent(f"a{i}", 0.2)
    assert d.is_idle()
    assert d.clock.backlog == 0  # no agent left backlogged, V running on


def test_expired_agent_with_running_work_is_settled() -> None:
    d = Dispatcher("justitia", 1000, 0.1)
    d.register_agent("a", 50_000.0, 0.0)
    d.submit(req("a0", "a", 10, 10), 0.0)
    d.register_agent("b", 50_000.0, 0.0)
    d.submit(req("b0", "b", 10, 10), 0.0)
    d.admit(0.0)
    assert d.cancel_agent("a", 1.0) == ["a0"]  # expired or cancelled: its charge is unused
    assert d.clock.backlog == 1
    assert d.view("b", 1.0).fair_finish_s == pytest.approx(1.0 + 45_000 / 10_000)


def test_idle_registrations_do_not_slow_the_virtual_clock() -> None:
    def fair_finish_of_x(idle: int) -> float:
        d = Dispatcher("justitia", 1000, 0.1)
        for i in range(idle):
            d.register_agent(f"idle{i}", 50_000.0, 0.0, tenant="squatter")  # never send a request
        d.register_agent("x", 20_000.0, 1.0, tenant="other")
        d.submit(req("x0", "x", 10, 10), 1.0)
        return d.view("x", 1.0).fair_finish_s

    assert fair_finish_of_x(1000) == pytest.approx(fair_finish_of_x(0)) == pytest.approx(2.0)


def test_an_agent_enters_the_reference_with_its_first_request() -> None:
    d = Dispatcher("justitia", 1000, 0.1)
    d.register_agent("a", 10_000.0, 0.0)
    d.register_agent("b", 10_000.0, 0.0)
    d.submit(req("b0", "b", 10, 10), 0.0)
    assert d.clock.backlog == 1
    d.submit(req("a0", "a", 10, 10), 5.0)  # a waited 5 s: its tag starts from V(5)
    assert d.agents["a"].virtual_finish == pytest.approx(d.clock.V + 10_000.0)
    assert d.view("a", 5.0).deadline_s > 5.0  # its own wait moved its deadline


# -- bound constants no other tenant can widen -----------------------------------------------
def test_a_huge_declaration_widens_only_its_own_tenants_bounds() -> None:
    d = Dispatcher("justitia", 1000, 0.1)
    d.register_agent("w", 50_000.0, 0.0, tenant="B")
    d.submit(req("w0", "w", 100, 100), 0.0)
    before = d.register_agent("x", 20_000.0, 0.0, tenant="B").delay_bound_s
    d.register_agent("huge", 1e18, 0.0, tenant="A")
    after = d.register_agent("y", 20_000.0, 0.0, tenant="B")
    assert after.delay_bound_s == pytest.approx(before)
    assert after.bound.lag_s < 100.0
    # the declaring tenant's own later agents are promised against its declaration
    assert d.register_agent("z", 20_000.0, 0.0, tenant="A").bound.lag_s > 1e12
    d.cancel_agent("huge", 1.0)
    assert d.register_agent("v", 20_000.0, 1.0, tenant="B").delay_bound_s == pytest.approx(before)


def test_real_work_sets_c_max_for_its_own_tenant() -> None:
    d = Dispatcher("justitia", 1000, 0.1)
    d.register_agent("big", 10.0, 0.0, tenant="A")  # under-declared...
    for i in range(4):
        d.submit(req(f"b{i}", "big", 500, 500), 0.0)  # ...but real requests are work
    real = 4 * kv_cost(500, 500)
    # its own tenant's agents are promised against it
    assert d.register_agent("y", 1_000.0, 0.0, tenant="A").bound.lag_s == pytest.approx(
        (2 * kv_cost(500, 500) + real) / 10_000)
    # another tenant's: against its requests (they may block it), not its agent's total,
    # which under the hierarchical fair share takes A's share only
    lag = d.register_agent("x", 1_000.0, 0.0, tenant="B").bound.lag_s
    assert lag == pytest.approx((2 * kv_cost(500, 500) + 1_000.0) / 10_000)


# -- deadlines that hold ----------------------------------------------------------------------
def test_deadline_uses_the_pessimistic_rate_and_iteration_time() -> None:
    d = worst_case_promises(quiet_for(Dispatcher("justitia", 1000, 0.1)))
    firm = d.register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert firm.promise == "firm"
    d2 = worst_case_promises(quiet_for(Dispatcher("justitia", 1000, 0.1)))
    d2.set_iteration_time(0.1, 0.0, bound_tau=0.2, bound_iteration_s=0.3)
    v = d2.register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    # the fluid part at half the rate (2 s instead of 1 s), the bound's steps at 0.3 s
    assert v.fair_finish_s == pytest.approx(1.0)
    assert v.bound.critical_path_s == pytest.approx(11 * 0.3)
    assert v.deadline_s == pytest.approx(2.0 + v.delay_bound_s)
    assert v.deadline_s > firm.deadline_s


def test_promises_say_when_they_are_widened_and_why() -> None:
    d = Dispatcher("justitia", 1000, 0.1)
    d.set_iteration_time(0.1, 0.0, bound_tau=0.3, uncertainty="the engine's rate is not measured yet")
    v = d.register_agent("a", 10_000.0, 0.0)
    assert v.promise == "widened" and "not measured" in v.promise_reason
    # work arriving faster than the engine serves it: no finite promise at that load
    d = Dispatcher("justitia", 1000, 0.1)
    for i in range(20):
        d.register_agent(f"s{i}", 20_000.0, float(i))  # 20,000 per second against R = 10,000
    d.refresh_etas(20.0)
    v = d.register_agent("late", 50_000.0, 20.0)
    assert v.promise == "widened" and "arrives at" in v.promise_reason
    assert Dispatcher("fcfs", 1000, 0.1).register_agent("f", 1.0, 0.0).promise == "none"


def test_tau_estimator_is_pessimistic_and_widens_while_cold() -> None:
    est = TauEstimator(kv_capacity_tokens=1000, initial_tau_s=0.01)
    cold = est.promise_times()
    assert cold["uncertainty"] and cold["bound_tau"] == pytest.approx(0.03)
    for i in range(100):  # steps of 10 ms, one in ten of 50 ms, cache full
        est.observe_step(0.05 if i % 10 == 9 else 0.01, kv_in_use=900)
    warm = est.promise_times()
    assert warm["uncertainty"] is None
    assert warm["typical_iteration_s"] == pytest.approx(0.01)
    assert warm["bound_iteration_s"] >= 0.01 and warm["bound_tau"] >= est.tau_s
    for _ in range(64):  # a slow stretch: the rate a promise counts on is that stretch's
        est.observe_step(0.03, kv_in_use=900)
    slow = est.promise_times()["bound_tau"]
    assert slow == pytest.approx(0.03) and slow > est.tau_s
    d = quiet_for(Dispatcher("justitia", 1000, 0.01))
    d.set_iteration_time(est.tau_s, 1.0, **warm)
    assert d.register_agent("a", 1_000.0, 1.0).promise == "firm"


def test_tau_is_the_sustained_rate_not_a_mean_dominated_by_prefill_steps() -> None:
    """A mean of samples would read tau 0.08-0.30 s for 10 ms engine steps. Nine decode steps
    of 10 ms with the cache in use as filled, and one prefill step of 90 ms with a tenth of
    it in use: a full cache serves 9 + 0.1 iterations' worth in 0.18 s."""
    est = TauEstimator(kv_capacity_tokens=1000, initial_tau_s=0.01, half_life_s=1e9, prior_iterations=0)
    for _ in range(50):
        for _ in range(9):
            est.observe_step(0.01, kv_in_use=1000)
        est.observe_step(0.09, kv_in_use=100, kv_reserved=1000)
    assert est.tau_s == pytest.approx(0.18 / 9.1, rel=1e-3)  # a mean of the samples: 0.455 s


def test_the_critical_path_uses_the_time_model() -> None:
    class Steps:  # the server's fitted model names it step_s (EngineProfile: iteration_s)
        def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
            return 0.01

    d = Dispatcher("justitia", 1000, 0.1, arrival_window_s=0, time_model=Steps())
    d.register_agent("a", 100.0, 0.0, shape=AgentShape(2, 98))
    d.submit(req("a0", "a", 10, 10), 0.0)
    d.refresh_etas(0.0)
    # (98 + 2) steps of 10 ms, not of tau = 0.1 s
    assert d.view("a", 0.0).eta_s == pytest.approx(1.0)


def test_etas_divide_by_what_the_engine_sustains_not_a_burst_start_prefill() -> None:
    """At a burst's start every agent prefills its first prompt at once and the measured R
    reads a fraction of what the engine sustains (live: 0.94M against 1.6M units a second);
    ETAs divide by the time model's rate on the mix where that is faster."""
    class Steps:
        def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
            return 0.001 + 0.0001 * decode_seqs

    d = Dispatcher("justitia", 1000, 0.1, arrival_window_s=0, time_model=Steps())  # measured R = 10,000
    assert d.eta_rate == d.rate  # no request seen: no mix to sustain
    d.register_agent("a", 50_000.0, 0.0)
    d.submit(req("a0", "a", 150, 50), 0.0)  # p + d = 200 reserved, p + d/2 = 175 held on average
    batch = 1000 / 200
    tau = 1000 * (0.001 + 0.0001 * batch) / (batch * 175)
    assert d.eta_rate == pytest.approx(1000 / tau) and d.eta_rate > 10 * d.rate
    d.refresh_etas(0.0)
    assert d.view("a", 0.0).eta_s == pytest.approx(max(50_000 / d.eta_rate, 51 * 0.0015))
    d.set_iteration_time(1e-5, 0.0)  # measured faster than the model: the measurement stands
    assert d.eta_rate == d.rate == pytest.approx(1000 / 1e-5)
    d.set_iteration_time(0.1, 0.0)
    d.set_time_model(Steps(), sustains=False)  # a model of another engine: it times paths only
    assert d.eta_rate == d.rate


def test_an_etas_critical_path_counts_the_prefill_of_the_prompts_the_agent_computes() -> None:
    """A burst's small verification agents are mostly prefill (one stage of 2,540- and
    2,386-token prompts with 4-60 output tokens): the decode steps of their path alone gave
    them a fifth of their JCT. The path now adds its declared prompt tokens at the time
    model's cost of one more prefill token, in the pass and in a view between passes."""
    class Steps:
        def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
            return 0.01 + 0.0001 * prefill_tokens

    def eta(shape: AgentShape, refresh: bool) -> float:
        d = Dispatcher("justitia", 1_000_000, 0.1, arrival_window_s=0, time_model=Steps())
        d.register_agent("a", 1_000.0, 0.0, shape=shape)
        if refresh:
            d.refresh_etas(0.0)
        return d.view("a", 0.0).eta_s

    for refresh in (True, False):
        decode_only = eta(AgentShape(1, 60), refresh)
        assert decode_only == pytest.approx(61 * 0.01)  # the path dominates a tiny cost
        assert eta(AgentShape(1, 60, 5_000), refresh) == pytest.approx(decode_only + 5_000 * 0.0001)
        assert eta(AgentShape(1, 60, 0), refresh) == pytest.approx(decode_only)
    no_model = Dispatcher("justitia", 1_000_000, 0.1, arrival_window_s=0)
    no_model.register_agent("a", 1_000.0, 0.0, shape=AgentShape(1, 60, 5_000))
    assert no_model.view("a", 0.0).eta_s == pytest.approx(61 * 0.1)  # no model: no prefill cost known


def test_an_agent_queued_behind_a_prefill_heavy_one_waits_for_its_prefill() -> None:
    """KV token-time does not see prefill: a verification agent's long prompts with short
    answers cost little of it and take the engine seconds. The replay divides work by the
    engine's rate were prompts free and adds each agent's declared prefill at the time model's
    cost of a prompt token; an agent that declares none is assumed to prefill like the mix (its
    time is its charge at eta_rate, as before). In the pass and between passes."""
    class Steps:
        def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
            return 0.01 + 0.0001 * prefill_tokens + 1e-7 * kv_tokens

    def eta_behind(front: AgentShape | None, refresh: bool) -> tuple[float, Dispatcher]:
        d = Dispatcher("justitia", 100_000, 1.0, arrival_window_s=0, time_model=Steps())
        d.register_agent("front", 200_000.0, 0.0, shape=front)
        d.submit(req("f0", "front", 1_000, 100), 0.0)  # the mix: 1,000-token prompts, 100 out
        if refresh:
            d.refresh_etas(0.0)
        d.register_agent("behind", 2_000_000.0, 0.0)
        d.submit(req("b0", "behind", 1_000, 100), 0.0)
        return d.view("behind", 0.0).eta_s, d

    for refresh in (True, False):
        mix_like, d = eta_behind(None, refresh)
        assert d.eta_rate > d.rate  # the model's rate on the mix, the one the replay knew before
        # undeclared: both agents' charges at eta_rate, prefill not counted apart
        assert mix_like == pytest.approx(2_200_000.0 / d.eta_rate, rel=1e-6)
        none, _ = eta_behind(AgentShape(1, None, 0), refresh)
        heavy, _ = eta_behind(AgentShape(1, None, 50_000), refresh)
        assert heavy == pytest.approx(none + 50_000 * 0.0001, rel=1e-6)  # the front's prefill, 5 s
        assert none < mix_like < heavy  # no prefill: sooner than a mix's agent; 50,000 tokens: later
        snap = d.snapshot(0.0)
        assert snap["replay_rate"] > snap["eta_rate"] and snap["prefill_token_s"] == pytest.approx(0.0001)


def test_the_pass_projects_unstarted_agents_as_the_clock_does() -> None:
    """Views of agents that have not sent a request are O(1) after a pass too: the pass's
    projection of an arrival (one binary search) is the clock's walk."""
    d = Dispatcher("justitia", 1000, 0.1)
    for i, cost in enumerate((30_000.0, 5_000.0, 12_000.0)):
        d.register_agent(f"a{i}", cost, 0.0)
        d.submit(req(f"r{i}", f"a{i}", 10, 10), 0.0)
    for cost in (1_000.0, 8_000.0, 50_000.0):
        d.register_agent(f"idle{cost:g}", cost, 0.0)
    d.refresh_etas(0.5)
    for cost in (1_000.0, 8_000.0, 50_000.0):
        assert d.agents[f"idle{cost:g}"].fair_at == pytest.approx(d.clock.arrival_finish_time(cost, 0.5))
    for i in range(3):
        agent = d.agents[f"a{i}"]
        assert agent.fair_at == pytest.approx(d.clock.finish_time(f"a{i}", agent.virtual_finish, 0.5))


def test_the_bounds_rate_is_a_sustained_stretch_not_single_prefill_samples() -> None:
    """Live, a step that prefills a newly admitted stage holds little of the memory
    reserved for it, so its tau sample reads many times the sustained tau; the p90 of single
    samples would make deadlines of 10^5 s for agents that finish in 100 s."""
    est = TauEstimator(kv_capacity_tokens=1000, initial_tau_s=0.01, half_life_s=1e9)
    for _ in range(40):
        for _ in range(4):
            est.observe_step(0.01, kv_in_use=1000)
        est.observe_step(0.02, kv_in_use=10, kv_reserved=1000)  # a sample of 2 s
    bound_tau = est.promise_times()["bound_tau"]
    assert est.tau_s < bound_tau < 3 * est.tau_s  # the p90 of the samples: 2 s, 70 x tau


def test_a_burst_that_has_just_begun_widens_the_promise() -> None:
    """Agents registered in the first tenth of a second of a burst (the contended live run)
    are not promised as if the load were light: such a promise breaks by the fifth agent."""
    d = worst_case_promises(Dispatcher("justitia", 1000, 0.1))
    first = d.register_agent("a0", 10_000.0, 0.0)
    # nothing has arrived: no sign of a light load either (the first agent of a burst is
    # overtaken by the rest of it: a promise that counted none would break)
    assert first.promise == "widened" and "no arrivals measured yet" in first.promise_reason
    assert first.deadline_s == pytest.approx(1.0 / (1 - 0.9) + first.delay_bound_s, rel=0.01)
    for i in range(1, 5):
        d.register_agent(f"a{i}", 1_000.0, 0.05 * i)  # 20% of the rate, over a 2 s floor
    d.refresh_etas(0.2)
    v = d.register_agent("a5", 10_000.0, 0.2)
    assert v.promise == "widened" and "arrivals measured over 0.2 s" in v.promise_reason
    # the same arrivals spread over a long history: a firm promise
    d = Dispatcher("justitia", 1000, 0.1)
    for i in range(5):
        d.register_agent(f"a{i}", 1_000.0, 20.0 * i)
    d.refresh_etas(100.0)
    assert d.register_agent("late", 10_000.0, 100.0).promise == "firm"


def test_the_eta_does_not_project_a_burst_without_end() -> None:
    """The contended live run: 48 agents within 2.4 s, then nothing. Projected without end,
    the burst's rate would leave the last agents a tenth of the engine and their ETAs would
    read ten times their JCTs; arrivals are assumed to go on for as long as they have been
    measured."""
    d = Dispatcher("justitia", 1000, 0.1)  # R = 10,000 per second
    for i in range(20):  # 100,000 units within a second
        d.register_agent(f"s{i}", 5_000.0, 0.05 * i)
    d.register_agent("big", 50_000.0, 1.0)
    d.refresh_etas(1.0)
    eta = d.view("big", 1.0).eta_s
    # the work known is 15 s at full rate; the same burst again over the 10 s the rate is
    # measured over adds 9 s; projected without end (a tenth of R): 150 s
    assert 15.0 <= eta <= 25.0, eta


def test_arrivals_are_a_share_of_the_rate_the_deadline_assumes() -> None:
    """The share of arrivals is of M / bound_tau, the rate the deadline serves work at, not
    of R = M / tau: a stream at 72% of R can be 104% of that rate, and its promise must not be
    firm."""
    def promise(bound_tau: float):
        d = Dispatcher("justitia", 1000, 0.1)  # R = 10,000 per second
        d.set_iteration_time(0.1, 0.0, bound_tau=bound_tau)
        for i in range(40):  # 7,500 per second for 20 s: 75% of R
            d.register_agent(f"s{i}", 3_750.0, 0.5 * i)
            d.finish_agent(f"s{i}", 0.5 * i)
        d.refresh_etas(20.0)
        return d.register_agent("big", 50_000.0, 20.0, shape=AgentShape(1, 10))

    steady = promise(0.1)
    assert steady.promise == "firm"
    assert steady.deadline_s == pytest.approx(5.0 / (1 - 0.75) + steady.delay_bound_s, rel=0.05)
    slow = promise(0.14)  # the same arrivals are 105% of M / bound_tau
    assert slow.promise == "widened" and "105% of the engine's (pessimistic) rate" in slow.promise_reason
    assert slow.deadline_s == pytest.approx(5.0 * 1.4 / (1 - 0.9) + slow.delay_bound_s, rel=0.05)


def test_the_bounds_steps_are_those_of_a_full_cache() -> None:
    """Live: steps of 2.2 ms while a stream of small agents ran, 4.8 ms once a large agent's
    stages joined them. The bound's critical path counts steps with the cache full of the
    current mix (the time model's), when they are longer than the recent steps."""
    class Steps:  # 1 ms a step, plus 1 ms per 1,000 KV tokens held
        def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
            return 0.001 + kv_tokens / 1e6

    d = Dispatcher("justitia", 4000, 0.01, time_model=Steps())
    d.set_iteration_time(0.01, 0.0, bound_iteration_s=0.002)
    d.register_agent("s", 1_000.0, 0.0)
    d.submit(req("s0", "s", 90, 10), 0.0)  # the mix: p = 90, d = 10
    v = d.register_agent("big", 10_000.0, 0.0, shape=AgentShape(1, 99))
    # 40 requests of 100 tokens fill the cache; each holds 95 on average: 3,800 tokens
    assert v.bound.critical_path_s == pytest.approx(100 * (0.001 + 3_800 / 1e6))
    d.set_iteration_time(0.01, 0.0, bound_iteration_s=0.02)  # slower recent steps win
    assert d.register_agent("big2", 10_000.0, 0.0, shape=AgentShape(1, 99)).bound.critical_path_s \
        == pytest.approx(100 * 0.02)


def test_the_eta_expects_the_eta_shape_and_the_bound_covers_the_shape() -> None:
    """A type's learned shape: the bound covers its p90 agent (`shape`), the ETA expects its
    median one (`eta_shape`)."""
    class Steps:
        def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
            return 0.01

    d = Dispatcher("justitia", 1000, 0.1, arrival_window_s=0, time_model=Steps())
    both = d.register_agent("p90", 100.0, 0.0, shape=AgentShape(5, 495))
    split = d.register_agent("mixed", 100.0, 0.0, shape=AgentShape(5, 495), eta_shape=AgentShape(1, 99))
    assert split.delay_bound_s == pytest.approx(both.delay_bound_s)
    d.refresh_etas(0.0)
    # (99 + 1) steps of 10 ms against (495 + 5), after at most the other's 0.01 s of work
    assert d.view("mixed", 0.0).eta_s == pytest.approx(1.0, abs=0.011)
    assert d.view("p90", 0.0).eta_s == pytest.approx(5.0, abs=0.011)


def test_a_promise_allows_for_the_predictions_p90() -> None:
    """On a cold-start guess of a fraction of its cost, a fresh server would promise its
    first agent 16.0 s where it finishes at 37.4 s (live, the server's own predictions).
    The promise of an uncertain prediction is the one its p90 would get; its
    tag and its ETA stay the prediction's."""
    limits = BoundLimits(kv_cost(100, 100), 200_000.0, 100)

    def server() -> Dispatcher:
        d = worst_case_promises(quiet_for(Dispatcher("justitia", 1000, 0.1, limits=limits)))
        d.register_agent("other", 30_000.0, 0.0)
        d.submit(req("o0", "other", 10, 10), 0.0)
        return d

    sure, unsure, as_p90 = server(), server(), server()
    plain = sure.register_agent("a", 10_000.0, 0.0)
    guess = unsure.register_agent("a", 10_000.0, 0.0, cost_p90=36_000.0)
    big = as_p90.register_agent("a", 36_000.0, 0.0)
    assert plain.promise == "firm" and "p90" not in plain.promise_reason
    assert guess.promise == "widened" and "p90" in guess.promise_reason
    assert guess.deadline_s == pytest.approx(big.deadline_s)  # the promise of its p90
    assert guess.deadline_s > plain.deadline_s
    assert unsure.agents["a"].virtual_finish == sure.agents["a"].virtual_finish  # charged as predicted
    sure.refresh_etas(0.0)
    unsure.refresh_etas(0.0)
    assert unsure.view("a", 0.0).eta_s == pytest.approx(sure.view("a", 0.0).eta_s)
    # a p90 below the prediction asks for nothing
    assert server().register_agent("a", 10_000.0, 0.0, cost_p90=5_000.0).deadline_s == \
        pytest.approx(plain.deadline_s)


def test_an_over_run_up_to_the_p90_keeps_the_first_promise() -> None:
    """The agent runs to four times its prediction, within its p90: the deadline given at
    registration already covered that, so re-promising on the over-run does not move it."""
    d = worst_case_promises(quiet_for(Dispatcher("justitia", 1000, 0.1,
                                                 limits=BoundLimits(kv_cost(300, 300), 200_000.0, 300))))
    first = d.register_agent("a", kv_cost(100, 100), 0.0, cost_p90=4.2 * kv_cost(100, 100)).deadline_s
    d.submit(req("a0", "a", 200, 200), 0.0)  # four times what it was predicted at
    d.admit(0.0, engine_free_kv_tokens=1000)
    d.on_request_finished("a0", 200, 200, 4.0)
    assert d.agents["a"].charged_cost > 3.9 * kv_cost(100, 100)  # charged the over-run
    assert d.view("a", 4.0).deadline_s == pytest.approx(first)


def test_before_any_request_the_bound_assumes_the_engines_longest() -> None:
    """Until a request is seen, the bound's limits are the engine's context length's, and
    the promise says so: with d_max = 0 a fresh server's first promise would leave no time
    for the requests its agent waits behind."""
    d = quiet_for(Dispatcher("justitia", 1000, 0.1, context_tokens=500))
    first = d.register_agent("first", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert first.promise == "widened" and "no request seen" in first.promise_reason
    assert first.bound.blocking_s == pytest.approx(501 * 0.1)  # one stage behind a 500-token decode
    assert first.bound.lag_s >= 2 * kv_cost(0, 500) / 10_000
    d.submit(req("f0", "first", 20, 30), 0.0)
    second = d.register_agent("second", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert "no request seen" not in second.promise_reason  # now the observed limits
    assert second.bound.blocking_s == pytest.approx(31 * 0.1)
    # without a context length (the simulator declares its limits), nothing changes
    assert "no request seen" not in quiet_for(Dispatcher("justitia", 1000, 0.1)).register_agent(
        "a", 10_000.0, 0.0).promise_reason


# -- deadlines as tight as the ETAs' record allows (tight_promise.py) ------------------------
def test_a_deadline_is_the_eta_scaled_by_how_far_etas_have_fallen_short() -> None:
    from server.scheduler.tight_promise import CONTEXT_FLOORS

    def server() -> Dispatcher:
        d = quiet_for(Dispatcher("justitia", 1000, 0.1))
        d.register_agent("other", 30_000.0, 0.0)
        d.submit(req("o0", "other", 10, 10), 0.0)
        return d

    worst = worst_case_promises(server()).register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert worst.promise_assumes == ""  # the worst case rests on nothing but the measured rate
    fresh = server().register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    # a fresh server: the prior factor of an agent at the head of the queue (the larger agent
    # goes after it) times the ETA, far inside the worst case
    assert fresh.deadline_s == pytest.approx(CONTEXT_FLOORS[0] * fresh.eta_s)
    assert fresh.deadline_s < worst.deadline_s
    assert fresh.delay_bound_s == pytest.approx(worst.delay_bound_s)  # still reported beside it
    assert fresh.promise == "firm" and "prior" in fresh.promise_assumes
    assert "no faster than measured" in fresh.promise_assumes
    # and on the engine keeping its measured speed: a slower host lengthens every step counted
    assert "the engine keeps the speed measured (tau = 100 ms per iteration)" in fresh.promise_assumes
    # a server whose ETAs fell up to 7.2x short promises 7.2x the ETA, or the worst case
    # where that is the tighter (it is here: the worst case then rests on nothing more)
    d = server()
    for ratio in (1.0, 2.0, 7.2) * 5:
        d.etas.calibration.observe(1.0, ratio)
    late = d.register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert late.deadline_s == pytest.approx(min(7.2 * late.eta_s, worst.deadline_s))
    assert late.deadline_s > fresh.deadline_s and late.promise_assumes == ""
    # ETAs that never fell short still leave the context's floor (a calibration is no proof)
    d = server()
    for _ in range(30):
        d.etas.calibration.observe(1.0, 0.5)
    assert d.register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10)).deadline_s == \
        pytest.approx(fresh.deadline_s)


def test_an_agent_deep_in_the_queue_is_promised_a_smaller_multiple_of_its_eta() -> None:
    from server.scheduler.tight_promise import CONTEXT_FLOORS, context_of

    assert [context_of(w, 1.0) for w in (0.0, 0.99, 1.0, 2.5, 3.0, 40.0)] == [0, 0, 1, 2, 3, 3]
    assert context_of(0.0, 0.0) == 0 and context_of(5.0, 0.0) == 3
    assert list(CONTEXT_FLOORS) == sorted(CONTEXT_FLOORS, reverse=True)  # deeper: never looser
    # declared limits (requests up to 300 tokens) leave the worst case far out: 80 s here
    d = quiet_for(Dispatcher("justitia", 1000, 0.1, limits=BoundLimits(kv_cost(300, 300), 200_000.0, 300)))
    for k in range(4):  # four agents ahead of a fifth as large as each
        d.register_agent(f"s{k}", 5_000.0, 0.0, shape=AgentShape(1, 10))
        d.submit(req(f"s{k}/0", f"s{k}", 10, 10), 0.0)
    deep = d.register_agent("deep", 5_000.0, 0.0, shape=AgentShape(1, 10))
    assert d.agents["deep"].promise_context == 3
    assert deep.deadline_s == pytest.approx(CONTEXT_FLOORS[3] * deep.eta_s)
    assert "a fresh server's prior for an agent with 3x its own work or more ahead" in deep.promise_assumes
    # ratios learned in one context do not loosen another's: ten head agents' 6x leaves the
    # deep context at its floor, ten of its own at 3x raise it to 3
    for _ in range(10):
        d.etas.calibration.observe(1.0, 6.0, 0)
    # (deadlines scale the replay's ETA, the one told is scaled by the record: eta_interval.py)
    again = d.register_agent("deep2", 5_000.0, 0.0, shape=AgentShape(1, 10))
    assert again.deadline_s == pytest.approx(CONTEXT_FLOORS[3] * d.eta_time("deep2", 0.0))
    for _ in range(10):
        d.etas.calibration.observe(1.0, 3.0, 3)
    third = d.register_agent("deep3", 5_000.0, 0.0, shape=AgentShape(1, 10))
    assert third.deadline_s == pytest.approx(3.0 * d.eta_time("deep3", 0.0))
    assert "the last 10 agents finished" in third.promise_assumes
    # a finished agent is filed under the context its promise was made in
    d.observe_jct(1.0, 2.0, "deep")
    assert d.etas.calibration.upper_ratio(1.0, 11, 3) == (3.0, 11)


def test_a_large_agents_deadline_allows_for_the_densest_burst_seen() -> None:
    """80 agents of 1,000 units registered 50 s ago: within 4 s (a burst), or one every
    0.625 s. The rate measured is the same, and so are the ETAs; a large agent's deadline in
    the bursty history allows for a burst like it arriving ahead (all of it: each arrival
    is smaller than the large agent), a typical agent's does not, unless it is among the
    first of a burst: after the bursty history's 46 s lull, which the server did not drain
    across, registrations at 0 s begin the next burst."""
    from server.scheduler.tight_promise import BURST_HEAD, CONTEXT_FLOORS, LARGE_CONTEXT_FLOORS

    def server(gap: float) -> Dispatcher:
        d = quiet_for(Dispatcher("justitia", 1000, 0.1, limits=BoundLimits(kv_cost(300, 300), 200_000.0, 300)))
        for k in range(80):
            d.arrivals.add(-50.0 + gap * k, 1_000.0)
        d.refresh_etas(0.0)
        return d

    bursty, even = server(0.05), server(50.0 / 80)
    assert bursty.arrivals.rate == pytest.approx(even.arrivals.rate)
    assert bursty.arrivals.peak_work(1.0) > 10 * even.arrivals.peak_work(1.0)
    big_bursty = bursty.register_agent("big", 5_000.0, 0.0, shape=AgentShape(1, 10))
    big_even = even.register_agent("big", 5_000.0, 0.0, shape=AgentShape(1, 10))
    assert bursty.agents["big"].promise_large and even.agents["big"].promise_large
    assert big_bursty.eta_s == pytest.approx(big_even.eta_s)
    # its own 5,000 units and the burst's 80,000, at the engine's rate
    assert big_bursty.deadline_s == pytest.approx((5_000.0 + 80_000.0) / bursty.rate)
    assert big_even.deadline_s == pytest.approx(LARGE_CONTEXT_FLOORS[0] * even.eta_time("big", 0.0))
    assert big_bursty.deadline_s > big_even.deadline_s
    assert not even.agents["big"].promise_burst_head
    for d in (bursty, even):
        # the large agent began the bursty server's burst: the next BURST_HEAD - 1 are its first
        heads = [d.register_agent(f"head{k}", 1_000.0, 0.0, shape=AgentShape(1, 10)) for k in range(BURST_HEAD - 1)]
        typical = d.register_agent("typical", 1_000.0, 0.0, shape=AgentShape(1, 10))
        assert not d.agents["typical"].promise_large and not d.agents["typical"].promise_burst_head
        assert typical.deadline_s == pytest.approx(CONTEXT_FLOORS[0] * d.eta_time("typical", 0.0))
        for k, head in enumerate(heads):
            tight = CONTEXT_FLOORS[0] * d.eta_time(f"head{k}", 0.0)
            assert d.agents[f"head{k}"].promise_burst_head == (d is bursty)
            assert head.deadline_s == pytest.approx(tight) if d is even else head.deadline_s > 1.5 * tight


def test_a_large_agent_is_told_apart_by_its_cost() -> None:
    from server.scheduler.tight_promise import LARGE_COST, is_large

    assert not is_large(10_000.0, 10_000.0)
    assert is_large(LARGE_COST * 10_000.0, 10_000.0)  # large for the mix arriving
    assert not is_large(LARGE_COST * 10_000.0, None)  # no mix measured: not by cost
    assert not is_large(LARGE_COST * 10_000.0, 0.0)


def test_a_large_agent_is_promised_by_the_record_of_large_agents() -> None:
    from server.scheduler.tight_promise import CONTEXT_FLOORS, LARGE_CONTEXT_FLOORS

    assert all(big >= small for big, small in zip(LARGE_CONTEXT_FLOORS, CONTEXT_FLOORS, strict=True))
    assert list(LARGE_CONTEXT_FLOORS) == sorted(LARGE_CONTEXT_FLOORS, reverse=True)

    def server() -> Dispatcher:
        """Declared limits leave the worst case far out; a mix of 1,000-unit agents measured."""
        d = quiet_for(Dispatcher("justitia", 1000, 0.1, limits=BoundLimits(kv_cost(300, 300), 200_000.0, 300)))
        for k in range(10):
            d.arrivals.add(-10.0 + k, 1_000.0)
        d.refresh_etas(0.0)
        return d

    assert server().arrivals.median_cost() == pytest.approx(1_000.0)
    # a long prompt alone is not large: the ETA counts its wait for room (request_need)
    shapes = {"typical": (1_000.0, AgentShape(1, 10)), "big": (5_000.0, AgentShape(1, 10)),
              "long prompt": (1_000.0, AgentShape(1, 10, prefill_tokens=600))}
    for name, (cost, shape) in shapes.items():  # each alone at the head of its own server
        d = server()
        view = d.register_agent(name, cost, 0.0, shape=shape)
        agent = d.agents[name]
        assert agent.promise_context == 0 and agent.promise_large == (name == "big")
        floor = (LARGE_CONTEXT_FLOORS if agent.promise_large else CONTEXT_FLOORS)[0]
        assert view.deadline_s == pytest.approx(floor * view.eta_s)
        assert ("a large agent" in view.promise_assumes) == agent.promise_large
    def taught_by_large_agents() -> Dispatcher:
        """A server whose large agents at the head have finished at 9x their ETAs."""
        d = server()
        for _ in range(10):
            d.etas.calibration.observe(1.0, 9.0, 0, large=True)
        return d

    # large agents' ratios raise large agents' deadlines only
    d = taught_by_large_agents()
    assert d.etas.calibration.upper_ratio(1.0, 10, 0, large=True) == (9.0, 10)
    assert d.etas.calibration.upper_ratio(1.0, 10, 0) is None
    heavy = d.register_agent("heavy", 5_000.0, 0.0, shape=shapes["big"][1])
    worst = worst_case_promises(server()).register_agent("heavy", 5_000.0, 0.0, shape=shapes["big"][1])
    # (deadlines scale the replay's ETA, the one told is scaled by the record: eta_interval.py)
    replay = d.eta_time("heavy", 0.0)
    assert heavy.deadline_s == pytest.approx(min(9.0 * replay, worst.deadline_s))
    assert heavy.deadline_s > LARGE_CONTEXT_FLOORS[0] * replay
    d2 = taught_by_large_agents()
    typical = d2.register_agent("typical", 1_000.0, 0.0, shape=AgentShape(1, 10))
    assert typical.deadline_s == pytest.approx(CONTEXT_FLOORS[0] * d2.eta_time("typical", 0.0))
    # a finished large agent is filed under its context and size, its JCT over the replay's
    # ETA its deadline scaled
    d.observe_jct(1.0, 30.0, "heavy")
    assert d.etas.calibration.upper_ratio(1.0, 11, 0, large=True) == (
        pytest.approx(max(9.0, 30.0 / d.agents["heavy"].eta_replay_s)), 11)
    assert d.etas.calibration.upper_ratio(1.0, 1, 0) is None


def test_a_calibrated_deadline_allows_for_a_predictions_p90() -> None:
    d = quiet_for(Dispatcher("justitia", 1000, 0.1))
    plain = d.register_agent("a", 10_000.0, 0.0)
    guess = quiet_for(Dispatcher("justitia", 1000, 0.1)).register_agent("a", 10_000.0, 0.0, cost_p90=20_000.0)
    worst = worst_case_promises(quiet_for(Dispatcher("justitia", 1000, 0.1))).register_agent(
        "a", 10_000.0, 0.0, cost_p90=20_000.0)
    assert guess.eta_s == pytest.approx(plain.eta_s)
    assert guess.deadline_s == pytest.approx(min(2.0 * plain.deadline_s, worst.deadline_s))
    assert guess.deadline_s > plain.deadline_s


def test_a_deadline_resting_on_guesses_is_the_worst_case() -> None:
    """A calibrated deadline needs an ETA the record of ETAs speaks for: not one made before
    the engine's rate is measured, nor one of an agent whose cost is a guess."""
    def server() -> Dispatcher:
        d = quiet_for(Dispatcher("justitia", 1000, 0.1))
        d.register_agent("other", 30_000.0, 0.0)
        d.submit(req("o0", "other", 10, 10), 0.0)
        return d

    worst = worst_case_promises(server()).register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    known = server().register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert known.deadline_s < worst.deadline_s and known.promise_assumes  # calibrated
    guessed = server().register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10), cost_guessed=True)
    assert guessed.deadline_s == pytest.approx(worst.deadline_s) and guessed.promise_assumes == ""
    unmeasured = server()
    unmeasured.set_iteration_time(0.1, 0.0, uncertainty="the engine's rate is not measured yet")
    early = unmeasured.register_agent("a", 10_000.0, 0.0, shape=AgentShape(1, 10))
    assert early.promise_assumes == "" and early.promise == "widened"
    assert early.deadline_s >= worst.deadline_s - 1e-9


def test_a_guessed_agent_is_bounded_by_the_context_until_the_rate_is_measured() -> None:
    """The first request of a burst says nothing of how long an unseen type's requests are:
    while the engine's rate is unmeasured, an agent whose cost is a guess is bounded as if
    no request had been seen (requests as long as the engine's context); an agent whose
    cost a predictor knows, or any agent once the rate is measured, by the requests seen."""
    def server(measured: bool) -> Dispatcher:
        d = Dispatcher("justitia", 10_000, 0.01, context_tokens=2048)
        d.register_agent("first", 30_000.0, 0.0)
        d.submit(req("f0", "first", 10, 24), 0.0)  # the burst's first request: 24 tokens
        if not measured:
            d.set_iteration_time(0.01, 0.0, uncertainty="the engine's rate is not measured yet")
        return d

    guessed = server(False).register_agent("a", 40_000.0, 0.0, shape=AgentShape(1, 256), cost_guessed=True)
    known = server(False).register_agent("a", 40_000.0, 0.0, shape=AgentShape(1, 256))
    later = server(True).register_agent("a", 40_000.0, 0.0, shape=AgentShape(1, 256), cost_guessed=True)
    # (d_max + 1) iterations of blocking behind a request as long as the context, not a 24-token one
    assert guessed.bound.blocking_s == pytest.approx(known.bound.blocking_s * 2049 / 25)
    assert later.bound.blocking_s == pytest.approx(25 * 0.01)
    assert guessed.deadline_s > known.deadline_s + 20  # the blocking term alone adds 20 s
    assert "its cost is a guess" in guessed.promise_reason
