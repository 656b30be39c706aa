"""How tight a deadline can be and still be kept: promises broken against deadline / JCT.

Every member of the evaluation family (each shape, fresh and taught) is simulated on each
engine profile, for tuning seeds and for held-out seeds. Each agent keeps what its first
deadline was made of (`PromiseParts`: the worst case, the ETA, the fair share, its
context's floor and record), so the deadline another floor would have given is computed
from it rather than simulated again: a deadline changes nothing in the schedule.

Rules compared:

- `current`: the floors of server/scheduler/tight_promise.py (CONTEXT_FLOORS,
  LARGE_CONTEXT_FLOORS);
- `qQ` for each Q of --quantiles: per cell (context, large or not), the Q-quantile over the
  tuning seeds' agents of the factor each needed to be kept (JCT over its ETA, counting only
  agents a calibrated deadline was given to, whose worst case held, and whom neither the fair
  share nor the record covered), rounded up to a half: `q1` is the floor that keeps every
  tuning agent, the documented rule applied to these seeds.

For each rule (the JSON's `rules`, a list), per seed set: promises broken (not by the client's tool time past its
allowance), members (shape, seed, mode, profile; not `sessions`, whose deadlines rest on
tool time) whose median deadline / JCT is at most 4x, and the median of those medians.

    python benchmarks/promise_tradeoff.py --tuning 0-19 --heldout 100-119 \\
        --json benchmarks/results/promise_tradeoff.json
"""

from __future__ import annotations

import argparse
import collections
import math
import multiprocessing
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.progress import track

from server.scheduler.tight_promise import CONTEXT_EDGES, PromiseParts, floor_of
from server.shared.profiles import load_profile
from server.sim.family import MODES, simulate_member
from server.sim.provenance import write_result
from server.sim.shapes import SHAPES, ShapeSpec

RESULTS = "benchmarks/results"
DEFAULT_PROFILES = ("cpu-tiny", f"{RESULTS}/profile_cpu_tiny_4096_famlive_rest.json",
                    *(f"{RESULTS}/profile_cpu_tiny_4096_famlive_{n}.json" for n in (112, 113, 114, 115)))
TIGHT = 4.0  # the target for a member's median deadline / JCT
Cell = tuple[int, bool]


@dataclass(frozen=True)
class Promised:
    """One agent's first promise and how it ended."""

    member: tuple[str, str, int, str]  # profile, shape, seed, mode
    parts: PromiseParts
    jct_s: float
    tools: bool  # broken only by the client's tool time past its allowance

    @property
    def cell(self) -> Cell:
        return self.parts.context, self.parts.large

    def kept(self, floors: dict[Cell, float] | None) -> bool:
        return self.tools or self.jct_s <= self.deadline_s(floors) + 1e-6

    def deadline_s(self, floors: dict[Cell, float] | None) -> float:
        return self.parts.deadline_s(None if floors is None else floors.get(self.cell))

    def needed(self) -> float | None:
        """The least floor that keeps it (None: any does, or none can)."""
        p = self.parts
        if not p.calibrated or p.eta_s <= 0 or p.worst_s < self.jct_s or self.tools:
            return None
        if p.fair_share_s >= self.jct_s or (p.record or 0.0) * p.eta_s >= self.jct_s:
            return None
        return self.jct_s / p.eta_s


def seeds_of(text: str) -> list[int]:
    a, _, b = text.partition("-")
    return list(range(int(a), int(b or a) + 1))


def run_member(job: tuple[str, int, str, str, int]) -> list[Promised]:
    path, seed, shape, mode, kv_tokens = job
    result = simulate_member(ShapeSpec(shape, seed=seed), mode, ["justitia"], load_profile(path), kv_tokens)[0]
    return [Promised((path, shape, seed, mode), a.first_promise, a.jct_s, a.promise_broken_by_tools)
            for a in result.agents if a.first_promise is not None and a.first_deadline_s is not None]


def collect(profiles: Sequence[str], seeds: Sequence[int], kv_tokens: int, jobs: int, label: str) -> list[Promised]:
    work = [(p, s, shape, mode, kv_tokens) for p in profiles for s in seeds for shape in SHAPES for mode in MODES]
    out: list[Promised] = []
    with multiprocessing.Pool(jobs) as pool:
        for agents in track(pool.imap_unordered(run_member, work), total=len(work), description=label):
            out += agents
    return out


