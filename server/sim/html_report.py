"""`bench sim|live --html OUT.html`: a self-contained report of a run.

One HTML file, no external assets (inline CSS and SVG, no script): the policy table, the JCT
CDF of every policy, each agent's slowdown against its GPS fair-share JCT, and the promises
kept. It reads the same per-agent results as the JSON of DESIGN section 8.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import comparisons
from .results import PolicyResult

COLORS = ["#2e6fd8", "#e07a10", "#12a37f", "#c62828", "#8e44ad", "#5d6d7e", "#b7950b", "#17a2b8", "#d35400",
          "#7f8c8d"]
W, H = 640, 320
LEFT, RIGHT, TOP, BOTTOM = 56, 150, 12, 40

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; color: #1d2330; margin: 24px auto; max-width: 1000px; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 3px 9px; border-bottom: 1px solid #e4e7ec; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { color: #667085; font-weight: 600; }
svg text { font-size: 11px; fill: #475467; }
.note { color: #667085; font-size: 13px; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; }
dt { color: #667085; } dd { margin: 0; word-break: break-all; }
"""


def gps_slowdown(agent: dict[str, Any]) -> float | None:
    """The agent's JCT over its JCT in the GPS fluid reference (1: as fast as its fair share)."""
    gps_jct = agent["gps_finish_s"] - agent["arrival_s"]
    return agent["jct_s"] / gps_jct if gps_jct > 0 else None


def kept(agent: dict[str, Any]) -> bool | None:
    """The promise given at arrival: finish within `first_deadline_s` of it."""
    deadline = agent.get("first_deadline_s")
    return None if deadline is None else agent["jct_s"] <= deadline + 1e-9


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def policy_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        agents = r["agents"]
        slow = [s for a in agents if (s := gps_slowdown(a)) is not None]
        promised = [ok for a in agents if (ok := kept(a)) is not None]
        within = sum(a["finish_s"] <= a["gps_finish_s"] + a["delay_bound_s"] + 1e-6 for a in agents)
        rows.append([
            r["policy"], _f(r["mean_jct_s"]), _f(r["p50_jct_s"]), _f(r["p90_jct_s"]), _f(r["p99_jct_s"]),
            _f(r["max_jct_s"]), _f(r["makespan_s"]), _f(_quantile(slow, 0.5)), _f(_quantile(slow, 0.9)),
            _f(max(slow, default=None)),
            f"{sum(promised)}/{len(promised)}" if promised else "–",
            f"{within}/{len(agents)}",
            _f(r.get("sim_mean_jct_s")) if "sim_mean_jct_s" in r else "",
        ])
    return rows


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _log_ticks(lo: float, hi: float) -> list[float]:
    ticks = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**e
            if lo <= v <= hi:
                ticks.append(v)
    return ticks


