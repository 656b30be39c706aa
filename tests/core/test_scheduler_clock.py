import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.scheduler import VirtualClock, gps_finish_times


def test_single_agent_runs_at_full_rate():
    clock = VirtualClock(rate=10.0)
    f = clock.arrive("a", 100.0, now=0.0)
    assert f == 100.0
    assert clock.advance(5.0) == pytest.approx(50.0)
    clock.advance(20.0)
    assert clock.backlog == 0
    assert clock.departures["a"] == pytest.approx(10.0)
    assert clock.V == pytest.approx(100.0)  # V stands still while B is empty


def test_two_agents_share_the_rate():
    clock = VirtualClock(rate=10.0)
    clock.arrive("a", 100.0, now=0.0)
    clock.arrive("b", 50.0, now=0.0)
    # both backlogged: dV/dt = 5; b leaves at V=50 (t=10), then a alone: t = 10 + 50/10
    clock.advance(100.0)
    assert clock.departures["b"] == pytest.approx(10.0)
    assert clock.departures["a"] == pytest.approx(15.0)


def test_projected_time_matches_the_departure():
    clock = VirtualClock(rate=4.0)
    clock.arrive("a", 40.0, 0.0)
    clock.arrive("b", 10.0, 1.0)
    projected = clock.projected_time(clock.tag("a"), 2.0)
    clock.advance(1000.0)
    assert projected == pytest.approx(clock.departures["a"])


def test_extend_re_enters_the_backlog_after_gps_finished():
    clock = VirtualClock(rate=1.0)
    f = clock.arrive("a", 5.0, 0.0)
    clock.advance(10.0)
    assert clock.backlog == 0
    f2 = clock.extend("a", f, 3.0, now=10.0)
    assert f2 == pytest.approx(8.0)  # max(F, V) + extra, V = 5
    clock.advance(100.0)
    assert clock.departures["a"] == pytest.approx(13.0)


def test_shift_moves_a_tag_from_where_it_stands():
    clock = VirtualClock(rate=1.0)
    fa = clock.arrive("a", 5.0, 0.0)
    fb = clock.arrive("b", 100.0, 0.0)
    clock.advance(20.0)  # a left at V = 5 (t = 10), b alone since: V = 15
    assert clock.backlog == 1 and clock.V == pytest.approx(15.0)
    # a small charge leaves a where it stood, behind V (extend would start it again from V)
    assert clock.shift("a", fa, 2.0, now=20.0) == pytest.approx(7.0)
    assert clock.backlog == 1 and "a" in clock.departures
    # a charge that carries it past V puts it back in the backlog
    assert clock.shift("a", 7.0, 10.0, now=20.0) == pytest.approx(17.0)
    assert clock.backlog == 2 and "a" not in clock.departures
    # a backlogged key moves by the charge exactly
    assert clock.shift("b", fb, 4.0, now=20.0) == pytest.approx(104.0)
    assert clock.shift("b", 104.0, 0.0, now=20.0) == pytest.approx(104.0)


def test_remove_speeds_up_the_others():
    clock = VirtualClock(rate=2.0)
    clock.arrive("a", 10.0, 0.0)
    clock.arrive("b", 10.0, 0.0)
    clock.remove("b", now=2.0)  # V=2 at t=2; then a alone needs 8 more at rate 2
    clock.advance(100.0)
    assert clock.departures["a"] == pytest.approx(6.0)


def test_time_must_not_go_backwards():
    clock = VirtualClock(rate=1.0)
    clock.advance(5.0)
    with pytest.raises(ValueError):
        clock.advance(4.0)


