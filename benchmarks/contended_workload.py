"""The contended 48-agent workload of the live promise runs, for any seed.

    .venv/bin/python benchmarks/contended_workload.py --seed 4 --out benchmarks/workloads/contended48_seed4.jsonl

The recipe of `benchmarks/workloads/contended48.jsonl` (docs/benchmarks.md, "Calibrated profile
and the contended live run"): `bench make-workload --agents 48 --length-scale 0.5 --kv-tokens
4096 --profile benchmarks/results/profile_cpu_tiny_4096.json --seed S`, then arrivals every
0.05 s in arrival order and prompts clipped so that p + d <= 2,600 tokens. Seed 3 gives
contended48.jsonl itself (checked by tests/core/test_sim_workload.py); another seed gives another
sample of the same traffic, such as the one `bench live --teach` replays first.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.shared.profiles import load_profile  # noqa: E402
from server.sim.mix import make_mix  # noqa: E402
from server.sim.workload import AgentSpec, save_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "benchmarks" / "results" / "profile_cpu_tiny_4096.json"
GAP_S = 0.05
LONGEST = 2600  # p + d of any request, within the run's --max-model-len 4096


def contended(seed: int) -> list[AgentSpec]:
    agents = make_mix(48, load_profile(str(PROFILE)), kv_tokens=4096, density=1.0, load_1x=0.6,
                      seed=seed, length_scale=0.5)
    return [replace(a, arrival=round(GAP_S * i, 2),
                    stages=[[(min(p, LONGEST - d), d) for p, d in st] for st in a.stages])
            for i, a in enumerate(sorted(agents, key=lambda a: a.arrival))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    save_workload(contended(args.seed), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
