"""`justitia bench live` end to end: a small workload through the real server and engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from justitia_cli import main
from server.shared.profiles import get_profile
from server.sim.mix import make_mix
from server.sim.workload import save_workload

AGENT_KEYS = {"id", "arrival_s", "finish_s", "jct_s", "gps_finish_s", "delay_bound_s"}
# Live mean JCT over the simulator's, for this small workload (8 agents). Against the
# built-in profile (another machine, quiet) only a sanity range: the committed contended48
# runs measured 0.88-1.38, and this test measured 3.09 on a shared machine of this kind,
# so the machine's speed that hour moves it by 3x. Against the step-time model the server
# fitted during the run, the machine's speed is in the prediction, but not the gaps between
# steps a busy 2-core machine adds to a workload whose mean JCT is about a second: 1.18 on
# a quiet machine, 1.57 in a CI run. The 15% agreement the docs state is the figure of
# `bench family --live` on 48-agent members; this bound only catches a time model that
# does not reach the simulator (a missing term, a unit off by 1000x: ratios far outside).
LIVE_OVER_SIM = (0.3, 6.0)
LIVE_OVER_ONLINE_SIM = (0.6, 2.2)
RESULT_KEYS = {"policy", "mean_jct_s", "p50_jct_s", "p90_jct_s", "p99_jct_s", "max_jct_s",
               "makespan_s", "agents"}


def test_bench_live_replays_a_workload_and_writes_the_contract(tmp_path, justitia_home,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("JUSTITIA_HOME", justitia_home)
    workload = tmp_path / "w.jsonl"
    agents = make_mix(8, get_profile("cpu-tiny"), seed=3, density=2, length_scale=0.1)
    save_workload(agents, workload)
    out = tmp_path / "live.json"
    rc = main(["bench", "live", "--workload", str(workload), "--policies", "justitia",
               "--kv-tokens", "4096", "--max-model-len", "2048", "--json", str(out), "--quiet",
               "--html", str(tmp_path / "live.html")])
    assert rc == 0
    doc = json.loads(out.read_text())
    # the same run as a self-contained report, with the simulator's prediction beside it
    html = (tmp_path / "live.html").read_text()
    assert "<td>justitia</td>" in html and "simulator&#x27;s mean JCT" in html and "<script" not in html
    assert doc["config"]["kv_tokens"] == 4096 and doc["config"]["mode"] == "live"
    [result] = doc["results"]
    assert RESULT_KEYS <= set(result) and result["policy"] == "justitia"
    assert {a["id"] for a in result["agents"]} == {a.id for a in agents}
    arrivals = {a.id: a.arrival for a in agents}
    for a in result["agents"]:
        assert AGENT_KEYS <= set(a)
        # replayed on the workload's clock: no agent starts before its arrival
        assert a["arrival_s"] >= arrivals[a["id"]] - 1e-3
        assert a["jct_s"] == pytest.approx(a["finish_s"] - a["arrival_s"])
        assert a["gps_finish_s"] > a["arrival_s"] and a["delay_bound_s"] > 0
    # accurate footprints under justitia: the engine never preempted, accounting is back to 0
    assert result["preemptions"] == 0
    assert result["engine_dtype"] == "float32"  # what `bench calibrate` measures too
    assert result["accounting_zero"] is True
    # The simulator predicts the live run's mean JCT. With the built-in cpu-tiny profile
    # (fitted on a quiet machine) the prediction can only be as good as the machine is quiet:
    # a shared 2-core machine slows the live run, so this ratio is bounded loosely (see
    # LIVE_OVER_SIM). With the step-time model the server fitted to this engine during
    # the run, the machine's speed that hour is in the prediction, so the bound is tight.
    ratio = result["mean_jct_s"] / result["sim_mean_jct_s"]
    online = result["mean_jct_s"] / result["sim_online_mean_jct_s"]
    print(f"live / sim mean JCT: {ratio:.3f} (cpu-tiny profile), {online:.3f} (fitted online)")
    assert LIVE_OVER_SIM[0] < ratio < LIVE_OVER_SIM[1], result
    # and the first ETAs the server would give, its rate measured from the simulated steps
    assert 0 <= result["sim_eta_error_p50"] <= result["sim_eta_error_p90"]
    # the same run simulated with the step-time model the server fitted to this engine
    assert result["time_model"]["engines"]["local"]["samples"] > 0
    assert LIVE_OVER_ONLINE_SIM[0] < online < LIVE_OVER_ONLINE_SIM[1], result
    # the server's data dir is kept: its history times every request, which the simulator's
    # run of the same workload is compared with, request by request
    from benchmarks.requests_vs_sim import main as requests_vs_sim

    assert (Path(result["data_dir"]) / "history.sqlite3").is_file()
    compared = tmp_path / "requests.json"
    assert requests_vs_sim([str(out), "--json", str(compared)]) == 0
    compared_doc = json.loads(compared.read_text())
    by_size = compared_doc["engine_time_by_size"]
    requests = sum(len(st) for a in agents for st in a.stages)
    assert sum(b["requests"] for b in by_size.values()) == requests
    assert all(b["live_s"] > 0 and b["sim_s"] > 0 for b in by_size.values() if b["requests"])
    # every request's time from admission to finish, split by the engine's own clocks: each
    # part as long as it can be, their sum within what the server timed around them
    split = compared_doc["live_time_split"]
    assert split["requests"] == requests
    for part in ("to_engine_s", "engine_queued_s", "from_engine_s"):
        assert split[part] >= 0
    assert split["prefill_s"] > 0 and split["decode_s"] > 0
    assert split["server_s"] >= -1e-3 * requests
    assert split["prefill_s"] + split["decode_s"] < split["admitted_to_finished_s"]
    # agents of several stages: the clients' turnaround between them, as the server measured it,
    # and the simulation refitted to the run waits as long before each later stage
    assert any(len(a.stages) > 1 for a in agents)
    assert 0 < result["stage_turnaround_s"] < 0.05
    assert compared_doc["profile"]["stage_turnaround_s"] == result["stage_turnaround_s"]


def test_bench_live_renders_shared_prefixes_that_the_engine_caches(tmp_path, justitia_home,
                                                                    monkeypatch) -> None:
    """Four agents of three parallel calls sharing an app system prompt and their own
    instructions: rendered as identical token prefixes, vLLM's prefix cache hits them."""
    monkeypatch.setenv("JUSTITIA_HOME", justitia_home)
    workload = tmp_path / "w.jsonl"
    with workload.open("w") as fh:
        for i in range(4):
            reqs = [{"p": 400 + 20 * k, "d": 8,
                     "prefix": [{"id": "sys/app", "tokens": 200}, {"id": f"a{i}/instr", "tokens": 330}]}
                    for k in range(3)]
            fh.write(json.dumps({"id": f"a{i}", "type": "mapper", "arrival": 0.1 * i, "stages": [reqs]}) + "\n")
    out = tmp_path / "live.json"
    rc = main(["bench", "live", "--workload", str(workload), "--policies", "justitia", "--no-sim",
               "--kv-tokens", "4096", "--max-model-len", "2048", "--json", str(out), "--quiet",
               "--repeat", "2", "--log-dir", str(tmp_path / "logs" / "run")])
    assert rc == 0
    # each round's server log, in a directory that did not exist yet
    assert sorted(p.name for p in (tmp_path / "logs" / "run").iterdir()) == [
        "server-justitia-round1.log", "server-justitia-round2.log"]
    doc = json.loads(out.read_text())
    # two servers one after the other; the row is the run of median mean JCT (the faster one)
    assert doc["config"]["repeat"] == 2 and [r["round"] for r in doc["repeats"]["runs"]] == [0, 1]
    [result] = doc["results"]
    assert result["mean_jct_s"] == min(r["mean_jct_s"] for r in doc["repeats"]["runs"])
    assert len(result["agents"]) == 4 and result["accounting_zero"] is True
    # 11 of 12 prompts find at least the system prompt's whole blocks cached
    assert result["prefix_hit_rate"] > 0.2, result["prefix_hit_rate"]
    assert result["kv_saved_total"] > 0
    assert result["preemptions"] == 0


