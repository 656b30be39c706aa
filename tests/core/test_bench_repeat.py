"""`justitia bench live --repeat N`: policies alternated N times, each policy's row its run of
median mean JCT, and the ratios within each round (fast: the selection only; the live path
runs in tests/engine/test_bench_live.py)."""

from __future__ import annotations

import json

import pytest

from justitia_cli import main
from server.sim.report import median_interval, median_runs, write_json
from server.sim.results import AgentResult, PolicyResult


def run(policy: str, *jcts: float) -> PolicyResult:
    return PolicyResult(policy, [AgentResult(f"a{i}", "t", 0.0, j, j, 1.0) for i, j in enumerate(jcts)])


def test_each_policy_s_row_is_its_median_run_and_ratios_are_paired_by_round(tmp_path) -> None:
    # the machine is slow in round 1: both policies' runs take twice as long there
    rounds = [[run("justitia", 8, 12), run("vtc", 20, 20)],
              [run("justitia", 16, 24), run("vtc", 40, 40)],
              [run("justitia", 9, 13), run("vtc", 19, 19)]]
    results, repeats = median_runs(rounds)
    assert [r.summary()["mean_jct_s"] for r in results] == [11.0, 20.0]  # the middle run of each
    assert repeats["rounds"] == 3 and len(repeats["runs"]) == 6
    assert [(r["round"], r["policy"]) for r in repeats["runs"]][:2] == [(0, "justitia"), (0, "vtc")]
    [paired] = [c for c in repeats["paired"] if c["baseline"] == "vtc"]
    assert paired["mean_jct_ratio_by_round"] == pytest.approx([0.5, 0.5, 11 / 19])
    assert paired["median_mean_jct_ratio"] == pytest.approx(0.5)
    # three rounds: only the smallest and largest bound the median, 75% of the time
    assert paired["median_interval"] == pytest.approx({"low": 0.5, "high": 11 / 19, "coverage": 0.75})
    # summed over the rounds: every round weighs by its JCTs (the slow round counts double)
    assert paired["pooled_mean_jct_ratio"] == pytest.approx((10 + 20 + 11) / (20 + 40 + 19))
    # two rounds: the lower middle one
    results, _ = median_runs(rounds[:2])
    assert [r.summary()["mean_jct_s"] for r in results] == [10.0, 20.0]
    doc = write_json(tmp_path / "out.json", {"mode": "live"}, results, repeats)
    assert json.loads((tmp_path / "out.json").read_text())["repeats"] == json.loads(json.dumps(doc["repeats"]))
    with pytest.raises(ValueError):
        median_runs([[run("justitia", 1)], []])


def test_repeat_must_be_positive(tmp_path, capsys) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "arrival": 0, "stages": [[{"p": 30, "d": 10}]]}) + "\n")
    rc = main(["bench", "live", "--workload", str(workload), "--kv-tokens", "4096", "--repeat", "0"])
    assert rc == 2
    assert "--repeat must be at least 1" in capsys.readouterr().err


def test_the_median_interval_is_the_sign_tests() -> None:
    """k-th smallest to k-th largest of n covers the median with 1 - 2 P(Bin(n, 1/2) < k):
    the narrowest such interval with 90% at least."""
    eleven = [0.956, 0.828, 0.916, 0.967, 0.902, 0.820, 0.834, 1.070, 0.907, 0.872, 0.880]
    interval = median_interval(eleven)
    # k = 3: 1 - 2 (1 + 11 + 55) / 2048 = 0.935; k = 4 would cover 0.773 only
    assert interval == pytest.approx({"low": 0.834, "high": 0.956, "coverage": 1 - 2 * 67 / 2048})
    five = median_interval([0.834, 1.070, 0.907, 0.872, 0.880])
    assert five == pytest.approx({"low": 0.834, "high": 1.070, "coverage": 1 - 2 / 32})
    assert median_interval([0.9, 0.8], level=0.99) == pytest.approx({"low": 0.8, "high": 0.9, "coverage": 0.5})
    assert median_interval([0.9]) is None and median_interval([]) is None
