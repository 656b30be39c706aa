"""What each choice of the ETA of agents that pause is worth (server/scheduler/tool_time.py).

Runs the family's `sessions` members (fresh and taught, 48 agents at load 0.9) in the
simulator once per variant of how the tool time ahead of an agent is estimated, and prints
per variant the first-ETA error p50 / p90 and the share of JCTs inside their first interval
(medians over seeds, as `bench family` summarises), with the agents told their tool time
apart:

- `built`: as the server does it (every type's pauses, those under way counted, the longest
  seen past the last that ended, the deadline as the interval's high end where the pauses
  seen cannot place it);
- `scaled`: no tool time apart: the replay's ETA with the mean pauses, scaled as the ETAs of
  agents that do not pause are;
- `ended-only`: the pauses under way not counted (only those that ended);
- `exp-tail`: past the longest pause that ended, an exponential tail at the rate the pauses
  seen ended at;
- `true-pauses`: the shape's own lognormal in place of the pauses seen (an oracle of the
  tool time's distribution, not of its draws).

    .venv/bin/python benchmarks/tool_time_ablation.py [--seeds 0-4] [--profile cpu-tiny]
        [--json benchmarks/results/tool_time_ablation.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from justitia_cli.bench.family import parse_seeds  # noqa: E402
from server.scheduler import pauses as pauses_module  # noqa: E402
from server.scheduler.eta_estimator import EtaEstimator  # noqa: E402
from server.scheduler.tool_time import LASTING_POINTS, lasting_quantiles  # noqa: E402
from server.shared.profiles import load_profile  # noqa: E402
from server.sim.family import simulate_member  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.shapes import PAUSE_MEDIAN_S, PAUSE_SIGMA, ShapeSpec  # noqa: E402

Lasting = Callable[[Sequence[float], Sequence[float], int], tuple[float, ...]]


def ended_only(ended: Sequence[float], under_way: Sequence[float], points: int = LASTING_POINTS) -> tuple[float, ...]:
    return lasting_quantiles(ended, [], points)


def exp_tail(ended: Sequence[float], under_way: Sequence[float], points: int = LASTING_POINTS) -> tuple[float, ...]:
    """The built estimate, with the quantiles past the longest pause that ended drawn from an
    exponential tail at the rate the pauses seen ended at (ended / time lasted by all)."""
    built = lasting_quantiles(ended, under_way, points)
    if not built:
        return built
    last = max(ended)
    lasted = sum(ended) + sum(under_way)
    rate = len(ended) / lasted
    out = list(built)
    resolved = sum(x <= last for x in built) / points  # the share the estimate resolves
    for i in range(points):
        q = (i + 0.5) / points
        if q > resolved:
            out[i] = last + math.log((1.0 - resolved) / (1.0 - q)) / rate
    return tuple(out)


def true_pauses(ended: Sequence[float], under_way: Sequence[float], points: int = LASTING_POINTS) -> tuple[float, ...]:
    normal = statistics.NormalDist()
    return tuple(PAUSE_MEDIAN_S * math.exp(PAUSE_SIGMA * normal.inv_cdf((i + 0.5) / points))
                 for i in range(points))


@contextmanager
def variant(name: str) -> Iterator[None]:
    """The server with the tool time estimated the `name` way."""
    if name == "built":
        yield
    elif name == "scaled":
        with mock.patch.object(EtaEstimator, "expects_tools", lambda self, agent, now: False):
            yield
    else:
        lasting: Lasting = {"ended-only": ended_only, "exp-tail": exp_tail, "true-pauses": true_pauses}[name]
        with mock.patch.object(pauses_module, "lasting_quantiles", lasting):
            yield


VARIANTS = ("built", "scaled", "ended-only", "exp-tail", "true-pauses")


def member(seed: int, mode: str, profile, kv_tokens: int) -> dict:
    """One member's first-ETA error p50 / p90 and coverage."""
    result = simulate_member(ShapeSpec("sessions", 48, 0.9, seed), mode, ["justitia"], profile, kv_tokens)[0]
    s = result.summary()
    return {"seed": seed, "mode": mode, "eta_error_p50": s["eta_error_p50"], "eta_error_p90": s["eta_error_p90"],
            "eta_coverage": s["eta_coverage"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-4", help="a range A-B or a comma-separated list (default: the tuning seeds)")
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    seeds = parse_seeds(args.seeds)
    rows, summary = [], []
    for name in args.variants.split(","):
        with variant(name):
            runs = [member(seed, mode, profile, args.kv_tokens) | {"variant": name}
                    for mode in ("fresh", "taught") for seed in seeds]
        rows += runs
        for mode in ("fresh", "taught"):
            mine = [r for r in runs if r["mode"] == mode]
            line = {"variant": name, "mode": mode,
                    **{k: statistics.median(r[k] for r in mine)
                       for k in ("eta_error_p50", "eta_error_p90", "eta_coverage")}}
            summary.append(line)
            print(f"{name:12} {mode:6} first-ETA error {line['eta_error_p50']:.2f} / {line['eta_error_p90']:.2f}, "
                  f"in interval {line['eta_coverage']:.0%}")
    if args.json:
        write_result(args.json, {"shape": "sessions", "seeds": seeds, "profile": args.profile,
                                 "kv_tokens": args.kv_tokens, "summary": summary, "runs": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
