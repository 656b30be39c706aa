"""Workload files (DESIGN section 8): JSON Lines, one agent per line.

    {"id": "a17", "type": "mapreduce_summary", "arrival": 12.5, "prompt": "...",
     "stages": [[{"p": 812, "d": 120}, {"p": 790, "d": 118}], [{"p": 300, "d": 256}]]}

Stages run one after another, the requests of a stage in parallel. Extra fields are ignored.

An agent may carry `"tenant": "NAME"` (an addition: files without it mean what they meant
before): the simulator then shares the engine among tenants first, then among each tenant's
agents (hierarchical fair share, server/scheduler/tenant_clock.py), and reports GPS finish
times under the same hierarchy.

A request may carry `prefix` (DESIGN section 8, additions): one `{"id", "tokens"}` object or
a list of them, shortest first, each extending the one before, naming the prompt prefixes it
shares with other requests (tokens <= p). They are kept in `AgentSpec.prefixes`, keyed by
(stage, index), as `(id, tokens)` chains (server/scheduler/prefix.py).

A request may carry `"ctx": "<id>"`: its prompt begins with the
whole sequence (prompt and generated output) of the same agent's previous request carrying
that id, as an agent resends its conversation each turn; its `prefix` entry of that id (the
last of its chain) gives the length resent. Kept in `AgentSpec.ctxs`, keyed by (stage, index).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from server.scheduler.cost import compute_cost, kv_cost
from server.scheduler.prefix import PrefixRef, stage_kv_cost

Chain = tuple[PrefixRef, ...]


@dataclass
class AgentSpec:
    id: str
    type: str
    arrival: float
    stages: list[list[tuple[int, int]]]  # [(p, d), ...] per stage
    prompt: str = ""
    extra: dict = field(default_factory=dict)
    prefixes: dict[tuple[int, int], Chain] = field(default_factory=dict)  # (stage, index) -> chain
    tenant: str | None = None  # whose fair share it draws on (hierarchical fair share)
    # Seconds outside the engine before each stage starts (a tool call, a user's think
    # time): the workload file's `pauses_s`. Empty: no pauses.
    pauses: list[float] = field(default_factory=list)
    # (stage, index) -> the conversation id the request resends and extends (`ctx`)
    ctxs: dict[tuple[int, int], str] = field(default_factory=dict)

    def ctx(self, stage: int, index: int) -> str | None:
        """The conversation request `index` of `stage` resends and extends (None: none)."""
        return self.ctxs.get((stage, index))

    def pause_before(self, stage: int) -> float:
        return self.pauses[stage] if stage < len(self.pauses) else 0.0

    def prefix(self, stage: int, index: int) -> Chain:
        """The prefix chain of request `index` of `stage` (empty: nothing shared)."""
        return self.prefixes.get((stage, index), ())

    @property
    def kv_cost(self) -> float:
        """KV token-time with every prompt token private (prefix-blind)."""
        return sum(kv_cost(p, d) for st in self.stages for p, d in st)

    @property
    def kv_cost_shared(self) -> float:
        """KV token-time with the prefixes a stage's requests share charged once (what a
        prefix-aware dispatcher charges this agent; equal to kv_cost without prefixes)."""
        if not self.prefixes:
            return self.kv_cost
        return sum(stage_kv_cost([(p, d, self.prefix(s, i)) for i, (p, d) in enumerate(st)])
                   for s, st in enumerate(self.stages))

    @property
    def shared_prompt_tokens(self) -> int:
        """Prompt tokens that are part of a named shared prefix."""
        return sum(chain[-1][1] for chain in self.prefixes.values() if chain)

    @property
    def compute_cost(self) -> float:
        return sum(compute_cost(p, d) for st in self.stages for p, d in st)

    @property
    def critical_path_tokens(self) -> int:
        return sum(max(d for _, d in st) for st in self.stages if st)

    @property
    def first_request_tokens(self) -> int:
        """The memory its first stage's largest request reserves (prompt and output)."""
        return max((p + d for p, d in self.stages[0]), default=0) if self.stages else 0

    @property
    def stage_request_tokens(self) -> tuple[int, ...]:
        """The memory each stage's largest request reserves (prompt and output)."""
        return tuple(max((p + d for p, d in st), default=0) for st in self.stages)

    @property
    def prefill_tokens(self) -> int:
        """The prompt tokens its requests compute, in submission order: a request's prompt
        minus the longest of its named prefixes that an earlier request of the agent (or a
        sibling listed before it) already named, which the prefix cache then serves. Prefixes
        other agents computed are not counted as cached: that depends on the traffic."""
        return sum(self.computed_prompts())

    @property
    def prefill_square_tokens(self) -> int:
        """The sum of the squares of the prompt tokens its requests compute: how far its
        prompts run past an engine's step budget (`AgentShape.prefill_square_tokens`)."""
        return sum(p * p for p in self.computed_prompts())

    def computed_prompts(self) -> list[int]:
        """Each request's prompt tokens computed, in submission order (`prefill_tokens`)."""
        seen: set[str] = set()
        computed = []
        for s, st in enumerate(self.stages):
            for i, (p, _) in enumerate(st):
                chain = self.prefix(s, i)
                cached = max((tokens for pid, tokens in chain if pid in seen), default=0)
                seen.update(pid for pid, _ in chain)
                computed.append(p - cached)
        return computed

    @property
    def num_requests(self) -> int:
        return sum(len(st) for st in self.stages)

    def to_json(self) -> dict:
        out = {"id": self.id, "type": self.type, "arrival": round(self.arrival, 6)}
        if self.prompt:
            out["prompt"] = self.prompt
        out["stages"] = [[self._request_json(s, i, p, d) for i, (p, d) in enumerate(st)]
                         for s, st in enumerate(self.stages)]
        if self.tenant is not None:
            out["tenant"] = self.tenant
        if self.pauses:
            out["pauses_s"] = list(self.pauses)
        out.update(self.extra)
        return out

    def _request_json(self, stage: int, index: int, p: int, d: int) -> dict:
        r: dict = {"p": p, "d": d}
        chain = self.prefix(stage, index)
        if len(chain) == 1:
            r["prefix"] = {"id": chain[0][0], "tokens": chain[0][1]}
        elif chain:
            r["prefix"] = [{"id": k, "tokens": t} for k, t in chain]
        if (ctx := self.ctx(stage, index)) is not None:
            r["ctx"] = ctx
        return r


