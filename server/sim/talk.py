"""The paper's agent mix as agents that call tools and resend their conversations.

`make_talk_mix` takes the mix of `mix.make_mix` (nine types, lengths from public traces,
shared prefixes named) and makes it what tool-using agents send:

* **Tool pauses**: every agent of more than one stage waits out a tool call before each stage
  but the first (`pauses_s`, lognormal with median 0.8 s and sigma 1: most calls are short,
  a few take many seconds).
* **Resent contexts**: the multi-turn types (`alfworld`, a ReAct loop, and `tool_chat`) send
  their whole conversation back each turn (`ctx`): a turn's prompt is the previous turn's
  prompt and output plus what came back from the tool (an observation, a user message), and
  names that resent part as its `prefix` of the conversation's id. A conversation stops at
  the turn that would not fit the profile's context length.

`multi_turn=False` leaves the multi-turn types out (the same number of agents, drawn from a
larger mix), for checking that retention costs nothing where no context is resent. Either way
the arrivals are re-timed so that the work offered is `load` of what the engine sustains
(R = M / tau) over the span of the arrivals, as `shapes.py` does.
"""

from __future__ import annotations

import math
import random

from server.shared.profiles import EngineProfile

from .mix import GROWING, make_mix
from .shapes import PAUSE_MEDIAN_S
from .workload import AgentSpec

PAUSE_SIGMA = 1.0
# What a tool or a user adds to a conversation per turn (trace tokens before length scaling).
TURN_INPUT = (40, 400)


def _conversation(agent: AgentSpec, rng: random.Random, scale: float, max_len: int) -> None:
    """Turn a multi-turn agent's steps into one conversation resent each turn."""
    ctx = f"{agent.id}/ctx"
    system = [c for c in (agent.prefix(0, 0)[:1]) if c[0].startswith("sys/")]
    stages: list[list[tuple[int, int]]] = []
    prefixes: dict[tuple[int, int], tuple[tuple[str, int], ...]] = {}
    p = agent.stages[0][0][0]
    for k, st in enumerate(agent.stages):
        d = st[0][1]
        if k > 0:
            resent = stages[-1][0][0] + stages[-1][0][1]
            p = resent + max(1, round(rng.randint(*TURN_INPUT) * scale))
            if p + d > max_len:
                break
            head = [c for c in system if c[1] < resent]
            prefixes[(k, 0)] = (*head, (ctx, resent))
        elif system:
            prefixes[(0, 0)] = tuple(system)
        stages.append([(p, d)])
    agent.stages = stages
    agent.prefixes = prefixes
    agent.ctxs = {(k, 0): ctx for k in range(len(stages))}


def _retime(agents: list[AgentSpec], profile: EngineProfile, m: int, load: float, rng: random.Random) -> None:
    """Poisson arrivals offering `load` of what the engine sustains on these agents."""
    reqs = [(p, d) for a in agents for st in a.stages for p, d in st]
    rate = m / profile.effective_tau_s(m, reqs)
    span = sum(a.kv_cost for a in agents) / (rate * load)
    t = 0.0
    gaps = [rng.expovariate(1.0) for _ in agents]
    unit = span / max(1e-9, sum(gaps[:-1]) * len(agents) / max(1, len(agents) - 1))
    for a, g in zip(agents, gaps, strict=True):
        a.arrival = round(t, 6)
        t += g * unit


def make_talk_mix(n_agents: int, profile: EngineProfile, *, seed: int = 0, load: float = 1.5,
                  kv_tokens: int | None = None, multi_turn: bool = True) -> list[AgentSpec]:
    """`n_agents` agents of the mix with tool pauses and resent conversations (see above)."""
    m = int(kv_tokens or profile.kv_tokens)
    rng = random.Random(f"talk:{seed}")
    drawn = make_mix(n_agents if multi_turn else 3 * n_agents, profile, kv_tokens=m, seed=seed, prefixes=True)
    agents = drawn if multi_turn else [a for a in drawn if a.type not in GROWING][:n_agents]
    for a in agents:
        if a.type in GROWING:
            _conversation(a, rng, profile.length_scale, profile.max_model_len)
        a.pauses = [0.0] + [round(rng.lognormvariate(math.log(PAUSE_MEDIAN_S), PAUSE_SIGMA), 3)
                            for _ in a.stages[1:]]
    _retime(agents, profile, m, load, rng)
    return sorted(agents, key=lambda a: a.arrival)
