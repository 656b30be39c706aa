import json
from collections import Counter

import pytest

from server.shared.profiles import get_profile
from server.sim.mix import AGENT_TYPES, make_mix
from server.sim.simulator import make_predictions
from server.sim.workload import WorkloadError, load_workload, save_workload


def test_round_trip_and_extra_fields_are_ignored(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(
        json.dumps({"id": "a17", "type": "mapreduce_summary", "arrival": 12.5, "prompt": "x", "owner": "me",
                    "stages": [[{"p": 812, "d": 120}, {"p": 790, "d": 118}], [{"p": 300, "d": 256}]]}) + "\n"
        + json.dumps({"id": "a1", "arrival": 1, "stages": [[{"p": 1, "d": 1}]]}) + "\n"
    )
    agents = load_workload(path)
    assert [a.id for a in agents] == ["a1", "a17"]  # sorted by arrival
    assert agents[1].stages == [[(812, 120), (790, 118)], [(300, 256)]]
    assert agents[1].critical_path_tokens == 120 + 256
    assert agents[1].prefill_tokens == 812 + 790 + 300  # nothing shared: every prompt token
    save_workload(agents, tmp_path / "w2.jsonl")
    assert [a.stages for a in load_workload(tmp_path / "w2.jsonl")] == [a.stages for a in agents]


@pytest.mark.parametrize("line", ['{"id": "a", "stages": []}',
                                  '{"id": "a", "arrival": 0, "stages": [[{"p": 1, "d": 0}]]}', "nope"])
def test_bad_workloads_are_rejected(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(WorkloadError):
        load_workload(path)


def test_the_mix_has_nine_types_the_size_shares_and_fits_the_profile():
    profile = get_profile("a100-llama7b")
    agents = make_mix(300, profile, seed=3)
    assert set(a.type for a in agents) == set(AGENT_TYPES)
    sizes = Counter(a.extra["size"] for a in agents)
    assert 0.62 <= sizes["small"] / 300 <= 0.82 and sizes["large"] >= 1
    for a in agents:
        for st in a.stages:
            for p, d in st:
                assert p >= 1 and d >= 1 and p + d <= profile.max_model_len
    # large agents cost more than small ones on the whole
    mean = lambda s: sum(a.kv_cost for a in agents if a.extra["size"] == s) / sizes[s]  # noqa: E731
    assert mean("large") > mean("medium") > mean("small")


def test_density_divides_the_gaps_and_keeps_the_agents():
    profile = get_profile("a100-llama7b")
    one = make_mix(50, profile, seed=1, density=1)
    three = make_mix(50, profile, seed=1, density=3)
    assert [a.stages for a in one] == [a.stages for a in three]
    assert three[-1].arrival == pytest.approx(one[-1].arrival / 3, rel=1e-4)
    cpu = make_mix(50, get_profile("cpu-tiny"), seed=1)
    assert max(p + d for a in cpu for st in a.stages for p, d in st) <= get_profile("cpu-tiny").max_model_len


def test_output_scale_stretches_only_the_named_types_outputs():
    profile = get_profile("a100-llama7b")
    plain = make_mix(120, profile, seed=2)
    stretched = make_mix(120, profile, seed=2, output_scale={"equation_verification": 4.0})
    assert [a.type for a in plain] == [a.type for a in stretched]  # the same draws
    for a, b in zip(plain, stretched, strict=True):
        pairs = list(zip((r for st in a.stages for r in st), (r for st in b.stages for r in st), strict=True))
        if a.type == "equation_verification":
            for (p, d), (p2, d2) in pairs:
                assert d2 == min(4 * d, profile.max_model_len // 2)
                assert p2 == min(p, profile.max_model_len - d2)
        else:
            assert a.stages == b.stages
    # the same offered load: longer outputs cost more, so arrivals spread out
    assert stretched[-1].arrival > plain[-1].arrival


def test_noisy_predictions_stay_within_the_factor():
    agents = make_mix(40, get_profile("a100-llama7b"), seed=2)
    pred = make_predictions(agents, "noisy:3", seed=5)
    ratios = [p / a.kv_cost for p, a in zip(pred.kv, agents, strict=True)]
    assert all(1 / 3 - 1e-9 <= r <= 3 + 1e-9 for r in ratios)
    assert max(ratios) > 1.5 and min(ratios) < 0.67
    assert make_predictions(agents, "oracle").kv == [a.kv_cost for a in agents]
    with pytest.raises(ValueError):
        make_predictions(agents, "noisy:0.5")


def test_the_contended_recipe_rebuilds_the_contended_workload(tmp_path):
    """benchmarks/contended_workload.py, seed 3, is contended48.jsonl itself: the teaching
    workload of `bench live --teach` (another seed) is another sample of the same traffic."""
    from benchmarks.contended_workload import ROOT, contended

    save_workload(contended(3), tmp_path / "c.jsonl")
    assert (tmp_path / "c.jsonl").read_text() == (ROOT / "benchmarks/workloads/contended48.jsonl").read_text()
    other = contended(4)
    assert len(other) == 48 and other[0].stages != contended(3)[0].stages
