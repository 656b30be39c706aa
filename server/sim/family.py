"""Run the family of arrival shapes (`shapes.py`) through the simulator and summarise what
each shape does to the promises: first-ETA error, promises kept, how tight the deadlines
are, and (where the scheduler gives intervals) how often the JCT fell inside the first one.

The simulator runs with `tau="measured"`, so the ETAs and deadlines are those a live server
would have given (its rate measured from the steps it has seen, not known in advance).

Two modes: `fresh` (each member on a server that has seen nothing) and `taught` (a server
that first served another shape of the family, drawn from another seed, then a lull of
`TEACH_LULL_S`, then the member: what a server knows of traffic that differs from today's).
A taught row's figures are of the member's agents only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from server.shared.profiles import EngineProfile

from .results import PolicyResult
from .shapes import SHAPES, ShapeSpec, make_shaped
from .simulator import run_comparison
from .workload import AgentSpec

MODES = ("fresh", "taught")
# The teacher's seed is the member's plus this (never a seed of the family's own ranges).
TEACH_SEED_OFFSET = 7919
# From the teacher's last arrival to the member's first: its agents done, and a lull longer
# than the arrival window, as between two runs a day apart.
TEACH_LULL_S = 90.0


@dataclass(frozen=True)
class FamilyRow:
    """One (shape, seed, policy) run."""

    shape: str
    seed: int
    policy: str
    agents: int
    mean_jct_s: float
    eta_error_p50: float | None
    eta_error_p90: float | None
    promises_kept: int
    promises: int
    deadline_over_jct_p50: float | None
    eta_coverage: float | None
    mode: str = "fresh"
    # promises broken only by the client's tool time beyond what they allowed (results.py)
    promises_broken_by_tools: int = 0
    eta_bias_p50: float | None = None  # median (first ETA - JCT) / JCT: negative, told too short


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row_of(spec: ShapeSpec, result: PolicyResult, mode: str = "fresh") -> FamilyRow:
    s = result.summary()
    ratios = [a.first_deadline_s / a.jct_s for a in result.agents
              if a.first_deadline_s is not None and a.jct_s > 0]
    return FamilyRow(
        shape=spec.shape, seed=spec.seed, policy=result.policy, agents=len(result.agents),
        mean_jct_s=s["mean_jct_s"], eta_error_p50=s["eta_error_p50"], eta_error_p90=s["eta_error_p90"],
        promises_kept=s["promises_kept"], promises=sum(a.first_deadline_s is not None for a in result.agents),
        deadline_over_jct_p50=_quantile(ratios, 0.5), eta_coverage=s["eta_coverage"], mode=mode,
        promises_broken_by_tools=s["promises_broken_by_tools"], eta_bias_p50=s["eta_bias_p50"],
    )


def teacher_of(spec: ShapeSpec) -> ShapeSpec:
    """The shape a taught server served first: the next one of the family (never the
    member's own), from another seed."""
    shape = SHAPES[(SHAPES.index(spec.shape) + 1) % len(SHAPES)]
    return replace(spec, shape=shape, seed=spec.seed + TEACH_SEED_OFFSET)


def teacher_and_member(spec: ShapeSpec, profile: EngineProfile, kv_tokens: int | None = None) -> tuple[
        list[AgentSpec], list[AgentSpec]]:
    """The teacher's agents (ids prefixed `teach-`) and the member's, each on its own clock."""
    teacher = make_shaped(teacher_of(spec), profile, kv_tokens)
    for a in teacher:
        a.id = f"teach-{a.id}"
    return teacher, make_shaped(spec, profile, kv_tokens)


def taught_workload(spec: ShapeSpec, profile: EngineProfile, kv_tokens: int | None = None,
                    offset_s: float | None = None) -> tuple[list[AgentSpec], set[str]]:
    """The teacher's agents, then the member's after a lull; and the member's ids. The
    member's clock starts `offset_s` after the teacher's (default: the teacher's last
    arrival plus `TEACH_LULL_S`; a live run's own offset to predict that run)."""
    teacher, member = teacher_and_member(spec, profile, kv_tokens)
    start = max(a.arrival for a in teacher) + TEACH_LULL_S if offset_s is None else offset_s
    for a in member:
        a.arrival = round(a.arrival + start, 6)
    return teacher + member, {a.id for a in member}


def run_family(
    specs: Sequence[ShapeSpec],
    policies: Sequence[str],
    profile: EngineProfile,
    kv_tokens: int | None = None,
    on_done: Callable[[ShapeSpec], None] | None = None,
    modes: Sequence[str] = ("fresh",),
) -> list[FamilyRow]:
    """Every policy on every member of the family, in the simulator, in each mode."""
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    rows: list[FamilyRow] = []
    for spec in specs:
        for mode in modes:
            rows += [row_of(spec, r, mode) for r in simulate_member(spec, mode, policies, profile, kv_tokens)]
        if on_done is not None:
            on_done(spec)
    return rows


def simulate_member(spec: ShapeSpec, mode: str, policies: Sequence[str], profile: EngineProfile,
                    kv_tokens: int | None = None, teach_offset_s: float | None = None,
                    sized_with: EngineProfile | None = None) -> list[PolicyResult]:
    """Each policy's run of one member in the simulator, the member's agents only (taught:
    the teacher first, the member's clock `teach_offset_s` after the teacher's).

    The workload's arrival rate is sized with `sized_with` (default: `profile`), so that a
    run made with one profile can be simulated again on another step model: the same agents
    and arrivals, only the engine's speed changed."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    sizing = profile if sized_with is None else sized_with
    if mode == "taught":
        agents, ids = taught_workload(spec, sizing, kv_tokens, teach_offset_s)
    else:
        agents = make_shaped(spec, sizing, kv_tokens)
        ids = {a.id for a in agents}
    return [replace(result, agents=[a for a in result.agents if a.id in ids])
            for result in run_comparison(agents, list(policies), profile, kv_tokens, tau="measured")]


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarise(rows: Sequence[FamilyRow]) -> list[dict]:
    """Per (shape, policy, mode) over seeds: median of the per-seed figures, promises summed."""
    keys = list(dict.fromkeys((r.shape, r.policy, r.mode) for r in rows))
    out = []
    for shape, policy, mode in keys:
        mine = [r for r in rows if r.shape == shape and r.policy == policy and r.mode == mode]
        out.append({
            "shape": shape, "policy": policy, "mode": mode, "seeds": [r.seed for r in mine],
            "mean_jct_s": _median(r.mean_jct_s for r in mine),
            "eta_error_p50": _median(r.eta_error_p50 for r in mine),
            "eta_error_p90": _median(r.eta_error_p90 for r in mine),
            "eta_bias_p50": _median(r.eta_bias_p50 for r in mine),
            "promises_kept": sum(r.promises_kept for r in mine),
            "promises": sum(r.promises for r in mine),
            "promises_broken_by_tools": sum(r.promises_broken_by_tools for r in mine),
            "deadline_over_jct_p50": _median(r.deadline_over_jct_p50 for r in mine),
            "eta_coverage": _median(r.eta_coverage for r in mine),
        })
    return out


def totals(rows: Sequence[FamilyRow]) -> list[dict]:
    """Per policy over every member run: the promises kept, given and broken only by the
    client's tool time (the family's one figure that must hold everywhere)."""
    out = []
    for policy in dict.fromkeys(r.policy for r in rows):
        mine = [r for r in rows if r.policy == policy]
        out.append({"policy": policy, "members": len(mine),
                    "promises_kept": sum(r.promises_kept for r in mine), "promises": sum(r.promises for r in mine),
                    "promises_broken_by_tools": sum(r.promises_broken_by_tools for r in mine)})
    return out


def family_json(rows: Sequence[FamilyRow], config: dict) -> dict:
    return {"config": config, "shapes": summarise(rows), "totals": totals(rows), "runs": [asdict(r) for r in rows]}