def cdf_svg(series: dict[str, list[float]], xlabel: str, label: str) -> str:
    """Step CDFs on a log x axis, one line per series, as an inline SVG."""
    values = [v for vs in series.values() for v in vs if v > 0]
    if not values:
        return "<p class='note'>no data</p>"
    lo, hi = min(values), max(values)
    if hi <= lo:
        lo, hi = lo / 2, hi * 2
    span = math.log10(hi) - math.log10(lo)

    def x(v: float) -> float:
        return LEFT + (math.log10(max(v, lo)) - math.log10(lo)) / span * (W - LEFT - RIGHT)

    def y(q: float) -> float:
        return H - BOTTOM - q * (H - TOP - BOTTOM)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
             f'role="img" aria-label="{html.escape(label)}">',
             f'<line x1="{LEFT}" y1="{y(0)}" x2="{W - RIGHT}" y2="{y(0)}" stroke="#d0d5dd"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{y(0)}" stroke="#d0d5dd"/>']
    for q in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<text x="{LEFT - 6}" y="{y(q) + 4:.1f}" text-anchor="end">{q:g}</text>')
        parts.append(f'<line x1="{LEFT}" y1="{y(q):.1f}" x2="{W - RIGHT}" y2="{y(q):.1f}" stroke="#f0f2f5"/>')
    for t in _log_ticks(lo, hi):
        parts.append(f'<text x="{x(t):.1f}" y="{H - BOTTOM + 15}" text-anchor="middle">{t:g}</text>')
    parts.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 6}" text-anchor="middle">{html.escape(xlabel)}</text>')
    for k, (name, vs) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        xs = sorted(v for v in vs if v > 0)
        if not xs:
            continue
        points = [f"{x(xs[0]):.1f},{y(0):.1f}"]
        for i, v in enumerate(xs):
            points.append(f"{x(v):.1f},{y(i / len(xs)):.1f}")
            points.append(f"{x(v):.1f},{y((i + 1) / len(xs)):.1f}")
        width = 2.2 if name.startswith("justitia") else 1.4
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="{width}" points="{" ".join(points)}"/>')
        ly = TOP + 14 + 16 * k
        parts.append(f'<line x1="{W - RIGHT + 12}" y1="{ly - 4}" x2="{W - RIGHT + 32}" y2="{ly - 4}" '
                     f'stroke="{color}" stroke-width="3"/>')
        parts.append(f'<text x="{W - RIGHT + 38}" y="{ly}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def promises_svg(results: list[dict[str, Any]]) -> str:
    """One bar per policy: the share of agents that finished within their first deadline."""
    rows = []
    for r in results:
        promised = [ok for a in r["agents"] if (ok := kept(a)) is not None]
        rows.append((r["policy"], sum(promised) / len(promised) if promised else None))
    bar_h, gap = 18, 6
    height = TOP + len(rows) * (bar_h + gap) + 10
    width = W - RIGHT
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" width="{W}" height="{height}" '
             'role="img" aria-label="promises kept per policy">']
    for k, (name, share) in enumerate(rows):
        top = TOP + k * (bar_h + gap)
        parts.append(f'<text x="{LEFT + 44}" y="{top + 13}" text-anchor="end">{html.escape(name)}</text>')
        if share is None:
            parts.append(f'<text x="{LEFT + 52}" y="{top + 13}">no promises recorded</text>')
            continue
        length = share * (width - LEFT - 52)
        parts.append(f'<rect x="{LEFT + 52}" y="{top}" width="{length:.1f}" height="{bar_h}" '
                     f'fill="{COLORS[k % len(COLORS)]}" fill-opacity="0.8"/>')
        parts.append(f'<text x="{LEFT + 58 + length:.1f}" y="{top + 13}">{100 * share:.0f}%</text>')
    parts.append("</svg>")
    return "".join(parts)


def render(config: dict[str, Any], results: list[dict[str, Any]], compared: list[dict[str, Any]],
           title: str) -> str:
    head = ["policy", "mean JCT (s)", "p50", "p90", "p99", "max", "makespan", "slowdown vs GPS p50", "p90",
            "max", "promises kept", "within bound"]
    rows = policy_rows(results)
    if any("sim_mean_jct_s" in r for r in results):  # bench live: the simulator's prediction beside
        head.append("simulator's mean JCT")
    else:
        rows = [row[:-1] for row in rows]
    settings = "".join(f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(_short(v))}</dd>" for k, v in config.items())
    compare = "".join(
        f"<li>{html.escape(c['policy'])} vs {html.escape(c['baseline'])}: mean JCT ×{c['mean_jct_ratio']:.3f}, "
        f"{100 * c['share_not_later']:.0f}% of agents finish no later, worst slowdown "
        f"{100 * c['worst_slowdown']:+.0f}%</li>" for c in compared if c.get("mean_jct_ratio") is not None)
    jcts = {r["policy"]: [a["jct_s"] for a in r["agents"]] for r in results}
    slow = {r["policy"]: [s for a in r["agents"] if (s := gps_slowdown(a)) is not None] for r in results}
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<h2>Policies</h2>
{_table(head, rows)}
<p class="note">Slowdown vs GPS: an agent's JCT over its JCT in the GPS fluid reference (its fair share of
the KV cache; 1 = as fast as fair sharing). Promises kept: agents that finished within the deadline the
scheduler gave when they arrived (<code>jct_s &le; first_deadline_s</code>). Within bound: finished by
their GPS finish time plus their delay bound.</p>
<ul>{compare}</ul>
<h2>JCT distribution</h2>
{cdf_svg(jcts, "job completion time (s, log scale)", "JCT CDF per policy")}
<h2>Slowdown against GPS</h2>
{cdf_svg(slow, "JCT / GPS fair-share JCT (log scale)", "slowdown vs GPS CDF per policy")}
<h2>Promises kept</h2>
{promises_svg(results)}
<h2>Run</h2>
<dl>{settings}</dl>
</body></html>
"""


def _short(value: Any, limit: int = 300) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


def write_html(path: str | Path, config: dict[str, Any], results: Sequence[PolicyResult], title: str) -> Path:
    """Write the report of `results` (one per policy) to `path`."""
    docs = [r.as_dict() for r in results]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(config, docs, comparisons(results), title), encoding="utf-8")
    return out
