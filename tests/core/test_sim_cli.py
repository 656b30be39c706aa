import itertools
import json

import pytest

from justitia_cli import main
from server.shared.profiles import get_profile
from server.sim.mix import make_mix
from server.sim.workload import save_workload

AGENT_KEYS = {"id", "arrival_s", "finish_s", "jct_s", "gps_finish_s", "delay_bound_s"}
RESULT_KEYS = {"policy", "mean_jct_s", "p50_jct_s", "p90_jct_s", "p99_jct_s", "max_jct_s", "makespan_s", "agents"}


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("wl") / "w.jsonl"
    save_workload(make_mix(40, get_profile("a100-llama7b"), seed=4, density=2), path)
    return path


def test_bench_sim_writes_the_design_contract(workload, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "sim", "--workload", str(workload),
               "--policies", "fcfs,sjf,parrot,srjf,vtc,justitia,justitia-c",
               "--kv-tokens", "20000", "--json", str(out), "--prediction", "noisy:3", "--profile", "a100-llama7b",
               "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["kv_tokens"] == 20000 and doc["config"]["prediction"] == "noisy:3"
    assert [r["policy"] for r in doc["results"]] == ["fcfs", "sjf", "parrot", "srjf", "vtc", "justitia", "justitia-c"]
    arrivals = {}
    for line in workload.read_text().splitlines():
        obj = json.loads(line)
        arrivals[obj["id"]] = obj["arrival"]
    for r in doc["results"]:
        assert RESULT_KEYS <= set(r)
        assert len(r["agents"]) == 40
        for a in r["agents"]:
            assert AGENT_KEYS <= set(a)
            assert a["arrival_s"] == pytest.approx(arrivals[a["id"]])
            assert a["jct_s"] == pytest.approx(a["finish_s"] - a["arrival_s"])
            assert a["delay_bound_s"] > 0
        jcts = sorted(a["jct_s"] for a in r["agents"])
        assert r["max_jct_s"] == pytest.approx(jcts[-1])
        assert r["mean_jct_s"] == pytest.approx(sum(jcts) / len(jcts))
        assert r["p50_jct_s"] <= r["p90_jct_s"] <= r["p99_jct_s"] <= r["max_jct_s"]


def test_bench_sim_measures_the_rate_as_the_server_does_when_asked(workload, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "sim", "--workload", str(workload), "--policies", "justitia", "--kv-tokens", "20000",
                 "--tau", "measured", "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["tau"] == "measured"
    [result] = doc["results"]
    assert result["measured_tau_s"] > 0 and result["measured_tau_s"] != doc["config"]["gps_tau_s"]
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "sim", "--workload", str(workload), "--tau", "guessed"])
    assert exit_.value.code == 2 and "--tau" in capsys.readouterr().err


