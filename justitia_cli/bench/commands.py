"""The parsers of `justitia bench sim | make-workload | live | calibrate | starvation`.

Registered by the CLI host (justitia_cli); module import stays light (argparse and the
scheduler's policy names): the handlers (sim.py, live.py) import the simulator and start
servers when a command runs.
"""

from __future__ import annotations

from typing import Any

from justitia_cli import Commands
from justitia_cli.bench.live import live_command
from justitia_cli.bench.options import las_options
from justitia_cli.bench.sim import calibrate_command, make_workload_command, sim_command, starvation_command
from justitia_cli.options import (
    add_command,
    json_option,
    kv_tokens_option,
    max_model_len_option,
    quiet_option,
    seed_option,
)
from server.scheduler import POLICY_NAMES

ALL_POLICIES = ",".join(POLICY_NAMES)


def retain_option(parser: Any) -> None:
    # retention.RETAIN_MODES, spelled out: this module imports nothing of the scheduler core's rules
    parser.add_argument("--retain", choices=("auto", "always", "never"), default="auto",
                        help="keep a paused agent's context (the conversation it will resend) in the KV cache: "
                             "auto (while the expected rest of the pause costs less than prefilling it again), "
                             "always, never; Justitia's policies only (justitia-noretain: never)")


def register(commands: Commands) -> None:
    sim = add_command(
        commands.bench,
        "sim",
        help="Compare scheduling policies on a workload with the discrete-event simulator.",
        description=(
            "Replay a workload (JSON Lines, one agent per line) through the simulated engine once "
            "per policy, with the same scheduler core as the server. Prints a table; --json writes "
            "every agent's arrival, finish, GPS finish time and delay bound per policy."
        ),
        handler=sim_command,
    )
    sim.add_argument("--workload", required=True, metavar="FILE",
                     help='workload file: JSON Lines, one agent per line, '
                          '{"id", "arrival", "stages": [[{"p", "d"}, ...], ...]}')
    sim.add_argument("--policies", default=ALL_POLICIES, metavar="LIST",
                     help=f"comma-separated policies: {', '.join(POLICY_NAMES)}")
    kv_tokens_option(sim, "KV cache capacity in tokens (default: the profile's)")
    json_option(sim)
    sim.add_argument("--prediction", default="oracle", metavar="MODE",
                     help="agent cost predictions: oracle, noisy:LAMBDA (true x LAMBDA^U(-1,1)), or model:DIR "
                          "(a trained predictor, or a folder with one per agent type)")
    sim.add_argument("--profile", default="a100-llama7b", metavar="NAME|FILE",
                     help="engine profile: a100-llama7b, cpu-tiny, or a file written by `bench calibrate`")
    seed_option(sim, "seed of the noisy predictions and of ewsjf's online tuner")
    las_options(sim)
    sim.add_argument("--backfill", action="store_true", help="let footprint policies admit past a blocked head")
    # simulator.TAU_SOURCES, spelled out: this module imports nothing of the simulator
    sim.add_argument("--tau", choices=("profile", "measured"), default="profile",
                     help="where the scheduler's rate R = M / tau comes from: profile (what the profile's engine "
                          "sustains on the mix, known from the start) or measured (from the simulated steps, as the "
                          "live server measures the real engine: the ETAs and deadlines the server would give)")
    retain_option(sim)
    sim.add_argument("--plot", metavar="FILE.png", default=None, help="draw the JCT CDF of every policy")
    sim.add_argument("--html", metavar="OUT.html", default=None,
                     help="write a self-contained HTML report (policy table, JCT CDFs, slowdown vs GPS, promises)")
    quiet_option(sim)

    mk = add_command(
        commands.bench,
        "make-workload",
        help="Build the paper's nine-type agent mix from the shipped public traces.",
        description=(
            "Nine agent types (72% small, 26% medium, 2% large), lengths drawn from ShareGPT, "
            "arXiv summarization, Mooncake and MetaGPT token counts, Mooncake arrivals scaled so that "
            "density 1 offers LOAD of what the profile's engine sustains on the mix."
        ),
        handler=make_workload_command,
    )
    mk.add_argument("--out", required=True, metavar="FILE", help="workload file to write (JSON Lines)")
    mk.add_argument("--agents", type=int, default=300, help="number of agents")
    mk.add_argument("--density", type=float, default=1.0,
                    help="arrival density multiplier (1, 2, 3: gaps divided by it)")
    mk.add_argument("--load", type=float, default=0.6,
                    help="offered load at density 1, as a fraction of the engine's sustained rate")
    mk.add_argument("--profile", default="a100-llama7b", metavar="NAME",
                    help="engine profile the load and lengths are fitted to")
    kv_tokens_option(mk, "KV capacity (default: the profile's)")
    mk.add_argument("--length-scale", type=float, default=None,
                    help="multiply trace lengths by this (default: the profile's; cpu-tiny shrinks them)")
    seed_option(mk, "random seed (same seed: same agents at every density)")
    mk.add_argument("--prefixes", action="store_true",
                    help="requests name the prompt prefixes their sources share (app system prompts, "
                         "shared instructions, self-consistency prompts, growing ReAct contexts); "
                         "lengths and arrivals stay those of the same seed without it")
    mk.add_argument("--shape", default=None, metavar="SHAPE",
                    help="re-time (and reshape) the mix as one of the evaluation family's arrival shapes: "
                         "poisson, bursts, diurnal, heavy-tail, tenants, sessions (--load is then the "
                         "offered load of the whole span; --density and --prefixes do not apply)")
    mk.add_argument("--tools", choices=("multi-turn", "single-turn", "agentic"), default=None,
                    help="agents that call tools: a lognormal tool pause (median 0.8 s) before every stage but "
                         "the first (pauses_s); multi-turn: the ReAct and chat agents resend their whole "
                         "conversation each turn (ctx); single-turn: the mix without them; agentic: half the "
                         "agents are function-calling agents in a tool loop (tool definitions, a task, then per "
                         "turn a tool call, the tool's pause and the whole conversation resent with its result), "
                         "the other half the multi-turn mix. --load is then the offered load of the whole span "
                         "(--density, --prefixes, --shape do not apply)")

    live = add_command(
        commands.bench,
        "live",
        help="Compare policies on the real server and the real vLLM CPU engine.",
        description=(
            "For each policy in turn, start the embedded server (in-process vLLM CPU engine, tiny "
            "model, KV capacity M), replay the workload through its HTTP API with ignore_eos so "
            "that output lengths are exact, and stop it. Writes the same JSON as `bench sim`, "
            "plus the simulator's prediction of each policy (sim_mean_jct_s, with --profile) beside it."
        ),
        handler=live_command,
    )
    live.add_argument("--workload", required=True, metavar="FILE",
                      help="workload file (build one with `bench make-workload --profile cpu-tiny`)")
    live.add_argument("--policies", default="fcfs,vtc,justitia", metavar="LIST",
                      help=f"comma-separated policies, run one after another (any of {', '.join(POLICY_NAMES)})")
    kv_tokens_option(live, "KV cache capacity of the engine in tokens", required=True)
    json_option(live)
    live.add_argument("--html", metavar="OUT.html", default=None,
                      help="write a self-contained HTML report (policy table, JCT CDFs, slowdown vs GPS, promises)")
    max_model_len_option(live, "engine context length (longest p + d of the workload must fit)")
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
    retain_option(live)
    seed_option(live, "seed of the random prompt token ids")
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
    live.add_argument("--ray", action="store_true",
                      help="run each server's engine as --replicas replicas on Ray Serve (`serve --ray "
                           "local`; --kv-tokens is their sum, split evenly); policy `ray` is then Ray "
                           "Serve's own routing without Justitia's scheduler. Results add `replicas`, "
                           "`agents_failed` and `agents_lost`; no simulator prediction (it models one engine)")
    live.add_argument("--replicas", type=int, default=2, metavar="N",
                      help="--ray: engine replicas (default 2)")
    live.add_argument("--kill-replica-after", type=float, default=None, metavar="S",
                      help="--ray: kill one engine replica's processes S seconds into each replay (Ray "
                           "replaces it; requests that produced nothing are resent, others fail)")
    live.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                      help="seconds each policy's server may take to become ready (default 300; a "
                           "loaded machine starts the engine slowly)")
    live.add_argument("--kill-scheduler-after", type=float, default=None, metavar="S",
                      help="--ray: kill the server (the scheduler) S seconds into each replay and start "
                           "it again, as its supervisor would; it schedules onto the running replicas. "
                           "Requests in flight then fail, agents it no longer knows fail (404), agents "
                           "arriving while it is down register once it is back; results add "
                           "`scheduler_killed`")
    live.add_argument("--hang-timeout", type=float, default=900.0, metavar="S",
                      help="an agent not done S seconds after the last arrival is lost (default 900)")
    las_options(live)
    quiet_option(live)

    cal = add_command(
        commands.bench,
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
            "About 2-4 minutes on 2 cores (--quick: one minute, four points). --served: then the points "
            "of several requests through `justitia serve`, the step model scaled by their median slowdown, "
            "and the client's turnaround between an agent's stages measured."
        ),
        handler=calibrate_command,
    )
    kv_tokens_option(cal, "KV cache capacity of the engine in tokens", required=True)
    max_model_len_option(cal, "engine context length; prompts of the grid go up to it")
    cal.add_argument("--out", required=True, metavar="PROFILE.json", help="profile file to write")
    cal.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    cal.add_argument("--quick", action="store_true", help="a four-point grid (a smoke test, not a calibration)")
    cal.add_argument("--served", action="store_true",
                     help="then run the grid's points of two requests or more through `justitia serve` (as "
                          "`bench live` does) and scale the step model by their median slowdown: the step "
                          "times the live path sees, the server and client sharing the machine with the "
                          "engine; then one agent of 24 short stages, each sent when the last answered: the "
                          "client's turnaround between stages, which the simulator leaves before each later "
                          "stage (about a minute more)")
    cal.add_argument("--turnaround", action="store_true",
                     help="then only the agent of 24 short stages through `justitia serve`: the client's "
                          "turnaround between stages recorded in the profile, the step model left as the engine "
                          "alone measured it (a server start and a few seconds more; --served measures it too)")
    seed_option(cal, "seed of the random prompt token ids")

    st = add_command(
        commands.bench,
        "starvation",
        help="One large MapReduce agent under a flood of small agents: does it starve?",
        description=(
            "A large MapReduce agent arrives with a flood of small agents (Poisson arrivals offering LOAD "
            "of the engine's rate) that lasts MINUTES; reports the large agent's JCT per flood length and "
            "policy, with its GPS finish time and delay bound."
        ),
        handler=starvation_command,
    )
    st.add_argument("--minutes", default="2,4,6,8,10", metavar="LIST", help="flood lengths in simulated minutes")
    st.add_argument("--policies", default="srjf,justitia,vtc,ewsjf,equinox", metavar="LIST", help="policies to compare")
    st.add_argument("--load", type=float, default=1.15,
                    help="offered load of the small agents, as a fraction of the (conservative) rate "
                         "the engine sustains on them")
    st.add_argument("--profile", default="a100-llama7b", metavar="NAME", help="engine profile")
    kv_tokens_option(st, "KV capacity (default: the profile's)")
    seed_option(st, "random seed")
    las_options(st)
    json_option(st)