def floors_at(agents: Iterable[Promised], q: float) -> dict[Cell, float]:
    """Per cell, the q-quantile of the factors its agents needed, rounded up to a half (at
    least the least a deadline can be: 1x the ETA)."""
    needs: dict[Cell, list[float]] = collections.defaultdict(list)
    for a in agents:
        if (need := a.needed()) is not None:
            needs[a.cell].append(need)
    floors = {}
    for cell, values in needs.items():
        values.sort()
        floors[cell] = max(1.0, math.ceil(2.0 * values[min(len(values) - 1, int(q * len(values)))]) / 2.0)
    return floors


def score(agents: Sequence[Promised], floors: dict[Cell, float] | None) -> dict:
    ratios: dict[tuple, list[float]] = collections.defaultdict(list)
    broken = 0
    for a in agents:
        broken += not a.kept(floors)
        if a.jct_s > 0:
            ratios[a.member].append(a.deadline_s(floors) / a.jct_s)
    medians = [statistics.median(v) for k, v in ratios.items() if k[1] != "sessions"]
    return {"promises": len(agents), "broken": broken, "members": len(medians),
            "members_within_4x": sum(m <= TIGHT for m in medians),
            "median_deadline_over_jct": statistics.median(medians) if medians else None}


def cell_name(cell: Cell) -> str:
    context, large = cell
    return f"{'large' if large else 'typical'}@{context}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tuning", default="0-19", help="tuning seeds A-B (default: 0-19)")
    ap.add_argument("--heldout", default="100-119", help="held-out seeds A-B (default: 100-119)")
    ap.add_argument("--profiles", default=",".join(DEFAULT_PROFILES),
                    help="comma-separated engine profiles (built-in names or `bench calibrate` files)")
    ap.add_argument("--quantiles", default="1,0.999,0.995,0.99",
                    help="quantiles of the tuning agents' needed factors to set floors at")
    ap.add_argument("--kv-tokens", type=int, default=4096, help="KV cache capacity in tokens (default: 4096)")
    ap.add_argument("--jobs", type=int, default=2, help="simulations run at once (default: 2)")
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    tuning = collect(profiles, seeds_of(args.tuning), args.kv_tokens, args.jobs, f"tuning seeds {args.tuning}")
    heldout = collect(profiles, seeds_of(args.heldout), args.kv_tokens, args.jobs, f"held-out seeds {args.heldout}")
    current = {(c, large): floor_of(c, large) for c in range(len(CONTEXT_EDGES) + 1) for large in (False, True)}
    rules: list[tuple[str, float | None, dict[Cell, float] | None]] = [("current", None, None)]
    for q in (float(x) for x in args.quantiles.split(",")):
        rules.append((f"q{q:g}", q, floors_at(tuning, q)))
    doc: dict = {"config": {"tuning": args.tuning, "heldout": args.heldout, "profiles": profiles,
                            "shapes": list(SHAPES), "modes": list(MODES),
                            "kv_tokens": args.kv_tokens}, "rules": []}
    print(f"{'rule':10s} {'tuning broken':>14s} {'within 4x':>10s} {'median':>7s} | "
          f"{'held-out broken':>16s} {'within 4x':>10s} {'median':>7s}  floors")
    for name, quantile, floors in rules:
        used = current if floors is None else {**current, **floors}
        t, h = score(tuning, floors), score(heldout, floors)
        doc["rules"].append({"name": name, "quantile": quantile,
                             "floors": {cell_name(c): f for c, f in sorted(used.items())}, "tuning": t, "heldout": h})
        print(f"{name:10s} {t['broken']:>6d}/{t['promises']:<7d} {t['members_within_4x']:>4d}/{t['members']:<5d} "
              f"{t['median_deadline_over_jct']:7.2f} | {h['broken']:>6d}/{h['promises']:<9d} "
              f"{h['members_within_4x']:>4d}/{h['members']:<5d} {h['median_deadline_over_jct']:7.2f}  "
              + " ".join(f"{cell_name(c)}={f:g}" for c, f in sorted(used.items())))
    if args.json:
        write_result(args.json, doc, argv=sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
