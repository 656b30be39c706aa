"""The scheduler's target table (mean JCT and fairness against vtc) on the simulator, over
several workload seeds.

For each seed and density (2x, 3x): builds the 300-agent mix (a100-llama7b, load 0.6 at 1x),
runs vtc, srjf, justitia, justitia-c with oracle costs and justitia with noisy:3 predictions,
and prints the ratios. Writes benchmarks/results/sim_targets.json.

    .venv/bin/python benchmarks/sim_targets.py [--seeds 0,1,2,3,4]

`--baselines ewsjf,equinox` also runs those policies (oracle) and adds, per row, justitia's
mean JCT over theirs and the share of agents that finish no later under them than under vtc
(the targets themselves are unchanged; write that run elsewhere with --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.shared.profiles import get_profile  # noqa: E402
from server.sim.mix import Traces, make_mix  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.report import compare  # noqa: E402
from server.sim.simulator import make_predictions, run_comparison  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--load", type=float, default=0.6)
    ap.add_argument("--out", default="benchmarks/results/sim_targets.json")
    ap.add_argument("--baselines", default="", help="extra policies to compare, e.g. ewsjf,equinox")
    args = ap.parse_args()
    extra = [b for b in args.baselines.split(",") if b]
    profile = get_profile("a100-llama7b")
    traces = Traces.load()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for density in (2, 3):
            agents = make_mix(300, profile, density=density, load_1x=args.load, seed=seed, traces=traces)
            res = run_comparison(agents, ["vtc", "srjf", "justitia", "justitia-c", *extra], profile)
            noisy = run_comparison(agents, ["justitia"], profile,
                                   predictions=make_predictions(agents, "noisy:3", seed=seed))[0]
            mean = {r.policy: r.summary()["mean_jct_s"] for r in res}
            vs_vtc = compare(res, "justitia", "vtc")
            row = {
                "seed": seed,
                "density": density,
                "mean_jct_s": mean,
                "justitia_over_vtc": mean["justitia"] / mean["vtc"],
                "justitia_over_srjf": mean["justitia"] / mean["srjf"],
                "share_not_later_than_vtc": vs_vtc["share_not_later"],
                "worst_slowdown_vs_vtc": vs_vtc["worst_slowdown"],
                "justitia_c_over_justitia": mean["justitia-c"] / mean["justitia"],
                "noisy3_over_oracle": noisy.summary()["mean_jct_s"] / mean["justitia"],
                "justitia_bound_violations": res[2].summary()["bound_violations"],
                "justitia_max_lag_vs_gps_s": res[2].summary()["max_lag_vs_gps_s"],
            }
            for b in extra:
                row[f"justitia_over_{b}"] = mean["justitia"] / mean[b]
                row[f"{b}_share_not_later_than_vtc"] = compare(res, b, "vtc")["share_not_later"]
            rows.append(row)
            print(f"seed {seed} {density}x: j/vtc {row['justitia_over_vtc']:.3f}  "
                  f"j/srjf {row['justitia_over_srjf']:.3f}  "
                  f"not later than vtc {100 * row['share_not_later_than_vtc']:.0f}%  worst vs vtc "
                  f"{100 * row['worst_slowdown_vs_vtc']:+.0f}%  jc/j {row['justitia_c_over_justitia']:.3f}  "
                  f"noisy3/oracle {row['noisy3_over_oracle']:.3f}  over bound {row['justitia_bound_violations']}"
                  + "".join(f"  j/{b} {row[f'justitia_over_{b}']:.3f}  {b} not later than vtc "
                            f"{100 * row[f'{b}_share_not_later_than_vtc']:.0f}%" for b in extra), flush=True)
    summary = {}
    for density in (2, 3):
        sel = [r for r in rows if r["density"] == density]
        summary[f"{density}x"] = {
            k: statistics.fmean(r[k] for r in sel)
            for k in ("justitia_over_vtc", "justitia_over_srjf", "share_not_later_than_vtc", "worst_slowdown_vs_vtc",
                      "justitia_c_over_justitia", "noisy3_over_oracle",
                      *(f"justitia_over_{b}" for b in extra), *(f"{b}_share_not_later_than_vtc" for b in extra))
        }
        print(f"mean over seeds {density}x:", {k: round(v, 3) for k, v in summary[f'{density}x'].items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {"load_1x": args.load, "rows": rows, "mean": summary}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
