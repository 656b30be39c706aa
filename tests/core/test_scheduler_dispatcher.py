import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.scheduler import POLICY_NAMES, AgentShape, Dispatcher, RequestSpec, RequestStatus, kv_cost
from tests.support.dispatchers import quiet_for


def req(rid, agent, p, d, expected=None):
    return RequestSpec(rid, agent, p, d, d if expected is None else expected)


def ids(specs):
    return [s.request_id for s in specs]


def test_justitia_serves_in_virtual_finish_order():
    d = Dispatcher("justitia", kv_capacity_tokens=1000, iteration_time_s=0.01)
    d.register_agent("big", kv_cost(100, 100) * 4, now=0.0)
    # R = 100,000/s: at t=0.05, V = 5,000; small's tag 5,000 + 15,050 < big's 60,200
    d.register_agent("small", kv_cost(100, 100), now=0.05)  # later, but finishes first under GPS
    assert d.agents["small"].virtual_finish < d.agents["big"].virtual_finish
    for k in range(4):
        d.submit(req(f"big{k}", "big", 100, 100), 0.05)
    d.submit(req("small0", "small", 100, 100), 0.05)
    out = ids(d.admit(0.05))
    assert out[0] == "small0"
    assert out[1:] == ["big0", "big1", "big2", "big3"]
    assert d.ledger.reserved_kv == 5 * 200


def test_footprint_admission_is_strict_and_backfill_is_optional():
    for backfill, expected, after in ((False, ["a0"], ["a1", "b0"]), (True, ["a0", "b0"], ["a1"])):
        d = Dispatcher("justitia", 1000, 0.01, backfill=backfill)
        d.register_agent("a", 10.0, 0.0)
        d.register_agent("b", 1e9, 0.0)
        d.submit(req("a0", "a", 500, 100), 0.0)
        d.submit(req("a1", "a", 500, 100), 0.0)  # does not fit next to a0
        d.submit(req("b0", "b", 100, 100), 0.0)  # would fit, but is behind a1
        assert ids(d.admit(0.0)) == expected
        d.on_request_finished("a0", 500, 100, 1.0)
        assert ids(d.admit(1.0)) == after


def test_engine_feedback_limits_footprint_admission():
    d = Dispatcher("justitia", 1000, 0.01)
    d.register_agent("a", 10.0, 0.0)
    d.submit(req("a0", "a", 100, 50), 0.0)
    d.submit(req("a1", "a", 100, 50), 0.0)
    # the engine reports less free memory than the reservations imply
    assert ids(d.admit(0.0, engine_free_kv_tokens=1000)) == ["a0", "a1"]
    d2 = Dispatcher("justitia", 1000, 0.01)
    d2.register_agent("a", 10.0, 0.0)
    d2.submit(req("a0", "a", 100, 50), 0.0)
    d2.submit(req("a1", "a", 100, 50), 0.0)
    assert ids(d2.admit(0.0, engine_free_kv_tokens=200)) == ["a0"]
    assert ids(d2.admit(0.0, engine_free_slots=0)) == []


def test_oversized_request_runs_alone_rather_than_deadlocking():
    d = Dispatcher("justitia", 100, 0.01)
    d.register_agent("a", 1.0, 0.0)
    d.submit(req("a0", "a", 90, 50), 0.0)
    d.submit(req("a1", "a", 10, 5), 0.0)
    assert ids(d.admit(0.0)) == ["a0"]


def test_native_policies_admit_when_the_prompt_fits():
    d = Dispatcher("fcfs", 1000, 0.01)
    d.register_agent("a", 1.0, 0.0)
    for k in range(5):
        d.submit(req(f"r{k}", "a", 200, 500), 0.0)
    # footprints (700 each) would not fit, prompts do: vLLM-style over-admission
    assert ids(d.admit(0.0, engine_free_kv_tokens=1000)) == ["r0", "r1", "r2", "r3"]


def test_fcfs_is_request_arrival_order_across_agents():
    d = Dispatcher("fcfs", 10_000, 0.01)
    d.register_agent("a", 1.0, 0.0)
    d.register_agent("b", 1.0, 0.0)
    d.submit(req("b0", "b", 10, 10), 0.0)
    d.submit(req("a0", "a", 10, 10), 0.1)
    d.submit(req("b1", "b", 10, 10), 0.2)
    assert ids(d.admit(0.2)) == ["b0", "a0", "b1"]


