"""Equinox: user and resource fairness counters, charged on admission, corrected on finish."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.scheduler import Dispatcher, RequestSpec, RequestStatus, compute_cost, kv_cost
from server.scheduler.policies import POLICIES


def req(rid, agent, p, d, expected):
    return RequestSpec(rid, agent, p, d, expected)


def ids(specs):
    return [s.request_id for s in specs]


def test_charged_with_the_prediction_and_credited_back_on_finish():
    d = Dispatcher("equinox", 100_000, 0.01)
    d.register_agent("a", 1.0, 0.0)
    d.submit(req("a0", "a", 1000, 2000, expected=800), 0.0)  # predicted 800, runs 200
    assert ids(d.admit(0.0)) == ["a0"]
    c = d.agents["a"].fair
    assert c.user == 1000 + 2 * 800 and c.resource == kv_cost(1000, 800) and c.provisional == 1
    charged = c.key
    d.on_request_finished("a0", 1000, 200, 5.0)
    assert c.user == 1000 + 2 * 200 and c.resource == kv_cost(1000, 200) and c.provisional == 0
    rho = d.compute_per_kv
    assert c.key == pytest.approx(0.5 * c.user + 0.5 * rho * c.resource)
    assert c.key < charged  # the shorter true output is credited back


def test_an_agent_that_used_less_than_predicted_goes_first_afterwards():
    d = Dispatcher("equinox", 100_000, 0.01)
    d.register_agent("brief", 1.0, 0.0)
    d.register_agent("verbose", 1.0, 0.0)
    # both predicted alike; "brief" really writes 50 tokens, "verbose" 500
    d.submit(req("b0", "brief", 500, 1000, expected=500), 0.0)
    d.submit(req("v0", "verbose", 500, 1000, expected=500), 0.0)
    assert ids(d.admit(0.0)) == ["b0", "v0"]
    assert d.agents["brief"].fair.key == d.agents["verbose"].fair.key  # same prediction
    d.on_request_finished("b0", 500, 50, 1.0)
    d.on_request_finished("v0", 500, 500, 5.0)
    d.submit(req("v1", "verbose", 500, 1000, expected=500), 5.0)
    d.submit(req("b1", "brief", 500, 1000, expected=500), 5.0)
    # one slot: the agent that was credited back is served first, though it asked later
    assert ids(d.admit(5.0, engine_free_slots=1)) == ["b1"]


def test_the_two_counters_and_their_weights():
    # "reader": long prompt, short answer; "writer": short prompt, long answer. The writer
    # is charged fewer user tokens (p + 2d: 1,100 vs 1,200) but holds more KV token-time.
    def first_served(alpha):
        d = Dispatcher(replace(POLICIES["equinox"], alpha=alpha), 100_000, 0.01)
        d.register_agent("reader", 1.0, 0.0)
        d.register_agent("writer", 1.0, 0.0)
        for k in range(2):  # both stay backlogged (no lift in between)
            d.submit(req(f"r{k}", "reader", 1000, 100, 100), 0.0)
            d.submit(req(f"w{k}", "writer", 100, 500, 500), 0.0)
        assert ids(d.admit(0.0, engine_free_slots=2)) == ["r0", "w0"]  # equal keys: arrival
        d.on_request_finished("r0", 1000, 100, 1.0)
        d.on_request_finished("w0", 100, 500, 1.0)
        r, w = d.agents["reader"].fair, d.agents["writer"].fair
        assert (r.user, w.user) == (1200, 1100)
        assert (r.resource, w.resource) == (kv_cost(1000, 100), kv_cost(100, 500))
        return ids(d.admit(1.0, engine_free_slots=1))[0]

    assert first_served(1.0) == "w1"  # user fairness only: the writer was served fewer tokens
    assert first_served(0.0) == "r1"  # resource fairness only: the reader held less KV
    assert first_served(0.5) == "r1"  # both, at rho: 600 + 431 < 550 + 719


def test_a_newly_backlogged_agent_is_lifted_to_the_least_served():
    d = Dispatcher("equinox", 100_000, 0.01)
    d.register_agent("old", 1.0, 0.0)
    for k in range(3):
        d.submit(req(f"o{k}", "old", 100, 50, 50), 0.0)
    d.admit(0.0, engine_free_slots=2)
    old_key = d.agents["old"].fair.key
    assert old_key > 0
    d.register_agent("new", 1.0, 1.0)
    d.submit(req("n0", "new", 100, 50, 50), 1.0)
    # idle time earns no credit: "new" starts at the key of the backlogged "old"
    assert d.agents["new"].fair.key == old_key


ops = st.lists(
    st.tuples(st.integers(0, 4), st.integers(1, 400), st.integers(1, 300), st.integers(0, 300),
              st.floats(0.0, 1.0), st.booleans()),
    min_size=1, max_size=50,
)


@settings(max_examples=80, deadline=None)
@given(ops, st.integers(300, 3000))
def test_counters_are_exact_and_provisional_charges_return_to_zero(ops, m):
    d = Dispatcher("equinox", m, 0.02)
    now, real, agents, cancelled = 0.0, {}, set(), set()
    truth = {}  # agent -> [U, R] of its finished requests
    for k, (a, p, out, exp, dt, cancel) in enumerate(ops):
        now += dt
        aid = f"a{a}"
        if aid in cancelled:
            continue
        if aid not in agents:
            d.register_agent(aid, 1.0, now)
            agents.add(aid)
            truth[aid] = [0.0, 0.0]
        d.submit(RequestSpec(f"r{k}", aid, p, out, exp), now)
        real[f"r{k}"] = (aid, p, out)
        d.admit(now)
        if cancel and k % 7 == 3:  # sometimes cancel an agent with requests in flight
            d.cancel_agent(aid, now)
            cancelled.add(aid)
    running = [r for r, s in d.requests.items() if s.status is RequestStatus.RUNNING]
    while running:
        now += 1.0
        for rid in running:
            aid, p, out = real[rid]
            d.on_request_finished(rid, p, out, now)
            truth[aid][0] += compute_cost(p, out)
            truth[aid][1] += kv_cost(p, out)
        d.admit(now)
        running = [r for r, s in d.requests.items() if s.status is RequestStatus.RUNNING]
    for aid in sorted(agents - cancelled):
        c = d.agents[aid].fair
        if c is None:
            continue
        assert c.provisional == 0
        assert c.user == pytest.approx(truth[aid][0]) and c.resource == pytest.approx(truth[aid][1])
        d.finish_agent(aid, now)
    assert d.policy.state.charges == 0
    assert d.is_idle()