class WorkloadError(ValueError):
    """A workload file that does not follow DESIGN section 8."""


def parse_prefix(raw: object, p: int, where: str) -> Chain:
    """A request's `prefix`: one {"id", "tokens"} object or a list of them, shortest first,
    each extending the one before, the longest within the prompt."""
    items = raw if isinstance(raw, list) else [raw]
    chain: list[PrefixRef] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not item["id"] \
                or isinstance(item.get("tokens"), bool) or not isinstance(item.get("tokens"), int):
            raise WorkloadError(f'{where}: prefix must be {{"id": non-empty string, "tokens": integer}} '
                                f"or a list of them, got {json.dumps(item)[:80]}")
        key, tokens = item["id"], item["tokens"]
        if tokens < 1 or tokens > p:
            raise WorkloadError(f"{where}: prefix {key!r} has {tokens} tokens; need 1 <= tokens <= p = {p}")
        if chain and tokens <= chain[-1][1]:
            raise WorkloadError(f"{where}: prefix list must be shortest first, each longer than the one "
                                f"before ({key!r}: {tokens} after {chain[-1][1]})")
        chain.append((key, tokens))
    return tuple(chain)


def _parse_ctx(raw: object, chain: Chain, previous: tuple[int, int] | None, where: str) -> str:
    """A request's `ctx`: a non-empty id; a `prefix` entry of that id must be the last of the
    chain (the conversation extends everything before it) and no longer than the whole
    sequence of the previous request of that id."""
    if not isinstance(raw, str) or not raw:
        raise WorkloadError(f'{where}: ctx must be a non-empty string, got {json.dumps(raw)[:80]}')
    ids = [key for key, _ in chain]
    if raw in ids[:-1]:
        raise WorkloadError(f"{where}: the prefix entry of ctx {raw!r} must be the last of the chain")
    if raw in ids and previous is not None and chain[-1][1] > previous[0] + previous[1]:
        raise WorkloadError(f"{where}: ctx {raw!r} resends {chain[-1][1]} tokens, more than the "
                            f"{previous[0] + previous[1]} of its previous request (p + d)")
    return raw


