"""The targets of prefix-aware accounting on the simulator: prefix-aware accounting on the 300-agent mixes
whose requests share the prefixes their sources share (benchmarks/workloads/mix300p_*x.jsonl,
about 40% of prompt tokens), at 2x, 3x, 6x and 10x density, one run per density with
justitia, justitia-nocache and vtc (oracle costs, a100-llama7b, M = 45,000).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/prefix_targets.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/prefix_targets.py --live-workload \\
        benchmarks/workloads/contended48p.jsonl

Writes benchmarks/results/sim_prefix_targets.json (ratios and every policy's summary).
`--live-workload OUT` also writes the live benchmark's workload: the contended 48-agent
workload (benchmarks/workloads/contended48.jsonl, lengths scaled by 0.5 for the CPU engine)
with the prefixes its agents' sources share, same lengths and arrivals.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.shared.profiles import get_profile  # noqa: E402
from server.sim.mix import prefix_share, share_prefixes  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.simulator import run_comparison  # noqa: E402
from server.sim.workload import load_workload, save_workload  # noqa: E402

POLICIES = ["justitia", "justitia-nocache", "vtc"]


def sim_targets(densities: list[int]) -> list[dict]:
    profile = get_profile("a100-llama7b")
    rows = []
    for d in densities:
        agents = load_workload(f"benchmarks/workloads/mix300p_{d}x.jsonl")
        res = {r.policy: r.summary() for r in run_comparison(agents, POLICIES, profile, 45_000)}
        mean = {p: s["mean_jct_s"] for p, s in res.items()}
        row = {
            "density": d,
            "prefix_share": prefix_share(agents),
            "mean_jct_s": mean,
            "justitia_over_nocache": mean["justitia"] / mean["justitia-nocache"],
            "justitia_over_vtc": mean["justitia"] / mean["vtc"],
            "nocache_over_vtc": mean["justitia-nocache"] / mean["vtc"],
            "bound_violations": {p: s["bound_violations"] for p, s in res.items()},
            "preemptions": {p: s["preemptions"] for p, s in res.items()},
            "prefix_hit_rate": {p: s.get("prefix_hit_rate") for p, s in res.items()},
            "summaries": res,
        }
        rows.append(row)
        print(f"{d}x: justitia {mean['justitia']:.1f} s, nocache {mean['justitia-nocache']:.1f} s, "
              f"vtc {mean['vtc']:.1f} s | j/nocache {row['justitia_over_nocache']:.3f} "
              f"j/vtc {row['justitia_over_vtc']:.3f} | justitia over bound {row['bound_violations']['justitia']}, "
              f"hit rate {row['prefix_hit_rate']['justitia']:.2f}", flush=True)
    return rows


def live_workload(out: str) -> None:
    agents = load_workload("benchmarks/workloads/contended48.jsonl")
    rng = random.Random("prefixes:contended48")
    for a in agents:
        share_prefixes(a, 0.5, rng)
    save_workload(agents, out)
    print(f"wrote {out}: {len(agents)} agents, {100 * prefix_share(agents):.0f}% of prompt tokens "
          "reusable from a shared prefix")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--densities", default="2,3,6,10")
    ap.add_argument("--out", default="benchmarks/results/sim_prefix_targets.json")
    ap.add_argument("--live-workload", metavar="OUT", default=None)
    args = ap.parse_args()
    if args.live_workload:
        live_workload(args.live_workload)
    rows = sim_targets([int(d) for d in args.densities.split(",")])
    write_result(args.out, {"policies": POLICIES, "kv_tokens": 45_000, "profile": "a100-llama7b",
                                          "prediction": "oracle", "rows": rows}, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
