"""The typical shape of each agent type, learned from the agents the server has served.

An agent's delay bound and ETA cover its own critical path: its stages run one after
another, each as long as its longest decode. An agent that declares no shape
(`metadata.stages`, `critical_path_tokens`) would otherwise be bounded as one stage whose
longest decode is d_max, which a three-stage agent outruns: its promise would break by its
own structure. The server sees every request of a finished agent (when it was
submitted, when it finished, how many tokens it generated), so it can tell its stages
apart: a request submitted after every earlier request of the agent had finished starts a
new stage. Per (tenant, type) it keeps the last `window` finished agents' shapes and
offers the p90 of their stage counts and critical paths to new agents of the type that
declare none: a pessimistic shape, as promises need. Their ETAs expect the median: an ETA is
an estimate, and the p90 of three agents is the longest of them. Shapes are kept per tenant: what one
tenant's agents did never shapes another tenant's promises. A shape also carries the prompt
tokens the agent's requests computed (not served by the prefix cache): their prefill lies on
its path, and ETAs count it (`AgentShape.prefill_tokens`, and the squares of its prompts,
`prefill_square_tokens`: past the engine's step budget a prompt costs more than its tokens'
linear prefill); and the memory each stage's largest request held (prompt and output): an
agent waits for its first stage's to be free before it starts, and ETAs count the wait
(`AgentShape.first_request_tokens`); the agents ordered after it wait for its later
stages' (`AgentShape.stage_request_tokens`, stage by stage: the quantile of the agents
that reached the stage).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

from server.runtime.agent_listeners import AgentListener
from server.runtime.agents import AgentEntry, RequestLog
from server.scheduler import AgentShape

MIN_AGENTS = 3  # below this, one odd agent would speak for the type
QUANTILE = 0.9  # a promise's shape: pessimistic
ETA_QUANTILE = 0.5  # an ETA's: the typical agent of the type


def infer_shape(requests: Sequence[RequestLog]) -> AgentShape | None:
    """The stages of a finished agent, from its requests' submission and finish times: a
    request submitted once all earlier ones had finished starts a new stage (a stage's
    requests run in parallel, stages one after another), the prompt tokens they computed
    (those the prefix cache did not serve, where the engine reported it), and the largest
    request of each stage (prompt and output). None without requests."""
    if not requests:
        return None
    critical = 0
    longest = 0
    largest: list[int] = []  # per stage
    busy_until = -math.inf
    for r in sorted(requests, key=lambda r: r.submitted_s):
        if r.submitted_s >= busy_until:  # nothing of the agent was running: a new stage
            critical += longest
            largest.append(0)
            longest = 0
        longest = max(longest, r.output_tokens)
        largest[-1] = max(largest[-1], r.prompt_tokens + r.output_tokens)
        busy_until = max(busy_until, r.finished_s)
    computed = [r.prompt_tokens - min(r.prompt_tokens, r.cached_tokens or 0) for r in requests]
    return AgentShape(stages=len(largest), critical_path_tokens=critical + longest, prefill_tokens=sum(computed),
                      first_request_tokens=largest[0], prefill_square_tokens=sum(p * p for p in computed),
                      stage_request_tokens=tuple(largest))


def _quantile(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]


def _per_stage(sizes: list[tuple[int, ...]], stages: int, q: float) -> tuple[int, ...] | None:
    """Stage by stage, the q-quantile of the sizes of the agents that reached the stage (a
    quantile of the stage counts seen: some agent reached each of the `stages`)."""
    out = tuple(_quantile(reached, q) for k in range(stages) if (reached := [s[k] for s in sizes if len(s) > k]))
    return out if len(out) == stages else None


class TypeShapes(AgentListener):
    """Per (tenant, type): the shapes of the last `window` finished agents."""

    def __init__(self, window: int = 50) -> None:
        self.window = window
        self._shapes: dict[tuple[str, str], collections.deque[AgentShape]] = {}

    def on_agent_ended(self, entry: AgentEntry) -> None:
        if entry.state != "finished" or entry.auto:  # a one-request stand-in says nothing of a type
            return
        self.learn(entry.tenant, entry.type, entry.requests)

    def learn(self, tenant: str, agent_type: str, requests: Sequence[RequestLog]) -> bool:
        """Keep the shape of one finished agent of the type (False: it had no requests)."""
        shape = infer_shape(requests)
        if shape is None:
            return False
        self._shapes.setdefault((tenant, agent_type), collections.deque(maxlen=self.window)).append(shape)
        return True

    def typical(self, tenant: str, agent_type: str, quantile: float = QUANTILE) -> AgentShape | None:
        """The shape of a new agent of the type at `quantile` of the stage counts and of the
        critical paths seen (default p90: pessimistic, as promises need; an ETA takes the
        median), or None while fewer than MIN_AGENTS have finished."""
        seen = self._shapes.get((tenant, agent_type))
        if not seen or len(seen) < MIN_AGENTS:
            return None
        stages = _quantile([s.stages for s in seen], quantile)
        return AgentShape(
            stages=stages,
            critical_path_tokens=_quantile([s.critical_path_tokens or 0 for s in seen], quantile),
            prefill_tokens=_quantile([s.prefill_tokens or 0 for s in seen], quantile),
            first_request_tokens=_quantile([s.first_request_tokens or 0 for s in seen], quantile),
            prefill_square_tokens=_quantile([s.prefill_square_tokens or 0 for s in seen], quantile),
            stage_request_tokens=_per_stage([s.stage_request_tokens or () for s in seen], stages, quantile),
        )