Stages = list[list[tuple[int, int]]]


def _parse_stages(obj: dict, where: str) -> tuple[Stages, dict[tuple[int, int], Chain], dict[tuple[int, int], str]]:
    stages: Stages = []
    prefixes: dict[tuple[int, int], Chain] = {}
    ctxs: dict[tuple[int, int], str] = {}
    last: dict[str, tuple[int, int]] = {}  # ctx id -> (p, d) of its latest request
    for st in obj["stages"]:
        reqs = [(int(r["p"]), int(r["d"])) for r in st]
        if not reqs:
            continue  # an empty stage is skipped (as before prefixes existed)
        for i, r in enumerate(st):
            here = f"{where}: stage {len(stages)}, request {i}"
            chain: Chain = ()
            if r.get("prefix") is not None:
                chain = parse_prefix(r["prefix"], reqs[i][0], here)
                if chain:
                    prefixes[(len(stages), i)] = chain
            if r.get("ctx") is not None:
                ctx = _parse_ctx(r["ctx"], chain, last.get(r["ctx"]), here)
                ctxs[(len(stages), i)] = ctx
        for (s, i), ctx in ctxs.items():
            if s == len(stages):
                last[ctx] = reqs[i]
        stages.append(reqs)
    return stages, prefixes, ctxs


def _parse_pauses(raw: object, stages: int, where: str) -> list[float]:
    """`pauses_s`: one number of seconds >= 0 per stage."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) != stages or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf") for x in raw):
        raise WorkloadError(f"{where}: pauses_s must be a list of {stages} numbers of seconds >= 0, "
                            "one per stage")
    return [float(x) for x in raw]


def parse_agent(obj: dict, where: str = "") -> AgentSpec:
    try:
        stages, prefixes, ctxs = _parse_stages(obj, where)
        agent = AgentSpec(
            id=str(obj["id"]),
            type=str(obj.get("type", "unknown")),
            arrival=float(obj["arrival"]),
            stages=stages,
            prompt=str(obj.get("prompt") or ""),
            prefixes=prefixes,
            tenant=None if obj.get("tenant") is None else str(obj["tenant"]),
            pauses=_parse_pauses(obj.get("pauses_s"), len(stages), where),
            ctxs=ctxs,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, WorkloadError):
            raise
        raise WorkloadError(f"{where}: expected id, arrival and stages of {{p, d}} ({exc})") from None
    for st in agent.stages:
        for p, d in st:
            if p < 0 or d < 1:
                raise WorkloadError(f"{where}: agent {agent.id}: need p >= 0 and d >= 1")
    if agent.arrival < 0:
        raise WorkloadError(f"{where}: agent {agent.id}: negative arrival")
    return agent


def load_workload(path: str | Path) -> list[AgentSpec]:
    """Read a workload file; agents come back sorted by arrival (stable)."""
    agents = []
    seen = set()
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{n}: not JSON ({exc.msg})") from None
            agent = parse_agent(obj, f"{path}:{n}")
            if agent.id in seen:
                raise WorkloadError(f"{path}:{n}: duplicate agent id {agent.id!r}")
            seen.add(agent.id)
            agents.append(agent)
    agents.sort(key=lambda a: a.arrival)
    return agents


def save_workload(agents: list[AgentSpec], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for a in agents:
            fh.write(json.dumps(a.to_json()) + "\n")
