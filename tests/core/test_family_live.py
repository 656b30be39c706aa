"""`bench family --live`'s parts that run without the engine: its checks of the profile and
the options, the simulated side of a live run, and the comparison's arithmetic (the live runs
themselves are benchmarks: benchmarks/results/family_live.json)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from justitia_cli import CommandError, main
from justitia_cli.bench.family_live import (
    WITHIN,
    agent_records,
    arrival_lag,
    broken_promises,
    calibrated_profile,
    compare,
    load_now,
    simulate_run,
    summarise_live,
)
from server.shared.profiles import get_profile
from server.sim.calibrate import save_profile
from server.sim.family import FamilyRow, simulate_member, taught_workload
from server.sim.shapes import ShapeSpec, make_shaped

CPU = get_profile("cpu-tiny")
M = 4096


def profile_file(tmp_path, kv_tokens: int = M):
    path = tmp_path / f"profile_{kv_tokens}.json"
    save_profile(replace(CPU, kv_tokens=kv_tokens), path, settings={"kv_tokens": kv_tokens, "measured_at": "then"},
                 provenance={"argv": ["justitia", "bench", "calibrate", "--kv-tokens", str(kv_tokens)]})
    return path


def test_live_needs_a_profile_calibrated_with_the_engines_kv_capacity(tmp_path, capsys) -> None:
    # a built-in profile describes another host: refused before any server starts
    assert main(["bench", "family", "--live", "--shapes", "poisson", "--seeds", "100"]) == 2
    assert "bench calibrate" in capsys.readouterr().err
    other = profile_file(tmp_path, 8192)
    assert main(["bench", "family", "--live", "--shapes", "poisson", "--seeds", "100",
                 "--profile", str(other), "--kv-tokens", str(M)]) == 2
    assert "8192" in capsys.readouterr().err
    made = calibrated_profile(str(profile_file(tmp_path)), M)
    assert made["made_by"] == ["justitia", "bench", "calibrate", "--kv-tokens", str(M)]
    assert made["measured_at"] == "then" and made["profile"]["kv_tokens"] == M
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(CommandError):
        calibrated_profile(str(bad), M)
    # the engine must hold one request of the context length
    assert main(["bench", "family", "--live", "--shapes", "poisson", "--seeds", "100", "--profile",
                 str(profile_file(tmp_path, 1024)), "--kv-tokens", "1024", "--max-model-len", "2048"]) == 2
    assert "--max-model-len" in capsys.readouterr().err


def test_the_simulated_side_of_a_taught_run_starts_the_member_where_the_live_one_started() -> None:
    spec = ShapeSpec("bursts", 8, 0.9, seed=100)
    agents, ids = taught_workload(spec, CPU, M, offset_s=123.0)
    fresh, _ = taught_workload(spec, CPU, M, offset_s=0.0)
    shifted = {a.id: a.arrival for a in agents if a.id in ids}
    assert {i: round(t - 123.0, 4) for i, t in shifted.items()} == \
        {a.id: round(a.arrival, 4) for a in fresh if a.id in ids}
    [taught] = simulate_member(spec, "taught", ["justitia"], CPU, M, teach_offset_s=123.0)
    assert {a.id for a in taught.agents} == ids  # the member's agents only
    assert min(a.arrival_s for a in taught.agents) >= 123.0
    with pytest.raises(ValueError):
        simulate_member(spec, "stale", ["justitia"], CPU, M)


def row(mean: float, mode: str = "fresh", seed: int = 100, kept: int = 8) -> FamilyRow:
    return FamilyRow(shape="poisson", seed=seed, policy="justitia", agents=8, mean_jct_s=mean, eta_error_p50=0.2,
                     eta_error_p90=0.5, promises_kept=kept, promises=8, deadline_over_jct_p50=4.0,
                     eta_coverage=0.75, mode=mode)


def test_the_simulator_is_within_15_percent_or_not_by_its_error_over_the_live_mean() -> None:
    assert WITHIN == 0.15
    near = compare(row(10.0), row(8.6), refit_mean_jct_s=9.5)
    assert near["sim_error"] == pytest.approx(-0.14) and near["sim_within"]
    assert near["live_over_sim_mean_jct"] == pytest.approx(10.0 / 8.6)
    assert near["sim_refit_error"] == pytest.approx(-0.05)
    far = compare(row(10.0, seed=101, kept=7), row(11.6, seed=101))
    assert far["sim_error"] == pytest.approx(0.16) and not far["sim_within"]
    assert far["sim_refit_error"] is None
    [summary] = summarise_live([near, far])
    assert summary["seeds"] == [100, 101] and summary["runs"] == 2 and summary["sim_within"] == 1
    assert summary["live"]["mean_jct_s"] == 10.0 and summary["sim"]["mean_jct_s"] == pytest.approx(10.1)
    assert summary["live"]["promises_kept"] == 15 and summary["sim"]["promises_kept"] == 16
    assert summary["sim_error"] == pytest.approx(0.01)
    json.dumps(summary)  # what the JSON holds
    load = load_now()
    assert len(load["load_average"]) == 3


def test_the_arrival_lag_is_how_late_the_replay_registered_the_agents() -> None:
    lag = arrival_lag({"a": 0.0, "b": 1.0, "c": 2.0}, {"a": 0.01, "b": 1.5, "c": 2.02})
    assert lag["p50"] == pytest.approx(0.02) and lag["max"] == pytest.approx(0.5)
    assert arrival_lag({"a": 0.0}, {}) == {"p50": None, "max": None}  # every agent failed


def test_a_broken_promise_is_named_with_what_it_was_told_and_its_simulated_twin() -> None:
    from server.sim.results import AgentResult, PolicyResult

    def agent(name: str, finish: float, deadline: float | None) -> AgentResult:
        return AgentResult(name, "t", 1.0, finish, 2.0, 5.0, first_eta_s=0.5, first_deadline_s=deadline)

    live = PolicyResult("justitia", [agent("kept", 3.0, 4.0), agent("late", 6.0, 4.0), agent("none", 9.0, None)])
    sim = PolicyResult("justitia", [agent("late", 4.5, 3.5)])
    broken = broken_promises(live, sim)
    assert [b["id"] for b in broken] == ["late"]
    assert broken[0]["jct_s"] == 5.0 and broken[0]["first_deadline_s"] == 4.0
    assert broken[0]["sim_jct_s"] == 3.5 and broken[0]["sim_first_deadline_s"] == 3.5


def test_every_live_agent_is_recorded_with_its_eta_its_jct_and_its_simulated_twin() -> None:
    from server.sim.results import AgentResult, PolicyResult

    live = PolicyResult("justitia", [
        AgentResult("short", "t", 1.0, 5.0, 2.0, 5.0, first_eta_s=2.0, first_eta_interval_s=(1.5, 3.0)),
        AgentResult("long", "t", 2.0, 3.0, 2.0, 5.0, first_eta_s=1.5),
        AgentResult("untold", "t", 2.0, 3.0, 2.0, 5.0),
    ])
    sim = PolicyResult("justitia", [AgentResult("short", "t", 1.0, 4.0, 2.0, 5.0, first_eta_s=2.5)])
    records = {r["id"]: r for r in agent_records(live, sim)}
    assert records["short"]["jct_s"] == 4.0 and records["short"]["first_eta_interval_s"] == [1.5, 3.0]
    assert records["short"]["sim_jct_s"] == 3.0 and records["short"]["sim_first_eta_s"] == 2.5
    assert records["long"]["sim_jct_s"] is None and records["untold"]["first_eta_s"] is None
    # the signed error says which way the first ETAs missed: told 2.0 of 4.0 (-0.5), 1.5 of 1.0 (+0.5)
    assert [a.eta_bias for a in live.agents] == [-0.5, 0.5, None]
    assert live.summary()["eta_bias_p50"] == 0.0
    assert PolicyResult("justitia", live.agents[:1]).summary()["eta_bias_p50"] == -0.5


def test_repeated_runs_of_a_member_are_judged_by_their_median() -> None:
    # three draws of one member: the first and the last are 20% off the simulator, the
    # median is within 15%; another member whose median is off stays off
    draws = [compare(row(mean), row(10.0)) for mean in (8.0, 9.5, 12.5)]
    other = [compare(row(mean, seed=101), row(10.0, seed=101)) for mean in (12.0, 13.0)]
    [summary] = summarise_live(draws + other)
    assert summary["runs"] == 5 and summary["sim_within"] == 1
    first, second = summary["members"]
    assert (first["seed"], first["runs"], first["live_mean_jct_s"]) == (100, 3, [8.0, 9.5, 12.5])
    assert first["live_median_mean_jct_s"] == 9.5 and first["sim_error"] == pytest.approx(0.5 / 9.5)
    assert first["sim_within"] is True
    assert second["live_median_mean_jct_s"] == 12.5 and second["sim_error"] == pytest.approx(-0.2)
    assert second["sim_within"] is False
    assert summary["members_within"] == 1


def test_repeats_are_for_live_runs_and_at_least_one(capsys) -> None:
    assert main(["bench", "family", "--shapes", "poisson", "--seeds", "100", "--repeats", "2"]) == 2
    assert "--repeats needs --live" in capsys.readouterr().err
    assert main(["bench", "family", "--live", "--shapes", "poisson", "--seeds", "100", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_a_run_simulated_again_on_another_step_model_keeps_its_workload() -> None:
    # sized with one profile, simulated on a slower one: the same agents and arrivals, later JCTs
    spec = ShapeSpec("poisson", 12, 0.9, seed=100)
    slow = replace(CPU, base_s=CPU.base_s * 3, per_seq_s=CPU.per_seq_s * 3,
                   per_prefill_token_s=CPU.per_prefill_token_s * 3, per_kv_token_s=CPU.per_kv_token_s * 3)
    [same] = simulate_member(spec, "fresh", ["justitia"], CPU, M)
    [slower] = simulate_member(spec, "fresh", ["justitia"], slow, M, sized_with=CPU)
    [resized] = simulate_member(spec, "fresh", ["justitia"], slow, M)
    assert [(a.id, a.arrival_s) for a in slower.agents] == [(a.id, a.arrival_s) for a in same.agents]
    assert [(a.id, a.arrival_s) for a in resized.agents] != [(a.id, a.arrival_s) for a in same.agents]
    assert slower.summary()["mean_jct_s"] > same.summary()["mean_jct_s"]


def test_a_live_run_simulated_on_another_step_model_keeps_the_live_runs_workload() -> None:
    # the refit (the run's own steps) and a calibration made just before are other step
    # models: the agents and arrivals must stay those the live run replayed, built with the
    # run's profile; sized with the faster or slower model, the load would not be the run's
    spec = ShapeSpec("poisson", 12, 0.9, seed=100)
    slow = replace(CPU, base_s=CPU.base_s * 3, per_seq_s=CPU.per_seq_s * 3,
                   per_prefill_token_s=CPU.per_prefill_token_s * 3, per_kv_token_s=CPU.per_kv_token_s * 3)
    replayed = sorted((a.id, a.arrival) for a in make_shaped(spec, CPU, M))
    fresh = simulate_run(spec, "fresh", "justitia", slow, CPU, M, None)
    assert sorted((a.id, a.arrival_s) for a in fresh.agents) == replayed
    taught = simulate_run(spec, "taught", "justitia", slow, CPU, M, 150.0)
    assert sorted((a.id, round(a.arrival_s - 150.0, 6)) for a in taught.agents) == replayed
    same = simulate_run(spec, "fresh", "justitia", CPU, CPU, M, None)
    assert fresh.summary()["mean_jct_s"] > same.summary()["mean_jct_s"]  # only the engine is slower


def test_calibrating_before_each_run_is_for_live_runs(capsys) -> None:
    assert main(["bench", "family", "--shapes", "poisson", "--seeds", "100", "--calibrate-each"]) == 2
    assert "--calibrate-each needs --live" in capsys.readouterr().err
