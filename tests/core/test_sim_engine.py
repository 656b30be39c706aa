import math

import pytest

from server.shared.profiles import EngineProfile, get_profile
from server.sim.engine import EngineModel, SimRequest, _iterations_to_reach

FLAT = EngineProfile("flat", kv_tokens=1000, max_num_seqs=8, max_model_len=1000,
                     base_s=0.01, per_seq_s=0.0, per_prefill_token_s=0.0, per_kv_token_s=0.0)


def run_to_completion(engine, now=0.0):
    finished = []
    while not engine.idle():
        engine.resume()
        now, done = engine.step(now, math.inf)
        finished += [(r.request_id, now) for r in done]
    return now, finished


def test_one_token_per_iteration_and_stretches_jump_to_the_next_finish():
    e = EngineModel(FLAT, 1000, preempt_newest=True)
    e.add(SimRequest("a", "x", 10, 5))
    e.add(SimRequest("b", "x", 10, 20))
    now, finished = run_to_completion(e)
    assert finished == [("a", pytest.approx(0.05)), ("b", pytest.approx(0.20))]
    assert e.iterations == 20 and e.kv_used == 0


def test_memory_overflow_preempts_the_newest_under_fcfs_and_recomputes():
    e = EngineModel(FLAT, 100, preempt_newest=True)
    e.add(SimRequest("old", "x", 40, 30))
    e.add(SimRequest("new", "x", 40, 30))
    now, finished = run_to_completion(e)
    assert e.preemptions >= 1
    assert [rid for rid, _ in finished][0] == "old"
    assert e.kv_used == 0
    # the preempted request still produced exactly its tokens, later than alone
    assert finished[1][1] > 0.30


def test_priority_preemption_picks_the_largest_priority():
    e = EngineModel(FLAT, 100, preempt_newest=False)
    e.add(SimRequest("low", "x", 40, 30, priority=9))
    e.add(SimRequest("high", "x", 40, 30, priority=1))
    _, finished = run_to_completion(e)
    assert finished[0][0] == "high"


def test_stretch_stops_at_the_first_boundary_after_an_arrival():
    e = EngineModel(FLAT, 1000, preempt_newest=True)
    e.add(SimRequest("a", "x", 10, 100))
    now, _ = e.step(0.0, math.inf)  # prefill iteration
    now, done = e.step(now, 0.0451)
    assert not done
    assert now == pytest.approx(0.05)


def _series_total(k: int, a: float, c: float) -> float:
    """Time of k iterations that take a, a + c, a + 2c, ... seconds."""
    return k * a + c * k * (k - 1) / 2


def test_iteration_count_solves_the_growing_series():
    for a, c, gap in [(0.01, 0.0, 0.1), (0.01, 0.001, 0.5), (0.02, 0.0003, 3.0)]:
        n = _iterations_to_reach(gap, a, c)
        assert _series_total(n, a, c) >= gap - 1e-12
        assert n == 1 or _series_total(n - 1, a, c) < gap


def test_profiles_have_a_positive_gps_tau():
    for name in ("a100-llama7b", "cpu-tiny"):
        p = get_profile(name)
        assert p.tau_ref_s() > 0
        assert p.effective_tau_s(p.kv_tokens, [(1000, 200), (300, 50)]) >= p.tau_ref_s() * 0.5
    with pytest.raises(ValueError):
        get_profile("h100")
