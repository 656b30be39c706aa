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

`make_agentic_mix` is the mix of agents that call tools in a loop (`make-workload --tools
agentic`): a share of the agents (`AGENTIC_SHARE`) are function-calling agents, the rest the
multi-turn mix above. A function-calling agent (type `function_calling`, a ReAct or OpenAI
tool-calling loop) sends its tool definitions (a system prompt every agent of the type
shares) and a task, then per turn writes a thought and a tool call, waits out the tool
(the pause) and resends the whole conversation with the tool's result appended, until it
writes its answer in the last turn. Lengths from ShareGPT (token counts of real chats): the
task is a chat prompt, a turn's output an eighth of a chat answer (a thought and a call, at
least 16 tokens), the answer a chat answer, a tool's result an eighth of a chat prompt (20 to
1000 tokens: a search hit, a file, a command's output). Turns: 3-6, 10-16 or 30-40 by size
(the mix's sizes), fewer when the conversation would outgrow the context length.
"""

from __future__ import annotations

import math
import random

from server.shared.profiles import EngineProfile

from .mix import GROWING, SIZES, STEPS, Traces, make_mix
from .shapes import PAUSE_MEDIAN_S
from .workload import AgentSpec

PAUSE_SIGMA = 1.0
AGENTIC = "function_calling"
AGENTIC_SHARE = 0.5  # of the agentic mix's agents
AGENTIC_SYSTEM = 1200  # tool definitions (trace tokens before length scaling)
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


def _tool_loop(i: int, traces: Traces, rng: random.Random, scale: float, max_len: int) -> AgentSpec:
    """One function-calling agent (see the module docstring): its turns, the conversation each
    turn resends (`ctx`, after the type's tool definitions) and its tool pauses."""
    size = rng.choices([s for s, _ in SIZES], [w for _, w in SIZES])[0]
    turns = rng.randint(*STEPS[size])
    system = round(AGENTIC_SYSTEM * scale)
    ctx = f"a{i}/ctx"
    p = system + max(1, round(min(rng.choice(traces.sharegpt)[0], 1000) * scale))
    stages: list[list[tuple[int, int]]] = []
    prefixes: dict[tuple[int, int], tuple[tuple[str, int], ...]] = {}
    for k in range(turns):
        chat_d = rng.choice(traces.sharegpt)[1]
        d = max(1, round((chat_d if k == turns - 1 else max(16, chat_d // 8)) * scale))
        if k > 0:
            resent = stages[-1][0][0] + stages[-1][0][1]
            result = min(1000, max(20, rng.choice(traces.sharegpt)[0] // 8))
            p = resent + max(1, round(result * scale))
        if p + d > max_len:
            if k == 0:
                p, d = max(system + 1, max_len - d), min(d, max_len - system - 1)
            else:
                break
        chain = ((f"sys/{AGENTIC}", system),) if system > 0 else ()
        prefixes[(k, 0)] = chain + (((ctx, stages[-1][0][0] + stages[-1][0][1]),) if k > 0 else ())
        stages.append([(p, d)])
    pauses = [0.0] + [round(rng.lognormvariate(math.log(PAUSE_MEDIAN_S), PAUSE_SIGMA), 3) for _ in stages[1:]]
    n = len(stages)
    return AgentSpec(f"a{i}", AGENTIC, 0.0, stages, f"function calling agent: {n} turns, {n - 1} tool calls",
                     {"size": size}, prefixes=prefixes, pauses=pauses,
                     ctxs={(k, 0): ctx for k in range(n)})


def make_agentic_mix(n_agents: int, profile: EngineProfile, *, seed: int = 0, load: float = 1.5,
                     kv_tokens: int | None = None, share: float = AGENTIC_SHARE) -> list[AgentSpec]:
    """`n_agents` agents, `share` of them function-calling agents in a tool loop and the rest
    the multi-turn mix of `make_talk_mix` (see the module docstring), arriving at `load`."""
    m = int(kv_tokens or profile.kv_tokens)
    n_loops = round(n_agents * share)
    others = make_talk_mix(n_agents - n_loops, profile, seed=seed, load=load, kv_tokens=m) if n_agents > n_loops else []
    rng = random.Random(f"agentic:{seed}")
    traces = Traces.load()
    loops = [_tool_loop(i, traces, rng, profile.length_scale, profile.max_model_len) for i in range(n_loops)]
    for a in others:  # ids stay unique: the mix's agents after the loops
        old = a.id
        a.id = f"a{n_loops + int(old[1:])}"
        a.prefixes = {k: tuple((f"{a.id}/{c[len(old) + 1:]}" if c.startswith(old + "/") else c, t)
                               for c, t in chain) for k, chain in a.prefixes.items()}
        a.ctxs = {k: f"{a.id}/{c[len(old) + 1:]}" if c.startswith(old + "/") else c for k, c in a.ctxs.items()}
    agents = loops + others
    rng.shuffle(agents)
    _retime(agents, profile, m, load, rng)
    return sorted(agents, key=lambda a: a.arrival)