def test_sjf_orders_requests_by_predicted_cost():
    d = Dispatcher("sjf", 10_000, 0.01)
    d.register_agent("a", 1.0, 0.0)
    d.register_agent("b", 1.0, 0.0)
    d.submit(req("a-long", "a", 100, 900), 0.0)
    d.submit(req("a-short", "a", 100, 10), 0.0)
    d.submit(req("b-mid", "b", 100, 100), 0.0)
    assert ids(d.admit(0.0)) == ["a-short", "b-mid", "a-long"]
    assert d.priority("a", "a-long") > 0


def test_parrot_is_agent_fcfs():
    d = Dispatcher("parrot", 10_000, 0.01)
    d.register_agent("first", 1e9, 0.0)
    d.register_agent("second", 1.0, 0.1)
    d.submit(req("s0", "second", 10, 10), 0.1)
    d.submit(req("f0", "first", 10, 10), 0.2)
    assert ids(d.admit(0.2)) == ["f0", "s0"]


def test_srjf_key_follows_consumption():
    d = Dispatcher("srjf", 150, 0.01)
    a_cost = kv_cost(50, 50) * 3
    d.register_agent("a", a_cost, 0.0)
    d.register_agent("b", a_cost * 0.8, 0.0)
    d.submit(req("b0", "b", 50, 50), 0.0)
    d.submit(req("b1", "b", 50, 50), 0.0)
    d.submit(req("a0", "a", 50, 50), 0.0)
    assert ids(d.admit(0.0)) == ["b0"]  # b is shorter; only one fits
    d.on_request_finished("b0", 50, 50, 1.0)
    # b consumed one request: b remains shorter still
    assert ids(d.admit(1.0)) == ["b1"]
    d.on_request_finished("b1", 50, 50, 2.0)
    assert ids(d.admit(2.0)) == ["a0"]
    assert d.priority("a") == int(a_cost)


def test_vtc_counter_lift_and_fair_alternation():
    d = Dispatcher("vtc", 10_000, 0.01)
    d.register_agent("a", 1.0, 0.0)
    for k in range(3):
        d.submit(req(f"a{k}", "a", 100, 10), 0.0)
    assert ids(d.admit(0.0, engine_free_slots=2)) == ["a0", "a1"]
    assert d.agents["a"].vtc_counter == 200
    d.register_agent("b", 1.0, 1.0)
    d.submit(req("b0", "b", 100, 10), 1.0)
    d.submit(req("b1", "b", 100, 10), 1.0)
    # b is lifted to the least-served backlogged agent (a at 200), not left at 0
    assert d.agents["b"].vtc_counter == 200
    assert ids(d.admit(1.0, engine_free_slots=2)) == ["a2", "b0"]


def test_over_run_is_charged_and_loses_priority():
    d = Dispatcher("justitia", 100_000, 0.01)
    d.register_agent("liar", 10.0, 0.0)  # predicts almost nothing
    d.register_agent("honest", kv_cost(100, 100) * 1.5, 0.0)
    tag0 = d.agents["liar"].virtual_finish
    d.submit(req("l0", "liar", 100, 100), 0.0)
    d.submit(req("l1", "liar", 100, 100), 0.0)
    liar = d.agents["liar"]
    assert liar.charged_cost == pytest.approx(kv_cost(100, 100) * 2)
    assert liar.virtual_finish > tag0
    # the liar's real work is larger than the honest agent's: it no longer goes first
    assert liar.virtual_finish > d.agents["honest"].virtual_finish
    d.submit(req("h0", "honest", 100, 100), 0.0)
    assert ids(d.admit(0.0, engine_free_slots=1)) == ["h0"]
    # a request that runs longer than estimated is corrected on finish
    d2 = Dispatcher("justitia", 100_000, 0.01)
    d2.register_agent("a", kv_cost(100, 10), 0.0)
    d2.submit(req("a0", "a", 100, 1000, expected=10), 0.0)
    d2.admit(0.0)
    before = d2.agents["a"].virtual_finish
    d2.on_request_finished("a0", 100, 500, 5.0)
    assert d2.agents["a"].charged_cost == pytest.approx(kv_cost(100, 500))
    assert d2.agents["a"].virtual_finish > before


def test_cancel_returns_running_ids_and_frees_everything():
    d = Dispatcher("justitia", 1000, 0.01)
    d.register_agent("a", 100.0, 0.0)
    d.submit(req("a0", "a", 300, 100), 0.0)
    d.submit(req("a1", "a", 300, 100), 0.0)
    d.submit(req("a2", "a", 300, 100), 0.0)
    d.admit(0.0)
    assert d.cancel_agent("a", 1.0) == ["a0", "a1"]
    assert d.is_idle()
    # the engine may still report a request whose abort raced with its completion
    assert d.on_request_finished("a0", 300, 100, 1.5) is False
    assert d.is_idle()
    assert d.clock.backlog == 0


