"""When does ordering by compute cost (justitia-c) lose to ordering by KV cost (justitia)?

The two policies share everything but the cost in their virtual finish tags: KV token-time
`p d + d(d+1)/2` or the compute-token charge `p + 2d`. On the paper's mix built from the
traces here they rank agents much alike (docs/benchmarks.md), and justitia-c is within a few
percent of justitia. This script widens the one thing that separates the two costs: an
agent's KV cost over its compute cost grows with its output lengths, so it multiplies the
outputs of the reasoning-style agent types (self-consistency sampling and equation
verification, chain-of-thought answers in the paper's setting) by k, keeps every other type
as drawn, rebuilds the arrivals for the same offered load, and reports, per k:

- the spread of KV/compute cost ratios across agents (p90/p10) and the Spearman correlation
  of the two costs, which is what justitia-c gets wrong;
- justitia-c's and vtc's mean JCT over justitia's (oracle costs, a100-llama7b, 300 agents).

    .venv/bin/python benchmarks/cost_model_ablation.py [--seeds 0,1,2] [--stretch 1,2,4,8]

Writes benchmarks/results/cost_model_ablation.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from server.shared.profiles import get_profile  # noqa: E402
from server.sim.mix import Traces, make_mix  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.simulator import run_comparison  # noqa: E402

STRETCHED = ("self_consistency", "equation_verification")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--densities", default="2,3")
    ap.add_argument("--stretch", default="1,2,4,8", help="output multipliers k of the stretched types")
    ap.add_argument("--load", type=float, default=0.6, help="offered load at 1x (as sim_targets.py)")
    ap.add_argument("--out", default="benchmarks/results/cost_model_ablation.json")
    args = ap.parse_args()
    profile = get_profile("a100-llama7b")
    traces = Traces.load()
    rows = []
    for k in [float(x) for x in args.stretch.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for density in [float(d) for d in args.densities.split(",")]:
                agents = make_mix(300, profile, density=density, load_1x=args.load, seed=seed, traces=traces,
                                  output_scale={t: k for t in STRETCHED})
                kv = [a.kv_cost for a in agents]
                cc = [a.compute_cost for a in agents]
                p10, p90 = np.quantile(np.divide(kv, cc), [0.1, 0.9], method="lower")
                res = {r.policy: r.summary()["mean_jct_s"]
                       for r in run_comparison(agents, ["justitia", "justitia-c", "vtc"], profile)}
                row = {"stretch": k, "seed": seed, "density": density,
                       "kv_over_compute_p90_p10": float(p90 / p10),
                       "spearman_kv_compute": float(spearmanr(kv, cc).statistic), "mean_jct_s": res,
                       "justitia_c_over_justitia": res["justitia-c"] / res["justitia"],
                       "vtc_over_justitia": res["vtc"] / res["justitia"]}
                rows.append(row)
                print(f"k {k:g} seed {seed} {density:g}x: KV/compute p90/p10 {row['kv_over_compute_p90_p10']:.1f}  "
                      f"spearman {row['spearman_kv_compute']:.2f}  justitia-c/justitia "
                      f"{row['justitia_c_over_justitia']:.3f}  vtc/justitia {row['vtc_over_justitia']:.3f}", flush=True)
    summary = {}
    for k in sorted({r["stretch"] for r in rows}):
        sel = [r for r in rows if r["stretch"] == k]
        summary[f"{k:g}"] = {key: statistics.fmean(r[key] for r in sel) for key in (
            "kv_over_compute_p90_p10", "spearman_kv_compute", "justitia_c_over_justitia", "vtc_over_justitia")}
        print(f"k {k:g} mean:", {key: round(v, 3) for key, v in summary[f"{k:g}"].items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {"config": vars(args), "stretched_types": STRETCHED,
                                          "rows": rows, "mean": summary}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
