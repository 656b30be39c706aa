"""las: least attained service per agent (p + 2d, charged on finish), decayed with a
half-life, as llm-d's program-aware fairness plugin; and Jain's index over slowdowns."""

import json
import math

import pytest

from justitia_cli import main
from server.scheduler import Dispatcher, RequestSpec, get_policy
from server.scheduler.policies import LAS
from server.sim.results import AgentResult, PolicyResult, jain_index
from server.sim.simulator import isolated_jct_s
from server.sim.workload import AgentSpec


def ids(specs):
    return [s.request_id for s in specs]


def las(half_life_s=60.0, head_wait_weight=0.0):
    # head_wait_weight 0: pure least attained service (the plugin's score is tested below)
    policy = get_policy("las", las_half_life_s=half_life_s, las_head_wait_weight=head_wait_weight)
    return Dispatcher(policy, 1_000_000, 0.01)


def serve_one(d, rid, agent, p, d_out, t_admit, t_finish):
    d.submit(RequestSpec(rid, agent, p, d_out), t_admit)
    assert ids(d.admit(t_admit)) == [rid]
    d.on_request_finished(rid, p, d_out, t_finish)


def test_service_is_prompt_plus_twice_output_charged_on_finish():
    d = las()
    d.register_agent("a", 1.0, 0.0)
    d.submit(RequestSpec("a0", "a", 300, 100), 0.0)
    d.admit(0.0)
    pol = d.policy
    assert pol.service(d.agents["a"], 0.0) == 0.0  # nothing charged on admission
    d.on_request_finished("a0", 300, 50, 0.0)
    assert pol.service(d.agents["a"], 0.0) == pytest.approx(300 + 2 * 50)
    # one half-life later, half of it is left
    assert pol.service(d.agents["a"], 60.0) == pytest.approx(200.0)


def test_the_agent_with_less_decayed_service_goes_first():
    # "old" attained 1,000 at t=0, "new" 600 at t=60: with a 60 s half-life old has 500 left
    # by then and goes first; without decay (a huge half-life) new has less and goes first.
    def first(half_life_s):
        d = las(half_life_s)
        for a in ("old", "new"):
            d.register_agent(a, 1.0, 0.0)
        serve_one(d, "o0", "old", 1000, 0, 0.0, 0.0)
        serve_one(d, "n0", "new", 600, 0, 60.0, 60.0)
        d.submit(RequestSpec("n1", "new", 10, 10), 60.0)
        d.submit(RequestSpec("o1", "old", 10, 10), 60.0)
        return ids(d.admit(60.0, engine_free_slots=1))

    assert first(60.0) == ["o1"]
    assert first(1e9) == ["n1"]


def test_an_agent_with_no_service_goes_first_and_ties_go_to_the_oldest_head():
    d = las()
    for a in ("served", "x", "y"):
        d.register_agent(a, 1.0, 0.0)
    serve_one(d, "s0", "served", 10, 1, 0.0, 1.0)
    d.submit(RequestSpec("s1", "served", 10, 10), 2.0)
    d.submit(RequestSpec("y0", "y", 10, 10), 3.0)
    d.submit(RequestSpec("x0", "x", 10, 10), 4.0)
    assert ids(d.admit(5.0)) == ["y0", "x0", "s1"]


def test_the_plugins_score_lets_a_long_wait_beat_a_little_more_service():
    # service 100 with the oldest head, 0 with the newest, 1,000 in between: normalized
    # service 0.1, 0, 1 and head wait 1, 0, 0.5; scores 0.8 x 0.9 + 0.2 = 0.92, 0.8, 0.1
    def order(weight):
        d = las(1e9, weight)
        for a in ("little", "none", "much"):
            d.register_agent(a, 1.0, 0.0)
        serve_one(d, "l0", "little", 100, 0, 0.0, 0.0)
        serve_one(d, "m0", "much", 1000, 0, 0.0, 0.0)
        d.submit(RequestSpec("l1", "little", 10, 10), 1.0)
        d.submit(RequestSpec("m1", "much", 10, 10), 2.0)
        d.submit(RequestSpec("n1", "none", 10, 10), 3.0)
        return [ids(d.admit(4.0, engine_free_slots=1))[0] for _ in range(3)]

    assert order(0.2) == ["l1", "n1", "m1"]  # the plugin's default weights
    assert order(0.0) == ["n1", "l1", "m1"]  # least attained service only


def test_the_score_queue_keeps_the_accounting():
    d = Dispatcher("las", 10_000, 0.01)
    for a in ("a", "b"):
        d.register_agent(a, 1.0, 0.0)
    d.submit(RequestSpec("a0", "a", 10, 5), 0.0)
    d.submit(RequestSpec("a1", "a", 10, 5), 0.0)
    d.submit(RequestSpec("b0", "b", 10, 5), 0.0)
    assert d.leader() is None or d.leader().agent_id in ("a", "b")
    assert len(d.admit(0.0, engine_free_slots=1)) == 1
    d.cancel_agent("b", 0.5)
    for spec in d.admit(1.0):
        d.on_request_finished(spec.request_id, 10, 5, 2.0)
    for rid in [r for r in list(d.requests)]:
        d.on_request_finished(rid, 10, 5, 2.0)
    d.finish_agent("a", 3.0)
    assert d.is_idle() and d.admit(3.0) == []


