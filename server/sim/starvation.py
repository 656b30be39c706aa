"""The starvation experiment: one large MapReduce agent and a flood of small agents."""

from __future__ import annotations

import random
from collections.abc import Sequence

from server.scheduler import Policy
from server.shared.profiles import EngineProfile

from .mix import Traces, _Gen
from .simulator import gps_tau_s, run_comparison
from .workload import AgentSpec


def starvation_workload(flood_s: float, profile: EngineProfile, kv_tokens: int, load: float, seed: int = 0,
                        traces: Traces | None = None) -> list[AgentSpec]:
    """A large MapReduce agent at t=1 s; small agents (Poisson) offering `load` of the
    engine's rate from t=0 to t=flood_s. Same seed, longer flood: the same prefix."""
    traces = traces or Traces.load()
    rng = random.Random(seed)
    gen = _Gen(traces, rng, profile.length_scale, profile.max_model_len)
    large = AgentSpec("large", "mapreduce_summary", 1.0, gen.mapreduce_summary("large"), extra={"size": "large"})
    kinds = ("equation_verification", "kqa_verification", "self_consistency", "code_checking")
    pool = [gen.__getattribute__(rng.choice(kinds))("small") for _ in range(400)]
    reqs = [(p, d) for st in (s for stages in pool for s in stages) for p, d in st]
    rate = kv_tokens / profile.effective_tau_s(kv_tokens, reqs)
    mean_cost = sum(AgentSpec("x", "x", 0, s).kv_cost for s in pool) / len(pool)
    lam = load * rate / mean_cost  # small agents per second
    agents, t, i = [large], 0.0, 0
    while True:
        t += rng.expovariate(lam)
        if t > flood_s:
            break
        agents.append(AgentSpec(f"s{i}", "small", t, pool[i % len(pool)]))
        i += 1
    return agents


def run_starvation(minutes: list[float], policies: Sequence[str | Policy], profile: EngineProfile,
                   kv_tokens: int | None, load: float, seed: int = 0) -> list[dict]:
    m = int(kv_tokens or profile.kv_tokens)
    traces = Traces.load()
    rows = []
    for mins in minutes:
        agents = starvation_workload(mins * 60.0, profile, m, load, seed, traces)
        for res in run_comparison(agents, policies, profile, m, seed=seed):
            large = next(a for a in res.agents if a.id == "large")
            small = [a.jct_s for a in res.agents if a.id != "large"]
            rows.append({
                "flood_minutes": mins,
                "policy": res.policy,
                "small_agents": len(small),
                "large_jct_s": large.jct_s,
                "large_finish_s": large.finish_s,
                "large_gps_finish_s": large.gps_finish_s,
                "large_delay_bound_s": large.delay_bound_s,
                "within_bound": large.finish_s <= large.gps_finish_s + large.delay_bound_s + 1e-6,
                "small_mean_jct_s": sum(small) / max(1, len(small)),
                "gps_tau_s": gps_tau_s(profile, m, agents),
            })
    return rows
