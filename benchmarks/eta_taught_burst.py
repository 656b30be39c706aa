"""First ETAs of a burst on a fresh server and on one that has served a burst before.

Simulates the measured workload alone (a fresh server), then after another workload (the
teacher, shifted so that the measured burst begins `--after` seconds after the teacher's
start: a lull of more than a minute, so the measured burst is a new episode of arrivals),
and prints the first-ETA error of the measured agents (|first ETA - JCT| / JCT, p50 / p90)
and its median signed value by thirds of the burst, in arrival order. The simulated `bench
live --teach`: the same scheduler core, the simulated engine.

    .venv/bin/python benchmarks/eta_taught_burst.py [--workload benchmarks/workloads/contended48.jsonl]
        [--teach benchmarks/workloads/contended48_seed4.jsonl] [--after 300]
        [--profile benchmarks/results/profile_cpu_tiny_4096_epyc.json] [--kv-tokens 4096]
        [--tau measured] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.shared.profiles import load_profile  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.results import AgentResult, quantile  # noqa: E402
from server.sim.simulator import TAU_SOURCES, simulate  # noqa: E402
from server.sim.workload import load_workload  # noqa: E402


def eta_errors(results: list[AgentResult], ids: set[str]) -> dict[str, float]:
    """p50 / p90 of |first ETA - JCT| / JCT over the agents `ids`, and the median signed
    error of each third of them in arrival order."""
    rows = sorted((r for r in results if r.id in ids), key=lambda r: r.arrival_s)
    signed = [((r.first_eta_s or 0.0) - r.jct_s) / r.jct_s for r in rows]
    n = len(signed)
    absolute = sorted(abs(e) for e in signed)
    thirds = [statistics.median(signed[k * n // 3:(k + 1) * n // 3]) for k in range(3)]
    return {"eta_error_p50": quantile(absolute, 0.5), "eta_error_p90": quantile(absolute, 0.9),
            "first_third": thirds[0], "middle_third": thirds[1], "last_third": thirds[2],
            "mean_jct_s": statistics.mean(r.jct_s for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="benchmarks/workloads/contended48.jsonl")
    ap.add_argument("--teach", default="benchmarks/workloads/contended48_seed4.jsonl")
    ap.add_argument("--after", type=float, default=300.0, help="seconds from the teacher's start to the burst's")
    ap.add_argument("--profile", default="benchmarks/results/profile_cpu_tiny_4096_epyc.json")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--policy", default="justitia")
    ap.add_argument("--tau", choices=TAU_SOURCES, default="measured")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    measured = load_workload(args.workload)
    teacher = [dataclasses.replace(a, id=f"teach-{a.id}") for a in load_workload(args.teach)]
    if max(a.arrival for a in teacher) + 60.0 >= args.after:
        ap.error("--after must leave a lull of more than a minute after the teacher's last arrival")
    later = [dataclasses.replace(a, arrival=a.arrival + args.after) for a in measured]
    ids = {a.id for a in measured}
    out = {}
    for server, agents in (("fresh", measured), ("taught", teacher + later)):
        run = simulate(agents, args.policy, profile, args.kv_tokens, tau=args.tau)
        out[server] = eta_errors(run.agents, ids)
        e = out[server]
        print(f"{server:>6s}: first-ETA error p50 {e['eta_error_p50']:.3f} p90 {e['eta_error_p90']:.3f}; "
              f"median signed error by thirds {e['first_third']:+.2f} {e['middle_third']:+.2f} "
              f"{e['last_third']:+.2f}; mean JCT {e['mean_jct_s']:.1f} s")
    if args.json:
        res = {"workload": args.workload, "teach": args.teach, "after_s": args.after, "profile": args.profile,
               "kv_tokens": args.kv_tokens, "policy": args.policy, "tau": args.tau, **out}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, res, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