def test_admission_reserves_no_footprint():
    # vLLM-style: a request is admitted when its prompt fits, whatever it may grow to
    d = Dispatcher("las", 1000, 0.01)
    d.register_agent("a", 1.0, 0.0)
    for k in range(3):
        d.submit(RequestSpec(f"a{k}", "a", 100, 800), 0.0)
    assert len(d.admit(0.0)) == 3  # footprints of 900 each would admit one


def test_keys_stay_finite_and_ordered_after_days():
    d = las(1.0)  # a one-second half-life over a week: 2^604800 would overflow a float
    for a in ("a", "b"):
        d.register_agent(a, 1.0, 0.0)
    week = 7 * 86_400.0
    serve_one(d, "a0", "a", 100, 0, week, week)
    serve_one(d, "b0", "b", 100, 0, week + 1.0, week + 1.0)
    a, b = d.agents["a"], d.agents["b"]
    assert math.isfinite(a.las_service) and math.isfinite(b.las_service)
    assert d.policy.service(a, week + 1.0) == pytest.approx(50.0)
    assert a.las_service < b.las_service
    assert d.priority("a") < d.priority("b")


def test_half_life_is_configurable_and_checked():
    assert get_policy("las").half_life_s == 60.0
    assert get_policy("las", las_half_life_s=5).half_life_s == 5.0
    assert get_policy("justitia", las_half_life_s=5) is get_policy("justitia")
    assert get_policy("las").head_wait_weight == 0.2
    assert get_policy("las", las_head_wait_weight=0).head_wait_weight == 0.0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="half-life"):
            LAS("las", half_life_s=bad)
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="head-wait"):
            LAS("las", head_wait_weight=bad)


def test_accounting_returns_to_zero():
    d = las()
    d.register_agent("a", 1.0, 0.0)
    serve_one(d, "a0", "a", 10, 5, 0.0, 1.0)
    d.finish_agent("a", 2.0)
    assert d.is_idle()


# -- Jain's index over slowdowns --------------------------------------------------------------


def test_jain_index():
    assert jain_index([]) is None
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / 20)


def test_slowdown_is_jct_over_the_agents_time_alone():
    from server.shared.profiles import get_profile

    profile = get_profile("a100-llama7b")
    two_stage = AgentSpec("a", "t", 5.0, [[(500, 100), (500, 100)], [(200, 50)]])
    one = AgentSpec("b", "t", 0.0, [[(500, 100)]])
    alone = isolated_jct_s([two_stage, one], profile)
    # alone, a stage lasts as long as its longest decode: 150 iterations against 100
    assert alone[0] > alone[1] > 0
    assert alone[0] / alone[1] == pytest.approx(1.5, rel=0.1)
    r = PolicyResult("x", [AgentResult("a", "t", 0.0, 2 * alone[0], 0.0, 1.0, isolated_s=alone[0]),
                           AgentResult("b", "t", 0.0, alone[1], 0.0, 1.0, isolated_s=alone[1])])
    assert [a.slowdown for a in r.agents] == pytest.approx([2.0, 1.0])
    assert r.summary()["jain_slowdown"] == pytest.approx(9 / 10)


def test_bench_sim_reports_las_and_jains_index(tmp_path):
    from server.shared.profiles import get_profile
    from server.sim.mix import make_mix
    from server.sim.workload import save_workload

    workload = tmp_path / "w.jsonl"
    save_workload(make_mix(30, get_profile("a100-llama7b"), seed=3, density=2), workload)
    out = tmp_path / "r.json"
    assert main(["bench", "sim", "--workload", str(workload), "--policies", "justitia,las",
                 "--las-half-life-s", "30", "--las-head-wait-weight", "0.5", "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["las_half_life_s"] == 30 and doc["config"]["las_head_wait_weight"] == 0.5
    for r in doc["results"]:
        assert 0 < r["jain_slowdown"] <= 1
        slowdowns = [a["slowdown"] for a in r["agents"]]
        assert all(s >= 1 - 1e-6 for s in slowdowns)  # no one finishes faster than alone
        assert r["jain_slowdown"] == pytest.approx(jain_index(slowdowns))


@pytest.mark.parametrize("option, value", [("--las-half-life-s", "0"), ("--las-half-life-s", "-3"),
                                           ("--las-half-life-s", "inf"), ("--las-head-wait-weight", "-1")])
def test_bad_las_options_are_one_line_errors(tmp_path, capsys, option, value):
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "type": "t", "arrival": 0, "stages": [[{"p": 5, "d": 5}]]}) + "\n")
    assert main(["bench", "sim", "--workload", str(workload), "--policies", "las", option, value, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--las-half-life-s", "0"], "--las-half-life-s"),
    (["--las-head-wait-weight", "-1"], "--las-head-wait-weight"),
    (["--session-idle-s", "-5"], "--session-idle-s"),
])
def test_serve_refuses_bad_las_and_session_options_before_starting(capsys, argv, needle):
    assert main(["serve", "--policy", "las", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
