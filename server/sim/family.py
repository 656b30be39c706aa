"""Run the family of arrival shapes (`shapes.py`) through the simulator and summarise what
each shape does to the promises: first-ETA error, promises kept, how tight the deadlines
are, and (where the scheduler gives intervals) how often the JCT fell inside the first one.

The simulator runs with `tau="measured"`, so the ETAs and deadlines are those a live server
would have given (its rate measured from the steps it has seen, not known in advance).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from server.shared.profiles import EngineProfile

from .results import PolicyResult
from .shapes import ShapeSpec, make_shaped
from .simulator import run_comparison


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


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row_of(spec: ShapeSpec, result: PolicyResult) -> FamilyRow:
    s = result.summary()
    ratios = [a.first_deadline_s / a.jct_s for a in result.agents
              if a.first_deadline_s is not None and a.jct_s > 0]
    return FamilyRow(
        shape=spec.shape, seed=spec.seed, policy=result.policy, agents=len(result.agents),
        mean_jct_s=s["mean_jct_s"], eta_error_p50=s["eta_error_p50"], eta_error_p90=s["eta_error_p90"],
        promises_kept=s["promises_kept"], promises=sum(a.first_deadline_s is not None for a in result.agents),
        deadline_over_jct_p50=_quantile(ratios, 0.5), eta_coverage=s["eta_coverage"],
    )


def run_family(
    specs: Sequence[ShapeSpec],
    policies: Sequence[str],
    profile: EngineProfile,
    kv_tokens: int | None = None,
    on_done: Callable[[ShapeSpec], None] | None = None,
) -> list[FamilyRow]:
    """Every policy on every member of the family, in the simulator."""
    rows: list[FamilyRow] = []
    for spec in specs:
        agents = make_shaped(spec, profile, kv_tokens)
        for result in run_comparison(agents, list(policies), profile, kv_tokens, tau="measured"):
            rows.append(row_of(spec, result))
        if on_done is not None:
            on_done(spec)
    return rows


def _median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarise(rows: Sequence[FamilyRow]) -> list[dict]:
    """Per (shape, policy) over seeds: median of the per-seed figures, promises summed."""
    keys = list(dict.fromkeys((r.shape, r.policy) for r in rows))
    out = []
    for shape, policy in keys:
        mine = [r for r in rows if r.shape == shape and r.policy == policy]
        out.append({
            "shape": shape, "policy": policy, "seeds": [r.seed for r in mine],
            "mean_jct_s": _median(r.mean_jct_s for r in mine),
            "eta_error_p50": _median(r.eta_error_p50 for r in mine),
            "eta_error_p90": _median(r.eta_error_p90 for r in mine),
            "promises_kept": sum(r.promises_kept for r in mine),
            "promises": sum(r.promises for r in mine),
            "deadline_over_jct_p50": _median(r.deadline_over_jct_p50 for r in mine),
            "eta_coverage": _median(r.eta_coverage for r in mine),
        })
    return out


def family_json(rows: Sequence[FamilyRow], config: dict) -> dict:
    return {"config": config, "shapes": summarise(rows), "runs": [asdict(r) for r in rows]}
