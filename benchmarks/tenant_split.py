"""A tenant that splits its load into many agents, against an honest tenant (simulator).

The honest tenant runs five 4-stage agents (two requests of 400 + 32 tokens a stage), one
every 2 s from t = 1 s. Another tenant sends N requests of 300 + 60 tokens from t = 0:

- `one`: as one agent (all N requests in one stage);
- `split`: as a new agent per request (what untagged requests are: one agent each);
- `preregistered`: through 400 agents registered up front, its requests spread over them.

Each is run without tenants (the flat fair share per agent: every agent is its own claim)
and with them (the hierarchical fair share: tenants first, then their agents), under
justitia on the simulator's default engine (M = 45,000 tokens). Then queue-then-cancel on
the scheduler core: another tenant's delay bound around a cancelled agent's 200 queued
requests. Printed and written to
benchmarks/results/tenant_split.json: the honest agents' mean JCT, their largest first
deadline (seconds after arrival), their promises kept, and each split's ratio against
`one`. What it shows: without tenants, splitting multiplies the honest tenant's JCT and
deadlines; with tenants, they stay within 1.5x.

    python benchmarks/tenant_split.py [--requests 1500] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.scheduler import Dispatcher, RequestSpec, kv_cost  # noqa: E402
from server.shared.profiles import get_profile  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.simulator import make_predictions, simulate  # noqa: E402
from server.sim.workload import AgentSpec  # noqa: E402

HONEST = "honest"
FLOOD = "flood"


def workload(shape: str, tenants: bool, n: int) -> list[AgentSpec]:
    h, x = (HONEST, FLOOD) if tenants else (None, None)
    agents = [AgentSpec(f"h{i}", "honest", 1.0 + 2.0 * i, [[(400, 32)] * 2 for _ in range(4)], tenant=h)
              for i in range(5)]
    if shape == "one":
        agents.append(AgentSpec("x", "flood", 0.0, [[(300, 60)] * n], tenant=x))
    elif shape == "split":
        agents += [AgentSpec(f"x{i}", "flood", 0.01 * i, [[(300, 60)]], tenant=x) for i in range(n)]
    elif shape == "preregistered":
        k = 400
        per = [n // k + (1 if i < n % k else 0) for i in range(k)]
        agents += [AgentSpec(f"x{i}", "flood", 0.0, [[(300, 60)] * per[i]], tenant=x) for i in range(k) if per[i]]
    else:
        raise ValueError(shape)
    return sorted(agents, key=lambda a: a.arrival)


def run(shape: str, tenants: bool, n: int) -> dict:
    agents = workload(shape, tenants, n)
    t0 = time.perf_counter()
    res = simulate(agents, "justitia", get_profile("a100-llama7b"), 45_000, make_predictions(agents),
                   isolated=[0.0] * len(agents))
    honest = [a for a in res.agents if a.id.startswith("h")]
    return {
        "shape": shape,
        "tenants": tenants,
        "honest_mean_jct_s": sum(a.jct_s for a in honest) / len(honest),
        "honest_max_jct_s": max(a.jct_s for a in honest),
        "honest_max_first_deadline_s": max(a.first_deadline_s for a in honest),
        "honest_promises_kept": sum(a.jct_s <= a.first_deadline_s for a in honest),
        "honest_within_bound": sum(a.finish_s <= a.gps_finish_s + a.delay_bound_s + 1e-6 for a in honest),
        "honest_max_gps_finish_s": max(a.gps_finish_s - a.arrival_s for a in honest),
        "flood_makespan_s": max(a.finish_s for a in res.agents),
        "sim_wall_s": time.perf_counter() - t0,
    }


def queue_then_cancel() -> dict:
    """Another tenant queues 200 requests of 2,040 + 500 tokens on one agent and cancels it
    8 s later: an honest tenant's delay bound before, during and after (scheduler core)."""
    d = Dispatcher("justitia", 45_000, 0.025)
    d.register_agent("h", 4 * kv_cost(500, 500), 0.0, tenant=HONEST)
    for j in range(4):
        d.submit(RequestSpec(f"h/{j}", "h", 500, 500, 500), 0.0)
    d.admit(0.0)
    before = d.register_agent("h2", kv_cost(500, 500), 0.1, tenant=HONEST).delay_bound_s
    d.register_agent("x", 1.0, 0.2, tenant=FLOOD)
    for j in range(200):
        d.submit(RequestSpec(f"x/{j}", "x", 2040, 500, 500), 0.2)
    d.admit(0.2)
    during = d.register_agent("h3", kv_cost(500, 500), 4.0, tenant=HONEST).delay_bound_s
    d.cancel_agent("x", 8.0)
    after = d.register_agent("h4", kv_cost(500, 500), 8.1, tenant=HONEST).delay_bound_s
    return {"bound_before_s": before, "bound_during_s": during, "bound_after_s": after, "ratio": after / before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500, help="the other tenant's requests (default 1500)")
    ap.add_argument("--out", default="benchmarks/results/tenant_split.json")
    args = ap.parse_args()
    rows = [run(shape, tenants, args.requests)
            for tenants in (False, True) for shape in ("one", "split", "preregistered")]
    print(f"{'share':<13} {'flood as':<14} {'JCT mean':>9} {'x one':>6} {'deadline':>9} {'x one':>6} "
          f"{'kept':>5} {'bound':>6}")
    for row in rows:
        base = next(r for r in rows if r["tenants"] == row["tenants"] and r["shape"] == "one")
        row["jct_ratio_vs_one"] = row["honest_mean_jct_s"] / base["honest_mean_jct_s"]
        row["deadline_ratio_vs_one"] = row["honest_max_first_deadline_s"] / base["honest_max_first_deadline_s"]
        print(f"{'hierarchical' if row['tenants'] else 'flat (agents)':<13} {row['shape']:<14} "
              f"{row['honest_mean_jct_s']:>8.2f}s {row['jct_ratio_vs_one']:>5.2f}x "
              f"{row['honest_max_first_deadline_s']:>8.1f}s {row['deadline_ratio_vs_one']:>5.2f}x "
              f"{row['honest_promises_kept']:>3}/5 {row['honest_within_bound']:>4}/5")
    cancel = queue_then_cancel()
    print(f"queue-then-cancel: another tenant's bound {cancel['bound_before_s']:.1f} s before, "
          f"{cancel['bound_during_s']:.1f} s queued, {cancel['bound_after_s']:.1f} s after ({cancel['ratio']:.2f}x)")
    out = {
        "config": {"requests": args.requests, "policy": "justitia", "kv_tokens": 45_000, "profile": "a100-llama7b",
                   "honest": "5 agents x 4 stages x 2 requests (400 + 32 tokens), one every 2 s from t = 1",
                   "flood": "requests of 300 + 60 tokens from t = 0"},
        "rows": rows,
        "queue_then_cancel": cancel,
    }
    write_result(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