def test_bench_live_teaches_the_server_before_the_measured_run(tmp_path, justitia_home,
                                                             monkeypatch) -> None:
    """`--teach FILE`: another workload replayed first on the same server, unmeasured; the
    run's figures count from the end of that teaching."""
    monkeypatch.setenv("JUSTITIA_HOME", justitia_home)
    workload, teach = tmp_path / "w.jsonl", tmp_path / "teach.jsonl"
    # Each agent's two stages decode 24 tokens one after the other: at least 48 engine steps
    # however the agents overlap, so the teaching passes the time model's first refit (32
    # steps) and the run another. With 8 tokens a stage CI's teaching once stayed under 32.
    for path, n in ((workload, 3), (teach, 4)):
        with path.open("w") as fh:
            for i in range(n):
                reqs = [{"p": 300 + 20 * k, "d": 24, "prefix": [{"id": "sys/app", "tokens": 200}]}
                        for k in range(3)]
                fh.write(json.dumps({"id": f"a{i}", "type": "mapper", "arrival": 0.1 * i,
                                     "prompt": f"map {i}", "stages": [reqs, [{"p": 50, "d": 24}]]}) + "\n")
    out = tmp_path / "live.json"
    rc = main(["bench", "live", "--workload", str(workload), "--teach", str(teach), "--policies", "justitia",
               "--prediction", "server", "--no-sim", "--kv-tokens", "4096", "--max-model-len", "2048",
               "--json", str(out), "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["teach"] == str(teach)
    [result] = doc["results"]
    assert len(result["agents"]) == 3 and result["accounting_zero"] is True  # the measured run's only
    assert result["taught_by"] == 4
    # the same server: its time model had fitted the teaching's steps when the run began
    assert 0 < result["taught_steps"] < result["time_model"]["engines"]["local"]["samples"]
    # other token ids: the run's hits are its own (its system prompt, computed once), not the
    # teaching's, and its counters start where the teaching's ended
    assert 0.2 < result["prefix_hit_rate"] < 0.9, result["prefix_hit_rate"]
    assert result["kv_saved_total"] > 0 and result["preemptions"] == 0


def test_bench_live_restarts_the_taught_server_on_its_history(tmp_path, justitia_home, monkeypatch) -> None:
    """`--teach FILE --restart`: the measured run meets another server started on the taught
    one's data dir, which learned again what its history kept (server/runtime/relearn.py)."""
    monkeypatch.setenv("JUSTITIA_HOME", justitia_home)
    workload, teach = tmp_path / "w.jsonl", tmp_path / "teach.jsonl"
    for path, n in ((workload, 2), (teach, 3)):
        with path.open("w") as fh:
            for i in range(n):
                fh.write(json.dumps({"id": f"a{i}", "type": "stepper", "arrival": 0.1 * i, "prompt": f"step {i}",
                                     "stages": [[{"p": 100, "d": 6}], [{"p": 120, "d": 6}]]}) + "\n")
    out = tmp_path / "live.json"
    assert main(["bench", "live", "--workload", str(workload), "--teach", str(teach), "--restart",
                 "--policies", "justitia", "--no-sim", "--kv-tokens", "4096", "--max-model-len", "2048",
                 "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["restart"] is True
    [result] = doc["results"]
    assert result["restarted"] is True and len(result["agents"]) == 2
    # the three taught agents' shapes and registrations, from the history the first server wrote
    recalled = result["recalled"]
    assert (recalled["agents"], recalled["types"], recalled["registrations"]) == (3, 1, 3)
    assert result["accounting_zero"] is True and result["preemptions"] == 0


def test_bench_family_live_runs_each_member_again_on_a_fresh_server(tmp_path, justitia_home,
                                                                     monkeypatch) -> None:
    """`bench family --live --repeats 2`: one member twice, a server each, both runs in the
    file and the summary judging the simulator against their median."""
    from dataclasses import replace

    from server.sim.calibrate import save_profile

    monkeypatch.setenv("JUSTITIA_HOME", justitia_home)
    profile = tmp_path / "profile.json"
    save_profile(replace(get_profile("cpu-tiny"), kv_tokens=4096), profile, settings={"kv_tokens": 4096},
                 provenance={"argv": ["justitia", "bench", "calibrate", "--kv-tokens", "4096"]})
    out = tmp_path / "family.json"
    rc = main(["bench", "family", "--live", "--shapes", "poisson", "--seeds", "100", "--agents", "4",
               "--repeats", "2", "--profile", str(profile), "--kv-tokens", "4096", "--max-model-len", "4096",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["repeats"] == 2
    runs = doc["runs"]
    assert [r["repeat"] for r in runs] == [0, 1]
    from server.runtime.prior_check import MIN_STEPS, TOLERANCE

    for r in runs:
        assert r["live"]["agents"] == 4 and r["agents_failed"] == 0 and r["agents_lost"] == 0
        assert r["sim"]["agents"] == 4
        # each server checked the calibration against its engine's warm-up steps (vLLM's own)
        check = r["prior_check"]
        assert check["steps"] >= MIN_STEPS and check["ratio"] > 0
        assert check["scaled"] == (not 1 / TOLERANCE <= check["ratio"] <= TOLERANCE)
    [shape] = doc["shapes"]
    [member] = shape["members"]
    assert member["runs"] == 2
    assert member["live_mean_jct_s"] == [r["live"]["mean_jct_s"] for r in runs]
    assert member["live_median_mean_jct_s"] == pytest.approx(sum(member["live_mean_jct_s"]) / 2)
    assert shape["members_within"] == int(member["sim_within"])


def test_bench_family_live_calibrates_before_each_run_when_asked(tmp_path, justitia_home, monkeypatch) -> None:
    """`bench family --live --calibrate-each`: the run is served and simulated on a calibration
    made just before it, kept beside the JSON; the member is still built with --profile."""
    from dataclasses import replace

    from server.sim.calibrate import save_profile

    monkeypatch.setenv("JUSTITIA_HOME", justitia_home)
    profile = tmp_path / "profile.json"
    built_with = replace(get_profile("cpu-tiny"), kv_tokens=4096)
    save_profile(built_with, profile, settings={"kv_tokens": 4096},
                 provenance={"argv": ["justitia", "bench", "calibrate", "--kv-tokens", "4096"]})
    out = tmp_path / "family.json"
    rc = main(["bench", "family", "--live", "--shapes", "poisson", "--seeds", "100", "--agents", "4",
               "--calibrate-each", "--profile", str(profile), "--kv-tokens", "4096", "--max-model-len", "4096",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["calibrate_each"] is True
    [run] = doc["runs"]
    assert run["live"]["agents"] == 4 and run["sim"]["agents"] == 4 and run["agents_failed"] == 0
    calibration = run["calibration"]
    made = json.loads((tmp_path / "family_calibrations" / "poisson_100_fresh_1.json").read_text())
    assert calibration["file"].endswith("poisson_100_fresh_1.json")
    assert made["settings"]["kv_tokens"] == 4096 and len(made["fit"]["points"]) > 4
    assert calibration["profile"] == made["profile"]
    # measured here and now, not the built-in profile the member was built with
    assert made["profile"]["base_s"] != pytest.approx(built_with.base_s)
