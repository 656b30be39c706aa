"""Re-prediction as agents run: the estimate, the ETAs that use it, and the tag
that it never moves (fast tier: the pure core and the fake engine server)."""

from __future__ import annotations

import pytest

from server.scheduler import Dispatcher, RequestSpec, kv_cost
from server.scheduler.reprediction import conditional_median, expected_total
from tests.support.agents import complete, register
from tests.support.clients import local_client
from tests.support.fake_engine import FakeServer


def test_the_estimate_starts_at_the_prediction_and_follows_an_over_run() -> None:
    assert expected_total(1000.0, 0.0, p50=1200.0, p90=2400.0) == pytest.approx(1000.0)
    # a little consumed: about the prediction still
    assert expected_total(1000.0, 100.0, p50=1200.0, p90=2400.0) == pytest.approx(1000.0, rel=0.03)
    # past p90: the estimate grows beyond what was consumed
    far = expected_total(1000.0, 5000.0, p50=1200.0, p90=2400.0)
    assert far > 5000.0
    assert expected_total(1000.0, 50_000.0, p50=1200.0, p90=2400.0) > 50_000.0
    # a wider interval expects a longer tail beyond the same consumption
    assert expected_total(1000.0, 5000.0, p50=1200.0, p90=9600.0) > far
    # no interval (cold start): a wide default, never below what was consumed
    assert expected_total(1000.0, 3000.0) > 3000.0
    assert conditional_median(0.0, 500.0, 1.0) == 500.0


def test_declared_stages_pull_the_estimate_towards_their_extrapolation() -> None:
    # 2 of 4 declared stages cost 2,000: about 4,000 in all, not the 100,000 predicted
    lower = expected_total(100_000.0, 2000.0, stages_done=2, stages=4)
    assert 2000.0 < lower < 100_000.0 / 4
    # all declared stages done: the interval's estimate alone
    assert expected_total(100_000.0, 2000.0, stages_done=4, stages=4) == expected_total(100_000.0, 2000.0)


def _two_agents() -> Dispatcher:
    d = Dispatcher("justitia", kv_capacity_tokens=4000, iteration_time_s=0.01)
    d.register_agent("a", kv_cost(100, 50) * 10, now=0.0)  # served first (smaller tag)
    d.register_agent("b", kv_cost(100, 50) * 40, now=0.0)
    for agent in ("a", "b"):
        d.submit(RequestSpec(f"{agent}0", agent, 100, 50, 50), 0.0)
    d.admit(0.0, engine_free_kv_tokens=4000)
    d.on_request_finished("a0", 100, 50, 0.1)
    d.refresh_etas(0.1)
    return d


def test_a_re_prediction_moves_etas_but_never_the_tag() -> None:
    base = _two_agents()
    eta_a, eta_b = base.eta_time("a", 0.1), base.eta_time("b", 0.1)
    for factor, later in ((5.0, True), (0.2, False)):
        d = _two_agents()
        a = d.agents["a"]
        tag, charged = a.virtual_finish, a.charged_cost
        d.repredict("a", a.predicted_cost * factor, 0.1)
        d.refresh_etas(0.1)
        assert (a.virtual_finish, a.charged_cost) == (tag, charged)  # the tag stays
        assert d.view("a", 0.1).expected_cost == pytest.approx(a.predicted_cost * factor)
        # a's own ETA and that of b, queued behind a, follow a's remaining work
        assert (d.eta_time("a", 0.1) > eta_a) is later and (d.eta_time("b", 0.1) > eta_b) is later


def test_submitted_work_counts_even_when_the_estimate_is_lower() -> None:
    d = _two_agents()
    d.repredict("b", 1.0, 0.1)  # b's estimate: almost nothing left
    d.submit(RequestSpec("b1", "b", 400, 300, 300), 0.1)  # but it submits a large request
    d.refresh_etas(0.1)
    own, total = d.etas.remaining(d.agents["b"])
    assert own >= kv_cost(400, 300) and total >= d.agents["b"].committed_kv


def test_under_declaring_gains_nothing_the_over_run_is_charged() -> None:
    d = Dispatcher("justitia", kv_capacity_tokens=4000, iteration_time_s=0.01)
    d.register_agent("liar", 10.0, now=0.0)  # declares almost nothing
    d.repredict("liar", 1.0, 0.0)  # and a re-prediction lower still
    tag = d.agents["liar"].virtual_finish
    d.submit(RequestSpec("r0", "liar", 500, 200, 200), 0.0)
    d.admit(0.0, engine_free_kv_tokens=4000)
    d.on_request_finished("r0", 500, 200, 0.5)
    liar = d.agents["liar"]
    assert liar.charged_cost >= kv_cost(500, 200)  # what it used is charged in full
    assert liar.virtual_finish > tag
    d.repredict("liar", 1.0, 0.6)
    assert liar.charged_cost >= kv_cost(500, 200) and liar.expected_kv == liar.consumed_kv


def test_the_record_carries_the_re_prediction(tmp_path) -> None:
    with FakeServer(tmp_path, retrain_every=0) as srv, local_client(base_url=srv.url, timeout=30) as c:
        agent = register(c, type_="overrun", prompt="tiny", predicted_cost=100.0,
                         metadata={"stages": 3})
        assert agent["expected_cost"] is None and agent["predicted_cost_p90"] is None
        assert complete(c, agent["id"], 40, prompt="x" * 300).status_code == 200
        rec = c.get(f"/v1/agents/{agent['id']}").json()
        consumed = rec["consumed_cost"]
        assert consumed > 100.0 * 10
        # one of three declared stages done: about three times what it consumed
        assert consumed * 1.5 < rec["expected_cost"] < consumed * 6
        assert rec["charged_cost"] >= consumed  # the over-run is charged, whatever the estimate
        assert c.post(f"/v1/agents/{agent['id']}/finish").status_code == 200
