"""What does the work known at an agent's registration alone predict of its JCT?

A first ETA is given when an agent registers. The ETA `justitia` gives replays the known
work through a fluid model and adds an allowance for work that will arrive ahead of the
agent. This benchmark replays, for every agent k, the workload's agents 0..k alone (the
agents registered by k's arrival, with their arrivals) through the simulator and takes the
time it finishes k there: exact about everything known at registration (the engine, the
admission order, the stages), blind to what arrives after k. Despite the name it is no
ceiling on what an ETA can achieve: its error is one-sided (short wherever later work
arrives ahead of k), so an ETA that expects arrivals can beat it, and on the contended
burst the server's own first ETA equals it and the replay scaled by 1.1 beats both. It
measures how much of a first ETA's error later arrivals make.

    .venv/bin/python benchmarks/eta_ceiling.py [--workload benchmarks/workloads/contended48.jsonl]
        [--profile benchmarks/results/profile_cpu_tiny_4096_epyc.json] [--kv-tokens 4096]
        [--tau measured] [--json benchmarks/results/eta_ceiling_contended48.json]

Prints each agent's JCT, its replay of known work and the server's first ETA (simulated), and
the p50 / p90 of both errors |eta - jct| / jct.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rich.progress import track  # noqa: E402

from server.shared.profiles import load_profile  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.results import quantile  # noqa: E402
from server.sim.simulator import TAU_SOURCES, isolated_jct_s, simulate  # noqa: E402
from server.sim.workload import load_workload  # noqa: E402

REPLAY_SCALE = 1.1  # an example scaling, to show the replay is no floor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="benchmarks/workloads/contended48.jsonl")
    ap.add_argument("--profile", default="benchmarks/results/profile_cpu_tiny_4096_epyc.json",
                    help="a profile name or a file written by `bench calibrate`")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--policy", default="justitia")
    ap.add_argument("--tau", choices=TAU_SOURCES, default="measured",
                    help="the simulated server's rate: measured from the steps as the live server does, or the "
                         "profile's (bench sim --tau)")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()

    agents = sorted(load_workload(args.workload), key=lambda a: a.arrival)
    profile = load_profile(args.profile)
    # each agent's time alone, once (every partial run would compute its agents' again)
    isolated = isolated_jct_s(agents, profile, args.kv_tokens)
    run = simulate(agents, args.policy, profile, args.kv_tokens, tau=args.tau, isolated=isolated)
    full = {r.id: r for r in run.agents}
    rows = []
    for k in track(range(len(agents)), description="replaying the known work of each agent"):
        a = agents[k]
        known = {r.id: r for r in simulate(agents[:k + 1], args.policy, profile, args.kv_tokens, tau=args.tau,
                                           isolated=isolated[:k + 1]).agents}
        jct = full[a.id].jct_s
        replay = known[a.id].jct_s
        eta = full[a.id].first_eta_s
        rows.append({"id": a.id, "type": a.type, "arrival_s": a.arrival, "jct_s": jct, "replay_eta_s": replay,
                     "first_eta_s": eta, "replay_error": (replay - jct) / jct,
                     "first_eta_error": None if eta is None else (eta - jct) / jct})
    for r in rows:
        first = "" if r["first_eta_error"] is None else f"{r['first_eta_s']:7.2f} ({r['first_eta_error']:+.2f})"
        print(f"{r['id']:>6} {r['type'][:18]:18s} arrival {r['arrival_s']:6.2f}  JCT {r['jct_s']:7.2f}  "
              f"replay of known work {r['replay_eta_s']:7.2f} ({r['replay_error']:+.2f})  first ETA {first}")
    replay_err = sorted(abs(r["replay_error"]) for r in rows)
    # The replay is one-sided (short wherever later work arrives ahead): a plain scaling of
    # it already beats it, so it bounds nothing.
    scaled_err = sorted(abs(REPLAY_SCALE * r["replay_eta_s"] - r["jct_s"]) / r["jct_s"] for r in rows)
    of_run = run.summary()  # the server's first ETAs, as bench sim reports them
    summary = {
        "replay_of_known_work_error_p50": quantile(replay_err, 0.5),
        "replay_of_known_work_error_p90": quantile(replay_err, 0.9),
        "replay_scaled": REPLAY_SCALE,
        "replay_scaled_error_p50": quantile(scaled_err, 0.5),
        "replay_scaled_error_p90": quantile(scaled_err, 0.9),
        "replay_short": sum(r["replay_error"] < 0 for r in rows),
        "first_eta_error_p50": of_run["eta_error_p50"],
        "first_eta_error_p90": of_run["eta_error_p90"],
    }
    print(f"replay of the known work: error p50 {summary['replay_of_known_work_error_p50']:.3f}, "
          f"p90 {summary['replay_of_known_work_error_p90']:.3f}")
    print(f"the replay scaled by {REPLAY_SCALE}: error p50 {summary['replay_scaled_error_p50']:.3f}, "
          f"p90 {summary['replay_scaled_error_p90']:.3f}; short of the JCT for {summary['replay_short']} agents")
    if summary["first_eta_error_p50"] is not None:
        print(f"the server's first ETA:   error p50 {summary['first_eta_error_p50']:.3f}, "
              f"p90 {summary['first_eta_error_p90']:.3f}")
    if args.json:
        config = {"workload": args.workload, "profile": profile.name, "kv_tokens": args.kv_tokens,
                  "policy": args.policy, "tau": args.tau}
        write_result(args.json, {"config": config, "summary": summary, "agents": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
