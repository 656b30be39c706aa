"""The simulator's commands: `bench sim`, `make-workload`, `calibrate`, `starvation`.

Each handler reads its options (options.py) and imports the simulator (server/sim) when it
runs, so that registering the commands costs argparse only."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from justitia_cli import CommandError
from justitia_cli.bench.options import (
    configured_policies,
    parse_policies,
    read_predictions,
    read_profile,
    read_workload,
    split_list,
)

if TYPE_CHECKING:
    from server.shared.profiles import EngineProfile


def sim_command(args: argparse.Namespace) -> int:
    import time

    from server.sim import report
    from server.sim.simulator import gps_tau_s, run_comparison, workload_limits

    policies = parse_policies(args.policies)
    profile = read_profile(args.profile)
    agents = read_workload(args.workload)
    m = args.kv_tokens or profile.kv_tokens
    if m <= 0:
        raise CommandError("--kv-tokens must be positive")
    predictions = read_predictions(args, agents)
    t0 = time.perf_counter()
    results = run_comparison(agents, configured_policies(args, policies), profile, m, predictions,
                             backfill=args.backfill, seed=args.seed, tau=args.tau, retain=args.retain)
    wall = time.perf_counter() - t0
    tau = gps_tau_s(profile, m, agents)
    limits = workload_limits(agents)
    config = {
        "workload": str(args.workload),
        "agents": len(agents),
        "requests": sum(a.num_requests for a in agents),
        "policies": policies,
        "kv_tokens": m,
        "profile": profile.as_dict(),
        "gps_tau_s": tau,
        "gps_rate": m / tau,
        "prediction": args.prediction,
        "seed": args.seed,
        "backfill": args.backfill,
        "tau": args.tau,
        "retain": args.retain,
        "las_half_life_s": args.las_half_life_s,
        "las_head_wait_weight": args.las_head_wait_weight,
        "limits": {
            "max_request_cost": limits.max_request_cost,
            "max_agent_cost": limits.max_agent_cost,
            "max_output_tokens": limits.max_output_tokens,
        },
        "wall_s": wall,
    }
    if args.json:
        report.write_json(args.json, config, results)
    if not args.quiet:
        report.print_table(results, f"{args.workload}  M={m}  {profile.name}  {args.prediction}  ({wall:.1f} s)")
    if args.plot:
        report.plot_cdf(results, args.plot, f"{len(agents)} agents, {profile.name}, M={m}")
    if args.html:
        from server.sim.html_report import write_html

        write_html(args.html, config, results, f"bench sim: {len(agents)} agents, {profile.name}, M={m}")
    return 0


def check_live_sizes(args: argparse.Namespace, agents: list) -> None:
    longest = max(p + d for a in agents for st in a.stages for p, d in st)
    if longest > args.max_model_len:
        raise CommandError(f"a request of the workload needs {longest} tokens of context; raise "
                           f"--max-model-len (now {args.max_model_len}) or rebuild the workload")
    if args.kv_tokens < args.max_model_len:
        raise CommandError(f"--kv-tokens {args.kv_tokens} is below --max-model-len "
                           f"{args.max_model_len}: vLLM needs room for one full request")


def add_sim_prediction(args: argparse.Namespace, agents: list, policies: list[str], profile: Any,
                        results: list) -> None:
    """The simulator's prediction of the same run: same workload, policy, profile and M;
    oracle costs (the simulator has no server predictor to stand in for `server`); the rate
    measured from the simulated steps as the server measures the engine's, so that the
    predicted first ETAs are those the server would give (`sim_eta_error_p50/p90`).

    Then the same with the step-time model the server fitted during the run instead of the
    profile (`sim_online_mean_jct_s`): not a prediction, since it is known only after the
    run, but it tells the two errors of the prediction apart. On a host whose speed moves
    from hour to hour (the same justitia run has taken 24.0 s, then 35.1 s an hour later,
    its engine's base step 2.4 ms, then 4.6 ms) the profile measured beforehand is
    off by the drift, while the run's own model is off only by the simulator's form."""
    from server.sim.simulator import make_predictions, run_comparison

    oracle = make_predictions(agents, "oracle")
    predicted = run_comparison(agents, configured_policies(args, policies), profile, args.kv_tokens, oracle,
                               tau="measured", retain=getattr(args, "retain", "auto"))
    for live_r, sim_r in zip(results, predicted, strict=True):
        live_mean = live_r.summary()["mean_jct_s"]
        sim = sim_r.summary()
        sim_mean = sim["mean_jct_s"]
        live_r.extra["sim_mean_jct_s"] = sim_mean
        live_r.extra["sim_error"] = (sim_mean - live_mean) / live_mean if live_mean else None
        live_r.extra["sim_eta_error_p50"] = sim.get("eta_error_p50")
        live_r.extra["sim_eta_error_p90"] = sim.get("eta_error_p90")
        fitted = fitted_profile(profile, live_r.extra.get("time_model"), live_r.extra.get("stage_turnaround_s"))
        if fitted is None:
            continue
        [again] = run_comparison(agents, configured_policies(args, [live_r.policy]), fitted, args.kv_tokens, oracle,
                                 tau="measured")
        online_mean = again.summary()["mean_jct_s"]
        live_r.extra["sim_online_mean_jct_s"] = online_mean
        live_r.extra["sim_online_error"] = (online_mean - live_mean) / live_mean if live_mean else None


def fitted_profile(profile: EngineProfile, time_model: dict | None,
                   turnaround_s: float | None = None) -> EngineProfile | None:
    """`profile` with the coefficients the live server fitted to its engine's steps (None
    when it fitted none, or fitted one per replica: the simulator has one engine): its fit
    to every step of the run (`since_start`) where the server reports one, not the
    recency-weighted fit, which at the end of a run is the engine of its last steps. With
    `turnaround_s` (the clients' turnaround the server measured), that as the profile's."""
    from dataclasses import replace

    time_model = time_model or {}
    engines = time_model.get("since_start") or time_model.get("engines") or {}
    if len(engines) != 1:
        return None
    [fit] = engines.values()
    if not fit.get("samples"):
        return None
    turnaround = profile.stage_turnaround_s if turnaround_s is None else turnaround_s
    return replace(profile, name=f"{profile.name}, refitted to the run", base_s=fit["base_s"],
                   per_seq_s=fit["per_seq_s"], per_prefill_token_s=fit["per_prefill_token_s"],
                   per_kv_token_s=fit["per_kv_token_s"], source=fit.get("source", ""),
                   stage_turnaround_s=turnaround)


def measured_here(profile: str) -> str | None:
    """The profile for the servers `bench live` starts (their time model's prior): a `bench
    calibrate` file measured this engine; a built-in name describes another (cpu-tiny
    another host, a100-llama7b a GPU), and the server keeps its own prior."""
    from pathlib import Path

    return str(Path(profile).resolve()) if Path(profile).is_file() else None


def add_slowdowns(results, agents, profile, kv_tokens: int) -> None:
    """Slowdowns of a live run: each agent's live JCT over its time alone on an idle engine,
    by the simulator's time model of the profile (what `bench sim` divides by)."""
    from server.sim.simulator import isolated_jct_s

    isolated = dict(zip((a.id for a in agents), isolated_jct_s(agents, profile, kv_tokens), strict=True))
    for r in results:
        for a in r.agents:  # a live run's agents that failed or hung have no row: by id
            a.isolated_s = isolated.get(a.id) or None


def calibrate_command(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from server.sim import calibrate

    if args.max_model_len < 64:
        raise CommandError("--max-model-len must be at least 64")
    if args.kv_tokens < args.max_model_len:
        raise CommandError(f"--kv-tokens {args.kv_tokens} is below --max-model-len {args.max_model_len}: "
                           "vLLM needs room for one full request")
    t0 = time.perf_counter()
    name = args.name or Path(args.out).stem
    with Progress() as bar:
        task = bar.add_task("starting the engine", total=len(calibrate.make_grid(args.kv_tokens, args.max_model_len,
                                                                                  quick=args.quick)))

        def advance(done: int, pt) -> None:
            bar.update(task, completed=done,
                       description=f"measured b={pt.batch} p={pt.prompt} d={pt.output}")

        cal = calibrate.calibrate(args.kv_tokens, args.max_model_len, name, quick=args.quick, seed=args.seed,
                                  progress=advance)
    info, model, rows, summary = cal.info, cal.model, cal.rows, cal.summary
    served: dict = {}
    turnaround: dict = {}
    if args.served:
        served, cal.profile = _served(cal.results, cal.profile, info, args.seed)
    elif args.turnaround:
        turnaround, cal.profile = _turnaround(cal.profile, info, args.seed)
    profile = cal.profile
    wall = cal.wall_s = time.perf_counter() - t0
    cal.save(args.out, args.quick, **({"served": served} if served else {}),
             **({"turnaround": turnaround} if turnaround else {}))
    table = Table(title=f"bench calibrate: M={info['kv_tokens']} N={info['max_model_len']}  ({wall:.0f} s)")
    for col in ("batch", "prompt", "output", "steps", "measured s", "fitted s", "fit err", "sim s", "sim err"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), str(r["prompt"]), str(r["output"]), str(r["steps"]),
                      f"{r['seconds']:.3f}", f"{r['fitted_s']:.3f}", f"{100 * r['fit_error']:+.0f}%",
                      f"{r['sim_s']:.3f}", f"{100 * r['sim_error']:+.0f}%")
    console = Console()
    if not console.is_terminal and console.width < 120:
        console = Console(width=120)  # piped output: do not squeeze the columns
    console.print(table)
    console.print(
        f"step_s = {model.base_s * 1e3:.3f} ms + {model.per_seq_s * 1e6:.2f} us x seqs + "
        f"{model.per_prefill_token_s * 1e6:.3f} us x prompt tokens + {model.per_kv_token_s * 1e9:.3f} ns x KV tokens"
        f"   ({model.samples} steps; per-step error p50 {100 * (model.error_p50 or 0):.0f}%, "
        f"p90 {100 * (model.error_p90 or 0):.0f}%; per point: fit {100 * summary['point_fit_error_mean']:.0f}% mean, "
        f"simulator {100 * summary['point_sim_error_mean']:.0f}% mean)")
    if profile.per_chunked_prefill_s > 0:
        console.print(f"a prompt past the engine's {profile.prefill_chunk_tokens}-token step budget adds "
                      f"{profile.per_chunked_prefill_s * 1e9:.2f} ns x (tokens past it) x (its tokens), "
                      f"its chunked prefill's attention (fitted to the points past the budget)")
    if served:
        console.print(f"served through the server: {len(served['points'])} points, slowdown "
                      + ", ".join(f"{r['slowdown']:.2f}" for r in served["points"])
                      + f"; the step model is scaled by their median, {served['slowdown']:.2f}")
    if measured := (served or turnaround).get("stage_turnaround_s"):
        console.print(f"the client's turnaround between an agent's stages, through the server: "
                      f"{1000 * measured:.1f} ms (median)")
    console.print(f"wrote {args.out}: use it with `bench sim --profile {args.out}` "
                  f"or `bench live --profile {args.out}`")
    return 0


def _served(results: list, profile: EngineProfile, info: dict, seed: int) -> tuple[dict, EngineProfile]:
    """Run the grid's points of two requests or more through the server (`bench live`'s
    runner, policy justitia) and scale the profile by their median slowdown
    (server/sim/calibrate_served.py)."""
    from justitia_cli.bench.live_run import LiveOptions, run_policy
    from server.sim import calibrate_served

    points = calibrate_served.served_points(results)
    if not points:
        raise CommandError("--served needs grid points of two requests or more: the cache holds one request "
                           "of each size; give a larger --kv-tokens")
    print(f"serving {len(points)} points through `justitia serve` (a server start, then about "
          f"{sum(calibrate_served.SERVED_ROOM * r.seconds + calibrate_served.SERVED_GAP_S for r in points):.0f} s)")
    run = run_policy(calibrate_served.served_workload(points), "justitia",
                     LiveOptions(kv_tokens=info["kv_tokens"], max_model_len=info["max_model_len"], seed=seed))
    rows = calibrate_served.served_rows(points, {a.id: a.finish_s for a in run.agents},
                                        {a.id: a.arrival_s for a in run.agents})
    if not rows:
        raise CommandError("no calibration point finished through the server; see its log")
    factor = calibrate_served.slowdown(rows)
    turnaround = run.extra.get("stage_turnaround_s")
    return ({"slowdown": factor, "points": rows, "engine_alone": profile.as_dict(),
             "stage_turnaround_s": turnaround}, _with_turnaround(calibrate_served.scaled(profile, factor), turnaround))


def _with_turnaround(profile: EngineProfile, measured: float | None) -> EngineProfile:
    """The profile with the client's turnaround the server measured, or a CommandError."""
    from server.sim import calibrate_served

    try:
        return calibrate_served.with_turnaround(profile, measured)
    except ValueError as exc:
        raise CommandError(f"{exc}; see the server's log") from None


def _turnaround(profile: EngineProfile, info: dict, seed: int) -> tuple[dict, EngineProfile]:
    """Run the agent of short chained stages through the server (`bench live`'s runner) and
    record the client's turnaround the server measured between them in the profile
    (server/sim/calibrate_served.py); the step model stays the engine alone's."""
    from justitia_cli.bench.live_run import LiveOptions, run_policy
    from server.sim import calibrate_served

    print(f"sending one agent of {calibrate_served.CHAIN_STAGES} short stages through `justitia serve` "
          "(a server start, then a few seconds)")
    run = run_policy([calibrate_served.chain_agent()], "justitia",
                     LiveOptions(kv_tokens=info["kv_tokens"], max_model_len=info["max_model_len"], seed=seed))
    measured = run.extra.get("stage_turnaround_s")
    return ({"stage_turnaround_s": measured, "stages": calibrate_served.CHAIN_STAGES},
            _with_turnaround(profile, measured))


def make_workload_command(args: argparse.Namespace) -> int:
    from server.sim.mix import make_mix
    from server.sim.workload import save_workload

    if args.agents <= 0 or args.density <= 0 or not 0 < args.load:
        raise CommandError("--agents, --density and --load must be positive")
    profile = read_profile(args.profile)
    if args.tools is not None:
        return make_talk(args, profile)
    if args.shape is not None:
        return make_shaped(args, profile)
    agents = make_mix(
        args.agents, profile, kv_tokens=args.kv_tokens, density=args.density, load_1x=args.load,
        seed=args.seed, length_scale=args.length_scale, prefixes=args.prefixes,
    )
    save_workload(agents, args.out)
    n_req = sum(a.num_requests for a in agents)
    shared = ""
    if args.prefixes:
        from server.sim.mix import prefix_share

        shared = f", {100 * prefix_share(agents):.0f}% of prompt tokens reusable from a shared prefix"
    print(f"wrote {args.out}: {len(agents)} agents, {n_req} requests, arrivals over {agents[-1].arrival:.0f} s"
          + shared)
    return 0


def make_talk(args: argparse.Namespace, profile: EngineProfile) -> int:
    from server.sim.talk import make_agentic_mix, make_talk_mix
    from server.sim.workload import save_workload

    if args.shape is not None or args.prefixes or args.density != 1.0 or args.length_scale is not None:
        raise CommandError("--tools builds its own arrivals and prefixes: drop --shape, --density, --prefixes "
                           "and --length-scale")
    if args.tools == "agentic":
        agents = make_agentic_mix(args.agents, profile, seed=args.seed, load=args.load, kv_tokens=args.kv_tokens)
    else:
        agents = make_talk_mix(args.agents, profile, seed=args.seed, load=args.load, kv_tokens=args.kv_tokens,
                               multi_turn=args.tools == "multi-turn")
    save_workload(agents, args.out)
    talks = sum(bool(a.ctxs) for a in agents)
    print(f"wrote {args.out}: {len(agents)} agents ({talks} resending their conversation), "
          f"{sum(a.num_requests for a in agents)} requests, arrivals over {agents[-1].arrival:.0f} s")
    return 0


def make_shaped(args: argparse.Namespace, profile: EngineProfile) -> int:
    from server.sim.shapes import SHAPES, ShapeSpec, make_shaped
    from server.sim.workload import save_workload

    if args.shape not in SHAPES:
        raise CommandError(f"--shape must be one of {', '.join(SHAPES)}, not {args.shape!r}")
    if args.prefixes or args.density != 1.0:
        raise CommandError("--shape sets the arrivals itself: drop --density and --prefixes")
    agents = make_shaped(ShapeSpec(args.shape, args.agents, args.load, args.seed), profile, args.kv_tokens)
    save_workload(agents, args.out)
    n_req = sum(a.num_requests for a in agents)
    print(f"wrote {args.out}: {args.shape}, {len(agents)} agents, {n_req} requests, "
          f"arrivals over {agents[-1].arrival:.1f} s")
    return 0


def starvation_command(args: argparse.Namespace) -> int:

    from server.sim.starvation import run_starvation

    try:
        minutes = [float(x) for x in split_list(args.minutes)]
    except ValueError:
        raise CommandError("--minutes takes numbers, e.g. 2,4,6,8,10") from None
    profile = read_profile(args.profile)
    rows = run_starvation(minutes, configured_policies(args, parse_policies(args.policies)), profile, args.kv_tokens,
                          args.load, args.seed)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="large MapReduce agent under a flood of small agents")
    for col in ("flood min", "policy", "large JCT s", "GPS finish s", "bound s", "within bound", "small mean JCT s"):
        table.add_column(col)
    for r in rows:
        table.add_row(f"{r['flood_minutes']:g}", r["policy"], f"{r['large_jct_s']:.1f}",
                      f"{r['large_gps_finish_s']:.1f}", f"{r['large_delay_bound_s']:.1f}",
                      "yes" if r["within_bound"] else "NO", f"{r['small_mean_jct_s']:.1f}")
    Console().print(table)
    if args.json:
        from server.sim.provenance import write_result

        write_result(args.json, {"config": vars(args) | {"handler": None}, "rows": rows})
    return 0