def test_views_and_snapshot():
    d = quiet_for(Dispatcher("justitia", 1000, 0.1))  # R = 10,000 per second
    v = d.register_agent("a", 50_000.0, 0.0, shape=AgentShape(2, 300))
    assert v.fair_finish_s == pytest.approx(5.0)
    # no load measured and tau exact: the promise is the GPS finish plus the bound
    assert v.deadline_s == pytest.approx(v.fair_finish_s + v.delay_bound_s)
    assert v.promise == "firm" and v.promise_reason == ""
    assert v.eta_s >= v.fair_finish_s - 1e-9
    d.submit(req("a0", "a", 10, 10), 0.0)  # a enters the GPS reference with its request
    d.register_agent("b", 50_000.0, 1.0)
    d.submit(req("b0", "b", 10, 10), 1.0)
    # two backlogged: a had 40,000 left at t=1, now served at 5,000/s
    assert d.view("a", 1.0).fair_finish_s == pytest.approx(1.0 + 8.0)
    snap = d.snapshot(1.0)
    assert snap["policy"] == "justitia" and snap["M"] == 1000 and snap["backlog"] == 2
    assert [q["agent_id"] for q in snap["queue"]] == ["a", "b"]
    d.set_iteration_time(0.05, 1.0)
    assert d.rate == pytest.approx(20_000.0)
    d.set_kv_capacity(2000, 1.0)
    assert d.rate == pytest.approx(40_000.0)


def test_priority_is_an_int_in_tag_order():
    d = Dispatcher("justitia", 1000, 0.01)
    d.register_agent("a", 5_000.0, 0.0)
    d.register_agent("b", 1_000.0, 0.0)
    pa, pb = d.priority("a"), d.priority("b")
    assert isinstance(pa, int) and isinstance(pb, int) and pb < pa


ops = st.lists(
    st.tuples(
        st.integers(0, 5),  # agent
        st.integers(1, 400),  # prompt
        st.integers(1, 300),  # output
        st.integers(0, 300),  # expected output (estimates may be wrong)
        st.floats(0.0, 1.0),  # time step
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(POLICY_NAMES), ops, st.integers(300, 3000), st.booleans())
def test_accounting_returns_to_zero(policy, ops, m, backfill):
    d = Dispatcher(policy, m, 0.02, backfill=backfill)
    now = 0.0
    agents = set()
    real = {}
    for k, (a, p, out, exp, dt) in enumerate(ops):
        now += dt
        aid = f"a{a}"
        if aid not in agents:
            d.register_agent(aid, float(p * out), now)
            agents.add(aid)
        d.submit(RequestSpec(f"r{k}", aid, p, out, exp), now)
        real[f"r{k}"] = (p, out)
        for spec in d.admit(now):
            assert spec.request_id in real
        if d.policy.admission == "footprint" and d.ledger.running_count > 1:
            assert d.ledger.reserved_kv <= m
    # drain: finish whatever runs, admit the rest, until nothing is left
    running = [r for r, s in d.requests.items() if s.status is RequestStatus.RUNNING]
    while running:
        now += 1.0
        for rid in running:
            d.on_request_finished(rid, *real[rid], now)
        d.admit(now)
        running = [r for r, s in d.requests.items() if s.status is RequestStatus.RUNNING]
    assert d.ledger.pending_count == 0
    for aid in sorted(agents):
        d.finish_agent(aid, now)
    assert d.is_idle()
    d.clock.advance(now + 1e9)
    assert d.clock.backlog == 0


def test_n_sequences_reserve_and_pay_for_each_sequence():
    # vLLM keeps a prompt per sequence: n=3 holds three footprints and costs three requests.
    d = Dispatcher("justitia", 600, 0.01, block_size=16)
    d.register_agent("a", kv_cost(100, 50) * 3, 0.0)
    d.submit(RequestSpec("r", "a", prompt_tokens=100, max_tokens=50, n=3), 0.0)
    d.submit(RequestSpec("s", "a", prompt_tokens=100, max_tokens=50), 0.0)
    assert ids(d.admit(0.0)) == ["r"]  # 3 x 160 = 480: 160 more is over 600
    assert d.ledger.reserved_kv == 3 * 160
    d.on_request_finished("r", 100, 5 + 6 + 7, 1.0, each=(5, 6, 7))
    assert d.agents["a"].consumed_kv == sum(kv_cost(100, x) for x in (5, 6, 7))
    assert d.ledger.reserved_kv == 0
