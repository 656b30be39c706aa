"""The paper's agent mix, built from real public traces (numbers only, see data/README.md).

Nine agent types, each a template of stages of parallel requests whose prompt and output
lengths are drawn from a real trace that fits the task:

| type | stages | lengths from |
|---|---|---|
| mapreduce_summary | n map calls over chunks, then 1 reduce over their outputs | arXiv summarization |
| doc_merge | n merges, n scores (short), 1 final merge (Graph-of-Thoughts) | arXiv (inputs), ShareGPT (outputs) |
| code_checking | n parallel checks, 1 summary | MetaGPT usage (ParrotServe) |
| kqa_verification | 1 answer, n verification questions, 1 revision | ShareGPT |
| equation_verification | n parallel short checks | ShareGPT (short) |
| fact_verification | n claims checked against long retrieved context | Mooncake |
| self_consistency | n samples of one prompt, 1 vote | ShareGPT |
| alfworld | S sequential single steps with a growing context | ShareGPT |
| tool_chat | a few sequential turns with long context | Mooncake |

Sizes: 72% small, 26% medium, 2% large; the size sets the fan-out n (2-4 / 8-16 / 32-64) or
the number of sequential steps. Arrivals are consecutive Mooncake conversation arrivals
(gaps in ms); the gaps are scaled so that density 1x loads the engine profile to
`load_1x` of what it sustains on this mix (R = M / tau, see EngineProfile.effective_tau_s),
then divided by 2 or 3 for the 2x and 3x densities.

With `prefixes=True` the requests also name the prompt prefixes their sources really share
(`share_prefixes`, DESIGN section 8 additions): an app system prompt per agent type (tool
definitions, the ReAct few-shot prompt, task instructions), then what an agent's own calls
share: the instructions of its map calls, the code or document its checks read, the one
prompt of its self-consistency samples, a ReAct agent's growing context. Lengths, arrivals
and the random draws are those of the same seed without prefixes (the prefix choices use a
random stream of their own), so the two files differ only in `prefix`.
"""

from __future__ import annotations

import csv
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from server.shared.profiles import EngineProfile

from .workload import AgentSpec

DATA = Path(__file__).parent / "data"
AGENT_TYPES = (
    "mapreduce_summary",
    "doc_merge",
    "code_checking",
    "kqa_verification",
    "equation_verification",
    "fact_verification",
    "self_consistency",
    "alfworld",
    "tool_chat",
)
SIZES = (("small", 0.72), ("medium", 0.26), ("large", 0.02))
FAN_OUT = {"small": (2, 4), "medium": (8, 16), "large": (32, 64)}
STEPS = {"small": (3, 6), "medium": (10, 16), "large": (30, 40)}


def _pairs(name: str, a: str, b: str) -> list[tuple[int, int]]:
    with open(DATA / name, newline="", encoding="utf-8") as fh:
        return [(int(r[a]), int(r[b])) for r in csv.DictReader(fh)]


@dataclass
class Traces:
    sharegpt: list[tuple[int, int]]
    arxiv: list[tuple[int, int]]
    mooncake: list[tuple[int, int]]
    metagpt: list[tuple[int, int]]
    arrivals_ms: list[int]

    @classmethod
    def load(cls) -> Traces:
        moon = []
        with open(DATA / "mooncake_conversation.csv", newline="", encoding="utf-8") as fh:
            moon = [(int(r["timestamp_ms"]), int(r["input_length"]), int(r["output_length"]))
                    for r in csv.DictReader(fh)]
        return cls(
            sharegpt=_pairs("sharegpt_lengths.csv", "num_prefill_tokens", "num_decode_tokens"),
            arxiv=_pairs("arxiv_summarization_lengths.csv", "num_prefill_tokens", "num_decode_tokens"),
            mooncake=[(i, o) for _, i, o in moon],
            metagpt=_pairs("metagpt_usage.csv", "prompt_tokens", "completion_tokens"),
            arrivals_ms=sorted(t for t, _, _ in moon),
        )