jobs = st.lists(
    st.tuples(st.floats(0, 100, allow_nan=False), st.floats(0.5, 500, allow_nan=False)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(jobs, st.floats(0.5, 50))
def test_virtual_clock_matches_the_offline_gps_reference(jobs, rate):
    arrivals = [a for a, _ in jobs]
    costs = [c for _, c in jobs]
    ref = gps_finish_times(arrivals, costs, rate)
    clock = VirtualClock(rate=rate)
    for i in sorted(range(len(jobs)), key=lambda i: arrivals[i]):
        clock.arrive(i, costs[i], arrivals[i])
    clock.advance(max(arrivals) + sum(costs) / rate + 1.0)
    assert clock.backlog == 0
    for i in range(len(jobs)):
        assert clock.departures[i] == pytest.approx(ref[i], rel=1e-6, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(jobs, st.floats(0.5, 50))
def test_gps_reference_is_work_conserving(jobs, rate):
    arrivals = [a for a, _ in jobs]
    costs = [c for _, c in jobs]
    ref = gps_finish_times(arrivals, costs, rate)
    for a, c, f in zip(arrivals, costs, ref, strict=True):
        assert f >= a + c / rate - 1e-6  # no agent beats running alone
    # the last departure is when a work-conserving server drains everything
    busy_until = 0.0
    for a, c in sorted(jobs):
        busy_until = max(busy_until, a) + c / rate
    assert max(ref) == pytest.approx(busy_until, rel=1e-6)
    assert not any(math.isnan(f) for f in ref)


def test_tau_estimator_scales_steps_to_a_full_cache():
    from server.scheduler import TauEstimator

    # the sample arithmetic alone (the guess's weight: test_a_first_slow_step_does_not_set_tau_alone)
    est = TauEstimator(kv_capacity_tokens=1000, initial_tau_s=0.05, half_life_s=10.0, prior_iterations=0)
    assert est.tau_s == 0.05
    est.observe_step(0.02, kv_in_use=100)  # too empty to say anything: skipped
    assert est.tau_s == 0.05
    for _ in range(50):
        est.observe_step(0.02, kv_in_use=800)  # cache used as full as it is filled: the step time
    assert est.tau_s == pytest.approx(0.02)
    est2 = TauEstimator(kv_capacity_tokens=1000, initial_tau_s=0.05, prior_iterations=0)
    for _ in range(50):
        # reservations fill 90% but only 600 tokens are in use: full reservations would serve
        # 600/0.9 units per 0.02 s step, i.e. 1000 units per 0.03 s
        est2.observe_step(0.02, kv_in_use=600, kv_reserved=900)
    assert est2.tau_s == pytest.approx(0.03)
    for _ in range(5000):  # the engine slows down: the estimate follows
        est.observe_step(0.04, kv_in_use=1000)
    assert est.tau_s == pytest.approx(0.04, rel=1e-3)


def test_a_first_slow_step_does_not_set_tau_alone():
    """Live, the first measured step may be a 2,400-token prefill of 0.27 s among decode
    steps of 5 ms. Alone, it would set R to a twentieth of the engine's until the next
    update, and the agents registered meanwhile would be told 10-30 times their JCTs."""
    from server.scheduler import TauEstimator

    est = TauEstimator(kv_capacity_tokens=4096, initial_tau_s=0.01)
    bare = TauEstimator(kv_capacity_tokens=4096, initial_tau_s=0.01, prior_iterations=0)
    for e in (est, bare):
        e.observe_step(0.27, kv_in_use=2400, kv_reserved=2600)
        assert e.measured
    assert bare.tau_s > 0.25
    assert est.tau_s == pytest.approx((32 * 0.01 + 0.27) / (32 + 2400 / 2600), rel=0.01)  # the guess: 32 steps
    for _ in range(2000):  # and the guess fades: 10 s of steady decode later, the data decide
        est.observe_step(0.005, kv_in_use=4000)
    assert est.tau_s == pytest.approx(0.005, rel=0.05)


def test_observing_n_steps_alike_is_n_observations():
    """The simulator feeds a stretch of n decode iterations at once (observe_steps): the
    estimate must be the one n single observations give."""
    from server.scheduler import TauEstimator

    one, many = (TauEstimator(kv_capacity_tokens=1000, initial_tau_s=0.05, half_life_s=2.0) for _ in range(2))
    for n, duration, kv, reserved in ((300, 0.004, 700.0, 900.0), (1, 0.05, 600.0, None), (40, 0.01, 950.0, 950.0),
                                      (5, 0.003, 100.0, 200.0)):  # the last one too empty to count
        for _ in range(n):
            one.observe_step(duration, kv, reserved)
        many.observe_steps(n, duration, kv, reserved)
    assert many.tau_s == pytest.approx(one.tau_s, rel=1e-9)
    for q in (0.5, 0.9):
        assert many.step_quantile(q) == pytest.approx(one.step_quantile(q))
    a, b = one.promise_times(), many.promise_times()
    assert b["bound_tau"] == pytest.approx(a["bound_tau"], rel=1e-9)
    assert b["bound_iteration_s"] == pytest.approx(a["bound_iteration_s"], rel=1e-9)
    assert one.tau_s != pytest.approx(0.05)  # measured, not the guess
