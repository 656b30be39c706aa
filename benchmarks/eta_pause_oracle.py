"""How close can any first ETA come on agents that pause, without knowing their clients' tool time?

The family's `sessions` shape (`server/sim/shapes.py`) gives every agent a lognormal tool
pause (median 0.8 s, sigma 1) before each turn but the first. An ETA made at registration
cannot know those draws. This script runs the shape's members in the simulator (a fresh
server, as `bench family`) and sets beside the server's first ETAs those of an oracle that
knows everything the run did except the draws of the agent's own pauses: its time outside
them (its JCT less its pauses, `E`) and the distribution they are drawn from. The oracle's
ETA is the x minimising the expected relative error E|x - T| / T over T = E + the sum of
its pauses (the median of T's samples weighted by 1 / T: `weighted_median`, the rule the
server's own scale follows). Its error against the JCTs the run had is what the draws alone
cost; first-ETA error targets below it cannot be met by any ETA of this traffic.

Printed per seed and as medians over seeds (the family's summary): first-ETA error p50 /
p90, the server's and the oracle's.

    .venv/bin/python benchmarks/eta_pause_oracle.py [--seeds 100-104] [--samples 4000]
        [--json benchmarks/results/eta_pause_oracle.json]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from justitia_cli.bench.family import parse_seeds  # noqa: E402
from server.scheduler.eta_interval import weighted_median  # noqa: E402
from server.shared.profiles import load_profile  # noqa: E402
from server.sim.family import simulate_member  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.results import quantile  # noqa: E402
from server.sim.shapes import PAUSE_MEDIAN_S, PAUSE_SIGMA, ShapeSpec, make_shaped  # noqa: E402
from server.sim.workload import AgentSpec  # noqa: E402


def oracle_eta(engine_s: float, pauses: int, rng: random.Random, samples: int) -> float:
    """The ETA minimising the expected relative error over T = engine_s + `pauses` draws."""
    if pauses == 0:
        return engine_s
    mu = math.log(PAUSE_MEDIAN_S)
    totals = sorted(engine_s + sum(rng.lognormvariate(mu, PAUSE_SIGMA) for _ in range(pauses))
                    for _ in range(samples))
    return weighted_median(totals)


def errors(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """p50 / p90 of |eta - jct| / jct over (eta, jct) pairs, as the family's summary takes them."""
    errs = sorted(abs(eta - jct) / jct for eta, jct in pairs)
    return quantile(errs, 0.5), quantile(errs, 0.9)


def run_seed(seed: int, profile, kv_tokens: int, rng: random.Random, samples: int) -> dict:
    spec = ShapeSpec("sessions", 48, 0.9, seed)
    agents: dict[str, AgentSpec] = {a.id: a for a in make_shaped(spec, profile, kv_tokens)}
    result = simulate_member(spec, "fresh", ["justitia"], profile, kv_tokens)[0]
    server, oracle = [], []
    for r in result.agents:
        if r.first_eta_s is None or r.jct_s <= 0:
            continue
        pauses = agents[r.id].pauses or []
        drawn = len(pauses[1:])  # the first turn has none
        server.append((r.first_eta_s, r.jct_s))
        oracle.append((oracle_eta(max(0.0, r.jct_s - sum(pauses)), drawn, rng, samples), r.jct_s))
    (s50, s90), (o50, o90) = errors(server), errors(oracle)
    return {"seed": seed, "agents": len(server), "server_p50": s50, "server_p90": s90,
            "oracle_p50": o50, "oracle_p90": o90}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="100-104", help="a range A-B or a comma-separated list")
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=4000, help="pause draws per agent for the oracle's ETA")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    rng = random.Random(0)
    rows = []
    for seed in parse_seeds(args.seeds):
        row = run_seed(seed, profile, args.kv_tokens, rng, args.samples)
        rows.append(row)
        print(f"seed {seed}: server {row['server_p50']:.2f} / {row['server_p90']:.2f}, "
              f"oracle {row['oracle_p50']:.2f} / {row['oracle_p90']:.2f}")
    summary = {k: statistics.median(r[k] for r in rows)
               for k in ("server_p50", "server_p90", "oracle_p50", "oracle_p90")}
    print(f"median over seeds: server {summary['server_p50']:.2f} / {summary['server_p90']:.2f}, "
          f"oracle {summary['oracle_p50']:.2f} / {summary['oracle_p90']:.2f}")
    if args.json:
        write_result(args.json, {"shape": "sessions", "mode": "fresh", "seeds": parse_seeds(args.seeds),
                                 "profile": args.profile, "kv_tokens": args.kv_tokens, "samples": args.samples,
                                 "pause_median_s": PAUSE_MEDIAN_S, "pause_sigma": PAUSE_SIGMA,
                                 "summary": summary, "runs": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
