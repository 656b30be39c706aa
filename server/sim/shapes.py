"""A family of arrival shapes: the traffic the ETA and the promises are evaluated on.

A scheduler's promises are only as good as the traffic they were checked on. The paper's
mix (`mix.make_mix`) fixes one arrival process (consecutive Mooncake arrivals); this module
keeps its agents (the nine types, lengths from the public traces) and re-times or reshapes
them from a seed, so that rules can be tuned on some seeds and reported on others:

| shape | what it stresses |
|---|---|
| poisson | memoryless arrivals at the offered load |
| bursts | groups of 4-16 agents 0.05 s apart, lulls of random (exponential) length between them |
| diurnal | a rate that ramps up and down over the span (one sine period, 0.2x to 1.8x the mean) |
| heavy-tail | Poisson arrivals; each agent's fan-out repeated a Pareto(1.2) number of times (at most 8) |
| tenants | Poisson arrivals from three tenants offering 60/30/10% of the load (`"tenant"` field) |
| sessions | agents of several turns with tool pauses between them (`"pauses_s"`, lognormal, median 0.8 s) |

Every shape offers `load` of what the profile's engine sustains on the drawn agents
(R = M / tau, `EngineProfile.effective_tau_s`) over the span of its arrivals, so that shapes
differ in how work arrives, not in how much.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from server.shared.profiles import EngineProfile

from .mix import make_mix
from .workload import AgentSpec

SHAPES = ("poisson", "bursts", "diurnal", "heavy-tail", "tenants", "sessions")
BURST_GAP_S = 0.05  # agents of one burst arrive this far apart (a notebook's batch)
TENANT_SHARES = (("t0", 0.6), ("t1", 0.3), ("t2", 0.1))
PAUSE_MEDIAN_S = 0.8  # a tool call's median length (lognormal)
PAUSE_SIGMA = 1.0  # ... and the sigma of its log


@dataclass(frozen=True)
class ShapeSpec:
    """One member of the family: a shape, its size, its offered load and its seed."""

    shape: str
    agents: int = 48
    load: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; choose from {', '.join(SHAPES)}")
        if self.agents < 1 or not self.load > 0:
            raise ValueError("a shape needs at least one agent and a positive load")


def _rate(agents: list[AgentSpec], profile: EngineProfile, m: int) -> float:
    """KV token-time per second the engine sustains on these agents' requests."""
    reqs = [(p, d) for a in agents for st in a.stages for p, d in st]
    return m / profile.effective_tau_s(m, reqs)


def _offsets(shape: str, n: int, rng: random.Random) -> tuple[list[float], list[float]]:
    """Arrival offsets of n agents as (fixed seconds, seconds to scale): arrival i is
    fixed[i] + k * scaled[i], with k set by the offered load. Only the gaps between bursts
    scale: the agents of one burst stay BURST_GAP_S apart whatever the load."""
    if shape == "bursts":
        fixed: list[float] = []
        scaled: list[float] = []
        lull_total = within = 0.0
        while len(fixed) < n:
            size = rng.randint(4, 16)
            for j in range(size):
                fixed.append(within + BURST_GAP_S * j)
                scaled.append(lull_total)
            within += BURST_GAP_S * (size - 1)
            lull_total += rng.expovariate(1.0 / size)  # a lull of about the burst's own work
        return fixed[:n], scaled[:n]
    if shape == "diurnal":
        # Thinning of a Poisson process of rate 1.8 by (1 + 0.8 sin(2 pi t / T)) / 1.8.
        times: list[float] = []
        t = 0.0
        while len(times) < n:
            t += rng.expovariate(1.8)
            if rng.random() < (1.0 + 0.8 * math.sin(2 * math.pi * t / n)) / 1.8:
                times.append(t)
        return [0.0] * n, [x - times[0] for x in times]
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(1.0)
    return [0.0] * n, times


def _heavy_tail(agents: list[AgentSpec], rng: random.Random) -> None:
    """Each agent's size times a Pareto(1.2) draw (at most 8): its parallel stages fan out k
    times wider, a sequential agent takes k times the steps (at most 40)."""
    for a in agents:
        k = min(8, int(rng.paretovariate(1.2)))
        if k > 1:
            if any(len(st) > 1 for st in a.stages):
                a.stages = [st * k if len(st) > 1 else st for st in a.stages]
            else:
                a.stages = (a.stages * k)[: max(len(a.stages), 40)]
        a.extra["size_multiplier"] = k


def _tenants(agents: list[AgentSpec], rng: random.Random) -> None:
    names = [t for t, _ in TENANT_SHARES]
    weights = [w for _, w in TENANT_SHARES]
    for a in agents:
        a.tenant = rng.choices(names, weights)[0]


def _sessions(agents: list[AgentSpec], rng: random.Random) -> None:
    """Every agent becomes a session of sequential turns: its stages run one request at a
    time (a chat or a ReAct loop), with a tool pause before every turn but the first."""
    for a in agents:
        turns = [[r] for st in a.stages for r in st][:8]
        a.stages = turns
        a.pauses = [0.0] + [round(rng.lognormvariate(math.log(PAUSE_MEDIAN_S), PAUSE_SIGMA), 3) for _ in turns[1:]]


RESHAPE: dict[str, Callable[[list[AgentSpec], random.Random], None]] = {
    "heavy-tail": _heavy_tail,
    "tenants": _tenants,
    "sessions": _sessions,
}


def make_shaped(spec: ShapeSpec, profile: EngineProfile, kv_tokens: int | None = None) -> list[AgentSpec]:
    """The agents of `spec`: the paper's mix drawn from `spec.seed`, reshaped and re-timed."""
    m = int(kv_tokens or profile.kv_tokens)
    agents = make_mix(spec.agents, profile, kv_tokens=m, seed=spec.seed)
    rng = random.Random(f"shape:{spec.shape}:{spec.seed}")
    if spec.shape in RESHAPE:
        RESHAPE[spec.shape](agents, rng)
    fixed, scaled = _offsets(spec.shape, len(agents), rng)
    rng.shuffle(agents)  # which agent arrives when is drawn too, not the mix's order
    # Spread the work over the span that offers `load`: the last arrival plus one mean gap.
    span = sum(a.kv_cost for a in agents) / (_rate(agents, profile, m) * spec.load)
    n = len(agents)
    unit_span = scaled[-1] * n / max(1, n - 1) if n > 1 else 1.0
    k = max(span - fixed[-1], 0.0) / unit_span if unit_span > 0 else 0.0
    for j, a in enumerate(agents):
        a.arrival = round(fixed[j] + k * scaled[j], 6)
        a.id = f"{spec.shape}-{spec.seed}-a{j}"
        a.extra["shape"] = spec.shape
    return sorted(agents, key=lambda a: a.arrival)
