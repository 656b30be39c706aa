"""Workload files with shared prompt prefixes (DESIGN section 8, additions) and the mix
builder's prefixes."""

import json

import pytest

from server.shared.profiles import get_profile
from server.sim.mix import make_mix, prefix_share
from server.sim.workload import WorkloadError, load_workload, save_workload


def _write(tmp_path, *objs):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_prefix_object_and_list_round_trip(tmp_path):
    path = _write(tmp_path, {"id": "a17", "arrival": 0, "stages": [
        [{"p": 2400, "d": 40, "prefix": {"id": "a17/ctx", "tokens": 2310}},
         {"p": 2500, "d": 10, "prefix": [{"id": "fewshot", "tokens": 1800}, {"id": "a17/ctx", "tokens": 2310}]}],
        [{"p": 300, "d": 5}]]})
    (agent,) = load_workload(path)
    assert agent.prefix(0, 0) == (("a17/ctx", 2310),)
    assert agent.prefix(0, 1) == (("fewshot", 1800), ("a17/ctx", 2310))
    assert agent.prefix(1, 0) == ()
    save_workload([agent], tmp_path / "again.jsonl")
    (again,) = load_workload(tmp_path / "again.jsonl")
    assert again.prefixes == agent.prefixes and again.stages == agent.stages


def test_the_prefill_an_agent_declares_leaves_out_the_prefixes_its_earlier_requests_computed(tmp_path):
    path = _write(tmp_path, {"id": "a17", "arrival": 0, "stages": [
        [{"p": 2400, "d": 40, "prefix": {"id": "a17/ctx", "tokens": 2310}},
         {"p": 2500, "d": 10, "prefix": [{"id": "fewshot", "tokens": 1800}, {"id": "a17/ctx", "tokens": 2310}]}],
        [{"p": 2600, "d": 5, "prefix": [{"id": "fewshot", "tokens": 1800}]}]]})
    (agent,) = load_workload(path)
    # the first request computes all of its prompt; the second finds a17/ctx (2,310 tokens)
    # named before it; the third finds fewshot (1,800), which the second named
    assert agent.prefill_tokens == 2400 + (2500 - 2310) + (2600 - 1800)


def test_a_file_without_prefixes_means_what_it_meant():
    agents = load_workload("benchmarks/workloads/mix300_2x.jsonl")
    assert all(not a.prefixes and a.kv_cost_shared == a.kv_cost for a in agents)


def test_shared_cost_counts_a_stage_prefix_once():
    agents = load_workload("benchmarks/workloads/mix300p_2x.jsonl")
    sc = next(a for a in agents if a.type == "self_consistency")
    p = sc.stages[0][0][0]
    ds = [d for _, d in sc.stages[0]]
    # the whole question is shared by the samples: held once, for the longest sample
    stage0 = p * max(ds) + sum(d * (d + 1) // 2 for d in ds)
    assert sc.kv_cost_shared < sc.kv_cost
    assert sc.kv_cost_shared == pytest.approx(stage0 + sum(
        pp * d + d * (d + 1) // 2 for st in sc.stages[1:] for pp, d in st))


@pytest.mark.parametrize("prefix, why", [
    ({"id": "x", "tokens": 101}, "tokens <= p"),
    ({"id": "", "tokens": 5}, "non-empty"),
    ({"id": "x", "tokens": "5"}, "integer"),
    ([{"id": "x", "tokens": 50}, {"id": "y", "tokens": 40}], "shortest first"),
    ("x", "non-empty string"),
])
def test_bad_prefixes_are_rejected_with_a_reason(tmp_path, prefix, why):
    path = _write(tmp_path, {"id": "a", "arrival": 0, "stages": [[{"p": 100, "d": 1, "prefix": prefix}]]})
    with pytest.raises(WorkloadError, match=why):
        load_workload(path)


def test_the_prefix_mix_keeps_lengths_and_arrivals_and_shares_about_40_percent():
    profile = get_profile("a100-llama7b")
    plain = make_mix(300, profile, density=2, load_1x=0.6, seed=0)
    shared = make_mix(300, profile, density=2, load_1x=0.6, seed=0, prefixes=True)
    assert [(a.stages, a.arrival) for a in plain] == [(a.stages, a.arrival) for a in shared]
    assert 0.35 <= prefix_share(shared) <= 0.45
    # every agent type's system prompt is shared across agents of the type
    assert any(chain[0][0] == "sys/alfworld" for a in shared for chain in a.prefixes.values())
    for a in shared:
        for (s, i), chain in a.prefixes.items():
            assert chain[-1][1] <= a.stages[s][i][0]


def test_the_shipped_prefix_mixes_are_the_builder_output():
    profile = get_profile("a100-llama7b")
    for d in (2, 3, 6, 10):
        built = make_mix(300, profile, density=d, load_1x=0.6, seed=0, prefixes=True)
        shipped = load_workload(f"benchmarks/workloads/mix300p_{d}x.jsonl")
        assert [a.prefixes for a in sorted(built, key=lambda a: a.arrival)] == [a.prefixes for a in shipped]
