"""Benchmark output: the JSON of DESIGN section 8, comparisons, a terminal table, a plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from .provenance import write_result
from .results import PolicyResult


def compare(results: Sequence[PolicyResult], policy: str = "justitia", baseline: str = "vtc") -> dict | None:
    """Per-agent comparison of two policies of one run: the share of agents that finish no
    later under `policy` than under `baseline`, and the worst slowdown against it."""
    by = {r.policy: r for r in results}
    if policy not in by or baseline not in by:
        return None
    a = {x.id: x for x in by[policy].agents}
    b = {x.id: x for x in by[baseline].agents}
    ids = [i for i in a if i in b]
    not_later = sum(a[i].finish_s <= b[i].finish_s + 1e-9 for i in ids)
    slowdowns = [a[i].jct_s / b[i].jct_s - 1.0 for i in ids if b[i].jct_s > 0]
    mean = lambda r: sum(x.jct_s for x in r.agents) / max(1, len(r.agents))  # noqa: E731
    return {
        "policy": policy,
        "baseline": baseline,
        "mean_jct_ratio": mean(by[policy]) / mean(by[baseline]) if mean(by[baseline]) else None,
        "share_not_later": not_later / max(1, len(ids)),
        "worst_slowdown": max(slowdowns, default=0.0),
    }


def comparisons(results: Sequence[PolicyResult]) -> list[dict]:
    """Justitia against the main baselines, then every other policy against vtc (the share of
    agents that finish no later than under instantaneous fair sharing)."""
    pairs = [("justitia", "vtc"), ("justitia", "srjf"), ("justitia-c", "justitia"), ("justitia", "fcfs"),
             ("justitia", "ewsjf"), ("justitia", "equinox"), ("justitia", "las"),
             ("justitia", "justitia-nocache")]
    pairs += [(r.policy, "vtc") for r in results if r.policy not in ("vtc", "justitia")]
    return [c for c in (compare(results, p, b) for p, b in pairs) if c is not None]


def median_interval(values: Sequence[float], level: float = 0.9) -> dict | None:
    """A distribution-free interval for the median of paired ratios (the sign test's): the
    k-th smallest and the k-th largest of n values cover the median with probability
    1 - 2 P(Binomial(n, 1/2) < k). The narrowest with at least `level`; with too few values
    for that, the smallest and the largest, with what they cover (None: fewer than two).
    Three rounds cover the median with 75%, five with 94%: a median of 0.88 over five
    rounds between 0.83 and 1.07 does not tell 0.88 from 0.90."""
    xs = sorted(values)
    n = len(xs)
    if n < 2:
        return None

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n

    k = 1
    while k + 1 <= n // 2 and coverage(k + 1) >= level:
        k += 1
    return {"low": xs[k - 1], "high": xs[n - k], "coverage": coverage(k)}


def median_runs(rounds: Sequence[Sequence[PolicyResult]]) -> tuple[list[PolicyResult], dict]:
    """Policies run several times, alternated (`rounds[k]`: round k, one run per policy in the
    same order). Each policy's row is its run of median mean JCT (the lower middle one of an
    even count), so that one slow or fast stretch of a shared machine does not decide a
    comparison. Returns those runs and `repeats`: every run's summary (without its agents)
    and, per comparison, the ratio of mean JCTs within each round, where both policies ran
    on the machine of the same few minutes."""
    if not rounds or any(len(r) != len(rounds[0]) for r in rounds):
        raise ValueError("every round runs the same policies")
    chosen = []
    for i in range(len(rounds[0])):
        of_policy = sorted((rnd[i] for rnd in rounds), key=_mean_jct)
        chosen.append(of_policy[(len(of_policy) - 1) // 2])
    per_round = [comparisons(rnd) for rnd in rounds]
    paired = []
    for j, c in enumerate(per_round[0]):
        ratios = [pr[j]["mean_jct_ratio"] for pr in per_round]
        known = sorted(x for x in ratios if x is not None)
        paired.append({"policy": c["policy"], "baseline": c["baseline"], "mean_jct_ratio_by_round": ratios,
                       "median_mean_jct_ratio": known[(len(known) - 1) // 2] if known else None,
                       "median_interval": median_interval(known),
                       "pooled_mean_jct_ratio": _pooled_ratio(rounds, c["policy"], c["baseline"])})
    runs = [{"round": k, **{key: v for key, v in r.summary().items() if key != "agents"}}
            for k, rnd in enumerate(rounds) for r in rnd]
    return chosen, {"rounds": len(rounds), "runs": runs, "paired": paired}


def _pooled_ratio(rounds: Sequence[Sequence[PolicyResult]], policy: str, baseline: str) -> float | None:
    """The policy's mean JCT summed over the rounds, over the baseline's: every round weighs
    by its JCTs, where the median of the ratios weighs every round alike."""
    total = {policy: 0.0, baseline: 0.0}
    for rnd in rounds:
        by = {r.policy: r for r in rnd}
        if policy in by and baseline in by:
            total[policy] += _mean_jct(by[policy])
            total[baseline] += _mean_jct(by[baseline])
    return total[policy] / total[baseline] if total[baseline] else None


def _mean_jct(result: PolicyResult) -> float:
    """`result.summary()["mean_jct_s"]` without the summary's quantiles."""
    return statistics.fmean(a.jct_s for a in result.agents) if result.agents else 0.0


def write_json(path: str | Path, config: dict, results: Sequence[PolicyResult],
               repeats: dict | None = None) -> dict:
    doc = {
        "config": config,
        "results": [r.as_dict() for r in results],
        "comparisons": comparisons(results),
    }
    if repeats is not None:
        doc["repeats"] = repeats
    return write_result(path, doc)


def print_table(results: Sequence[PolicyResult], title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for col in ("policy", "mean JCT", "p50", "p90", "p99", "max", "makespan", "preempt", "over bound",
                "ETA err p50", "ETA err p90", "kept", "Jain"):
        table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
    for r in results:
        s = r.summary()
        table.add_row(
            r.policy,
            f"{s['mean_jct_s']:.1f}",
            f"{s['p50_jct_s']:.1f}",
            f"{s['p90_jct_s']:.1f}",
            f"{s['p99_jct_s']:.1f}",
            f"{s['max_jct_s']:.1f}",
            f"{s['makespan_s']:.1f}",
            str(s["preemptions"]),
            str(s["bound_violations"]),
            _pct(s.get("eta_error_p50")),
            _pct(s.get("eta_error_p90")),
            f"{s.get('promises_kept', 0)}/{len(r.agents)}",
            "-" if s.get("jain_slowdown") is None else f"{s['jain_slowdown']:.3f}",
        )
    console = Console()
    if not console.is_terminal and console.width < 150:
        console = Console(width=150)  # piped output: do not squeeze the columns
    console.print(table)
    for c in comparisons(results):
        console.print(
            f"{c['policy']} vs {c['baseline']}: mean JCT x{c['mean_jct_ratio']:.3f}, "
            f"{100 * c['share_not_later']:.0f}% of agents finish no later, "
            f"worst slowdown {100 * c['worst_slowdown']:+.0f}%"
        )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def plot_cdf(results: Sequence[PolicyResult], path: str | Path, title: str = "") -> None:
    """JCT CDF of every policy (matplotlib, the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = sorted(a.jct_s for a in r.agents)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=r.policy, linewidth=1.6 if r.policy.startswith("justitia") else 1.0)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s, log scale)")
    ax.set_ylabel("fraction of agents")
    ax.set_title(title or "JCT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