class _Gen:
    """Draws requests for one workload; lengths scaled and clipped to the profile."""

    def __init__(self, traces: Traces, rng: random.Random, scale: float, max_len: int) -> None:
        self.t, self.rng, self.scale, self.max_len = traces, rng, scale, max_len
        self.output_scale = 1.0  # of the agent type being drawn (make_mix's output_scale)

    def fit(self, p: float, d: float) -> tuple[int, int]:
        d = max(1, min(int(round(d * self.scale * self.output_scale)), self.max_len // 2))
        p = max(1, min(int(round(p * self.scale)), self.max_len - d))
        return p, d

    def draw(self, trace: list[tuple[int, int]]) -> tuple[int, int]:
        return self.rng.choice(trace)

    def n(self, size: str, table=FAN_OUT) -> int:
        lo, hi = table[size]
        return self.rng.randint(lo, hi)

    # -- agent templates (lengths before scaling) ---------------------------------------
    def mapreduce_summary(self, size):
        maps = [self.draw(self.t.arxiv) for _ in range(self.n(size))]
        maps = [(min(p, 3000), d) for p, d in maps]
        rp, rd = self.draw(self.t.arxiv)
        reduce_p = 150 + sum(d for _, d in maps)
        return [[self.fit(p, d) for p, d in maps], [self.fit(reduce_p, rd)]]

    def doc_merge(self, size):
        n = self.n(size)
        merges = [(self.draw(self.t.arxiv)[0], self.draw(self.t.sharegpt)[1]) for _ in range(n)]
        scores = [(200 + d, max(8, self.draw(self.t.sharegpt)[1] // 10)) for _, d in merges]
        best = sorted(d for _, d in merges)[-2:]
        return [
            [self.fit(p, d) for p, d in merges],
            [self.fit(p, d) for p, d in scores],
            [self.fit(200 + sum(best), self.draw(self.t.sharegpt)[1])],
        ]

    def code_checking(self, size):
        checks = [self.draw(self.t.metagpt) for _ in range(self.n(size))]
        jitter = [(p * self.rng.uniform(0.8, 1.2), d * self.rng.uniform(0.8, 1.2)) for p, d in checks]
        summary_p = 100 + sum(min(d, 400) for _, d in jitter) // 2
        return [[self.fit(p, d) for p, d in jitter], [self.fit(summary_p, self.draw(self.t.metagpt)[1] / 2)]]

    def kqa_verification(self, size):
        ap, ad = self.draw(self.t.sharegpt)
        qs = [(ad + self.draw(self.t.sharegpt)[0] // 4, max(8, self.draw(self.t.sharegpt)[1] // 4))
              for _ in range(self.n(size))]
        final_p = ap + ad + sum(d for _, d in qs)
        return [[self.fit(ap, ad)], [self.fit(p, d) for p, d in qs], [self.fit(final_p, ad)]]

    def equation_verification(self, size):
        reqs = [self.draw(self.t.sharegpt) for _ in range(self.n(size))]
        return [[self.fit(min(p, 512), max(8, min(d, 1024) // 4)) for p, d in reqs]]

    def fact_verification(self, size):
        reqs = [self.draw(self.t.mooncake) for _ in range(self.n(size))]
        return [[self.fit(p, max(8, d // 4)) for p, d in reqs]]

    def self_consistency(self, size):
        p = self.draw(self.t.sharegpt)[0]
        samples = [self.draw(self.t.sharegpt)[1] for _ in range(self.n(size))]
        return [[self.fit(p, d) for d in samples], [self.fit(p + sum(min(d, 200) for d in samples), 16)]]

    def alfworld(self, size):
        p0 = self.draw(self.t.sharegpt)[0]
        stages, ctx = [], p0
        for _ in range(self.n(size, STEPS)):
            d = max(8, self.draw(self.t.sharegpt)[1] // 8)
            stages.append([self.fit(ctx, d)])
            ctx += d + self.rng.randint(40, 160)  # the environment's observation
        return stages

    def tool_chat(self, size):
        turns = {"small": 2, "medium": 4, "large": 8}[size]
        return [[self.fit(*self.draw(self.t.mooncake))] for _ in range(turns)]


# App system prompts (trace tokens, before length scaling): what every agent of a type sends
# first. ReAct's few-shot prompt and a tool-using chat's tool definitions are the long ones.
SYSTEM_PROMPT = {
    "mapreduce_summary": 300, "doc_merge": 250, "code_checking": 400, "kqa_verification": 200,
    "equation_verification": 150, "fact_verification": 300, "self_consistency": 150,
    "alfworld": 1200, "tool_chat": 600,
}
# What one agent's parallel calls share after the system prompt (fraction of the shortest
# prompt of the stage): map/merge/score instructions, the code every check reads, the
# retrieved document every claim is checked against, the answer every question verifies.
AGENT_SHARED = {
    "mapreduce_summary": 0.15, "doc_merge": 0.15, "code_checking": 0.55, "kqa_verification": 0.8,
    "equation_verification": 0.3, "fact_verification": 0.5,
}
GROWING = ("alfworld", "tool_chat")  # each step resends the context of the step before


def share_prefixes(agent: AgentSpec, scale: float, rng: random.Random) -> None:
    """Set `agent.prefixes` to what its source shares (see the module docstring)."""
    kind, aid = agent.type, agent.id
    # One system prompt per type (an agent whose prompts are short holds a shorter head of
    # it: a longer prefix of an id extends a shorter one), the same in all of an agent's
    # calls, so that every id starts at the same token wherever it appears.
    shortest = min(p for st in agent.stages for p, _ in st)
    system = min(round(SYSTEM_PROMPT.get(kind, 0) * scale), shortest // 2)
    for s, st in enumerate(agent.stages):
        low = min(p for p, _ in st)
        for i, (p, _) in enumerate(st):
            chain: list[tuple[str, int]] = [(f"sys/{kind}", system)] if system > 0 else []
            if kind in GROWING:
                own = (f"{aid}/ctx", p)  # the whole context, which the next step extends
            elif kind == "self_consistency":
                own = (f"{aid}/q", min(p, st[0][0] if s == 0 else agent.stages[0][0][0]))
            elif len(st) > 1 and kind in AGENT_SHARED:
                own = (f"{aid}/s{s}", system + round((low - system) * AGENT_SHARED[kind] * rng.uniform(0.8, 1.2)))
            else:
                own = ("", 0)
            if own[0] and own[1] > (chain[-1][1] if chain else 0):
                chain.append(own)
            if chain:
                agent.prefixes[(s, i)] = tuple(chain)


def prefix_share(agents: list[AgentSpec]) -> float:
    """Share of prompt tokens a prefix cache can serve: tokens of a named prefix another
    request computed first (each prefix's longest extent counted once as computed)."""
    total = sum(p for a in agents for st in a.stages for p, _ in st)
    named = sum(a.shared_prompt_tokens for a in agents)
    first: dict[str, int] = {}
    for a in agents:
        for chain in a.prefixes.values():
            start = 0
            for key, tokens in chain:
                first[key] = max(first.get(key, 0), tokens - start)
                start = tokens
    return (named - sum(first.values())) / total if total else 0.0


def make_mix(
    n_agents: int,
    profile: EngineProfile,
    *,
    kv_tokens: int | None = None,
    density: float = 1.0,
    load_1x: float = 0.3,
    seed: int = 0,
    length_scale: float | None = None,
    traces: Traces | None = None,
    output_scale: Mapping[str, float] | None = None,
    prefixes: bool = False,
) -> list[AgentSpec]:
    """`n_agents` agents of the nine types with Mooncake arrivals at `density` x.

    `output_scale` multiplies the output lengths of the named agent types (before clipping to
    the profile; prompts are left as drawn). It exists for sensitivity studies
    (benchmarks/cost_model_ablation.py); the paper's mix uses none. `prefixes`: requests
    name the prompt prefixes they share (`share_prefixes`).
    """
    traces = traces or Traces.load()
    rng = random.Random(seed)
    scale = profile.length_scale if length_scale is None else length_scale
    gen = _Gen(traces, rng, scale, profile.max_model_len)
    agents = []
    for i in range(n_agents):
        size = rng.choices([s for s, _ in SIZES], [w for _, w in SIZES])[0]
        kind = rng.choice(AGENT_TYPES)
        gen.output_scale = (output_scale or {}).get(kind, 1.0)
        stages = getattr(gen, kind)(size)
        n_inputs = sum(len(st) for st in stages)
        tokens_in = sum(p for p, _ in stages[0])
        prompt = f"{kind.replace('_', ' ')} agent: {len(stages)} stages, {n_inputs} calls, {tokens_in} input tokens"
        agents.append(AgentSpec(f"a{i}", kind, 0.0, stages, prompt, {"size": size}))
    # Arrivals: consecutive Mooncake arrivals from a seeded offset, gaps rescaled to the load.
    ts = traces.arrivals_ms
    start = rng.randrange(0, max(1, len(ts) - n_agents))
    window = ts[start : start + n_agents]
    gaps = [(b - a) / 1000.0 for a, b in itertools.pairwise(window)] + [0.0]
    gaps = gaps[: n_agents]
    while len(gaps) < n_agents:
        gaps.append(gaps[-1] if gaps else 1.0)
    m = int(kv_tokens or profile.kv_tokens)
    reqs = [(p, d) for a in agents for st in a.stages for p, d in st]
    rate = m / profile.effective_tau_s(m, reqs)
    total_cost = sum(a.kv_cost for a in agents)
    span = sum(gaps[:-1]) or 1.0
    k = total_cost / (rate * load_1x * span)  # stretch so that 1x offers load_1x
    t = 0.0
    for a, g in zip(agents, gaps, strict=True):
        a.arrival = round(t, 6)
        t += g * k / density
    if prefixes:
        share_rng = random.Random(f"prefixes:{seed}")
        for a in agents:
            share_prefixes(a, scale, share_rng)
    return agents
