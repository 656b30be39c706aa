"""`justitia bench family`: the evaluation family of arrival shapes in the simulator.

Registered by the CLI host (justitia_cli); the simulator is imported when the command runs.
"""

from __future__ import annotations

import argparse

from justitia_cli import CommandError, Commands
from justitia_cli.options import add_command, json_option, kv_tokens_option, max_model_len_option

SHAPE_NAMES = ("poisson", "bursts", "diurnal", "heavy-tail", "tenants", "sessions")  # shapes.SHAPES


def register(commands: Commands) -> None:
    fam = add_command(
        commands.bench,
        "family",
        help="Run the family of arrival shapes (tuning or held-out seeds) and report the promises per shape.",
        description=(
            "Build each arrival shape from each seed (`bench make-workload --shape`), run the policies "
            "in the simulator with the rate measured as the live server measures it, and report per "
            "shape: first-ETA error p50/p90, promises kept, median deadline / JCT and interval "
            "coverage. Tune rules on some seeds (e.g. 0-4), report on others (e.g. 100-104). "
            "--live runs each member on the real server and vLLM CPU engine instead (a server per run), "
            "beside the simulator's prediction of the same run with a profile calibrated on this "
            "machine (--profile FILE from `bench calibrate` with the same --kv-tokens)."
        ),
        handler=family_command,
    )
    fam.add_argument("--shapes", default=",".join(SHAPE_NAMES), metavar="LIST",
                     help=f"comma-separated shapes: {', '.join(SHAPE_NAMES)}")
    fam.add_argument("--seeds", default="100-104", metavar="A-B|LIST",
                     help="seeds: a range A-B (inclusive) or a comma-separated list")
    fam.add_argument("--policies", default="justitia", metavar="LIST", help="comma-separated policies")
    fam.add_argument("--modes", default="fresh", metavar="LIST",
                     help="comma-separated: fresh (a server that has seen nothing), taught (one that served "
                          "another shape from another seed first, then a 90 s lull; figures of the member only)")
    fam.add_argument("--agents", type=int, default=48, help="agents per workload")
    fam.add_argument("--load", type=float, default=0.9,
                     help="offered load over each workload's span, as a fraction of what the engine sustains")
    fam.add_argument("--profile", default="cpu-tiny", metavar="NAME|FILE",
                     help="engine profile: a100-llama7b, cpu-tiny, or a file written by `bench calibrate`")
    kv_tokens_option(fam, "KV cache capacity in tokens", default=4096)
    json_option(fam, "write every run and the per-shape summary here")
    fam.add_argument("--live", action="store_true",
                     help="run each member on the real server and engine (minutes each: give a few shapes "
                          "and seeds), beside the simulator's prediction of that run; needs --profile FILE")
    max_model_len_option(fam, "--live: the engine's context length (longest p + d of the workloads must fit)")
    fam.add_argument("--log-dir", metavar="DIR", default=None, help="--live: keep each server's log here")
    fam.add_argument("--calibrate-each", action="store_true",
                     help="--live: calibrate the engine (`bench calibrate`'s grid, about a minute) before each run, "
                          "and serve and simulate that run on it: the host's speed of the minute, not of the hour "
                          "--profile was measured in (the workloads are still built with --profile); the "
                          "calibrations are kept beside --json, in <name>_calibrations/")
    fam.add_argument("--repeats", type=int, default=1, metavar="N",
                     help="--live: run each member N times in a row, on a server of its own each time (a live "
                          "mean JCT at load 0.9 moves by more than 15%% from run to run here); the summary "
                          "compares the simulator with the median of the N runs")


def parse_seeds(text: str) -> list[int]:
    """`100-104` or `1,5,9` (a range is inclusive)."""
    try:
        if "-" in text and "," not in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            if hi < lo:
                raise ValueError
            return list(range(lo, hi + 1))
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CommandError(f"--seeds takes a range A-B or a list 1,2,3, not {text!r}") from None


def check_live_options(args: argparse.Namespace) -> None:
    """The options only a live run takes, refused without --live (a CommandError)."""
    if args.repeats < 1:
        raise CommandError(f"--repeats must be at least 1, not {args.repeats}")
    if args.calibrate_each and not args.live:
        raise CommandError("--calibrate-each needs --live: the simulator alone has no engine to calibrate")
    if args.repeats > 1 and not args.live:
        raise CommandError("--repeats needs --live: the simulator gives the same run every time")


def family_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from server.scheduler import POLICY_NAMES
    from server.shared.profiles import load_profile
    from server.sim.family import MODES, family_json, run_family, summarise
    from server.sim.provenance import write_result
    from server.sim.shapes import SHAPES, ShapeSpec

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if bad := [s for s in shapes if s not in SHAPES]:
        raise CommandError(f"unknown shape(s) {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if bad := [p for p in policies if p not in POLICY_NAMES]:
        raise CommandError(f"unknown policy(ies) {', '.join(bad)}; choose from {', '.join(POLICY_NAMES)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or (bad := [m for m in modes if m not in MODES]):
        raise CommandError(f"--modes takes a list of {', '.join(MODES)}, not {args.modes!r}")
    if args.agents < 1 or not args.load > 0 or args.kv_tokens < 1:
        raise CommandError("--agents, --load and --kv-tokens must be positive")
    check_live_options(args)
    try:
        profile = load_profile(args.profile)
    except (OSError, ValueError, KeyError) as exc:
        raise CommandError(f"--profile {args.profile}: {exc}") from None
    specs = [ShapeSpec(s, args.agents, args.load, seed) for s in shapes for seed in parse_seeds(args.seeds)]
    config = {"shapes": shapes, "seeds": parse_seeds(args.seeds), "policies": policies, "modes": modes,
              "agents": args.agents, "load": args.load, "profile": profile.name, "kv_tokens": args.kv_tokens}
    if args.live:
        from justitia_cli.bench.family_live import family_live_command

        return family_live_command(args, specs, modes, policies, {**config, "repeats": args.repeats})
    with Progress(transient=True) as progress:
        task = progress.add_task("shapes x seeds", total=len(specs))
        rows = run_family(specs, policies, profile, args.kv_tokens,
                          on_done=lambda _spec: progress.advance(task), modes=modes)
    summary = summarise(rows)
    table = Table(title=f"family: {args.agents} agents, load {args.load:g}, {profile.name}, M={args.kv_tokens}, "
                        f"seeds {args.seeds}")
    table.add_column("shape", min_width=10)  # whole names: the other columns wrap
    for col in ("mode", "policy", "mean JCT s", "ETA err p50", "ETA err p90", "kept", "broken by tools",
                "deadline/JCT p50", "in interval"):
        table.add_column(col)
    fmt = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    for r in summary:
        table.add_row(r["shape"], r["mode"], r["policy"], fmt(r["mean_jct_s"], ".1f"), fmt(r["eta_error_p50"]),
                      fmt(r["eta_error_p90"]), f"{r['promises_kept']}/{r['promises']}",
                      str(r["promises_broken_by_tools"]),
                      fmt(r["deadline_over_jct_p50"], ".1f"), fmt(r["eta_coverage"], ".0%"))
    Console().print(table)
    if args.json:
        write_result(args.json, family_json(rows, config))
    return 0