def test_make_workload_command(tmp_path, capsys):
    out = tmp_path / "mix.jsonl"
    assert main(["bench", "make-workload", "--out", str(out), "--agents", "30", "--density", "3", "--seed", "1"]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 30
    assert {"id", "type", "arrival", "stages"} <= set(json.loads(lines[0]))


def test_make_workload_agentic_writes_tool_loops_that_resend_their_conversation(tmp_path, capsys):
    out = tmp_path / "agentic.jsonl"
    assert main(["bench", "make-workload", "--tools", "agentic", "--agents", "20", "--seed", "2",
                 "--out", str(out)]) == 0
    assert "resending their conversation" in capsys.readouterr().out
    agents = [json.loads(line) for line in out.read_text().splitlines()]
    loops = [a for a in agents if a["type"] == "function_calling"]
    assert len(agents) == 20 and len(loops) == 10
    for a in loops:
        assert len(a["pauses_s"]) == len(a["stages"])
        for before, (turn,) in itertools.pairwise(a["stages"]):
            assert turn["ctx"] == before[0]["ctx"]
            assert turn["prefix"][-1] == {"id": turn["ctx"], "tokens": before[0]["p"] + before[0]["d"]}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--policies", "fifo"], "unknown policy"),
        (["--prediction", "noisy:x"], "noisy"),
        (["--prediction", "magic"], "unknown --prediction"),
        (["--profile", "h100"], "unknown profile"),
        (["--prediction", "model:/nonexistent/predictor"], "predictor"),
    ],
)
def test_user_errors_are_one_line(workload, capsys, argv, needle):
    assert main(["bench", "sim", "--workload", str(workload), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_missing_workload_file(tmp_path, capsys):
    assert main(["bench", "sim", "--workload", str(tmp_path / "none.jsonl")]) == 2
    assert "make-workload" in capsys.readouterr().err


def test_starvation_command(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "starvation", "--minutes", "1,2", "--policies", "srjf,justitia", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["flood_minutes"], r["policy"]) for r in rows} == {
        (1, "srjf"), (1, "justitia"), (2, "srjf"), (2, "justitia")}
    assert all(r["within_bound"] for r in rows if r["policy"] == "justitia")


def test_bench_live_tells_the_engines_drift_from_the_simulators_form() -> None:
    # bench live's prediction of a run, then the same with the model the server fitted during
    # the run: a run whose engine steps took twice the profile's is predicted about twice as
    # long by the second, not by the first
    import argparse
    from dataclasses import replace

    from justitia_cli.bench.sim import add_sim_prediction
    from server.sim.simulator import simulate

    profile = get_profile("cpu-tiny")
    agents = make_mix(12, profile, seed=5, density=2, length_scale=0.1)
    slow = replace(profile, base_s=2 * profile.base_s, per_seq_s=2 * profile.per_seq_s,
                   per_prefill_token_s=2 * profile.per_prefill_token_s, per_kv_token_s=2 * profile.per_kv_token_s)
    live = simulate(agents, "justitia", slow, 4096, tau="measured")  # stands for the live run
    live.extra["time_model"] = {"engines": {"local": {
        "base_s": slow.base_s, "per_seq_s": slow.per_seq_s, "per_prefill_token_s": slow.per_prefill_token_s,
        "per_kv_token_s": slow.per_kv_token_s, "samples": 5000, "source": "fitted online to 5000 engine steps"}}}
    unfitted = simulate(agents, "justitia", slow, 4096, tau="measured")
    unfitted.extra["time_model"] = {"engines": {"local": {"base_s": 0.0, "per_seq_s": 0.0, "per_prefill_token_s": 0.0,
                                                          "per_kv_token_s": 0.0, "samples": 0}}}
    args = argparse.Namespace(kv_tokens=4096, las_half_life_s=60.0, las_head_wait_weight=0.2)
    add_sim_prediction(args, agents, ["justitia", "justitia"], profile, [live, unfitted])
    mean = live.summary()["mean_jct_s"]
    assert live.extra["sim_mean_jct_s"] < 0.7 * mean  # the profile's engine is twice as fast
    assert live.extra["sim_online_mean_jct_s"] == pytest.approx(mean, rel=0.02)
    assert live.extra["sim_online_error"] == pytest.approx(0.0, abs=0.02)
    assert "sim_online_mean_jct_s" not in unfitted.extra  # no steps fitted: nothing to say


def test_live_slowdowns_skip_the_agents_a_run_lost(workload):
    """A live run lists only the agents that finished (those that failed or hung are counted
    apart): each listed one gets its own time alone, matched by id."""
    from justitia_cli.bench.sim import add_slowdowns
    from server.sim.results import AgentResult, PolicyResult
    from server.sim.simulator import isolated_jct_s
    from server.sim.workload import load_workload

    agents = load_workload(workload)
    profile = get_profile("a100-llama7b")
    alone = dict(zip((a.id for a in agents), isolated_jct_s(agents, profile, 20000), strict=True))
    kept = [AgentResult(a.id, a.type, 0.0, 10.0, 10.0, 10.0) for a in agents[::3]]
    add_slowdowns([PolicyResult("justitia", kept)], agents, profile, 20000)
    assert [r.isolated_s for r in kept] == [alone[r.id] or None for r in kept]
