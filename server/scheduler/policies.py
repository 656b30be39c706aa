"""Scheduling policies: one ordering key each, over one shared dispatcher.

The dispatcher keeps, for every agent, a small heap of its pending requests, and one heap of
agents ordered by `agent_key(agent, head)`, where `head` is the agent's first pending request
in `request_order`. The request admitted next is the head of the agent with the smallest key.
Policies that order single requests (fcfs, sjf) fold the request into the agent key, so the
global order is still exact: every agent's head is its own minimum, and the minimum of the
minima is the global minimum.

| policy     | key                                          | admission          |
|------------|----------------------------------------------|--------------------|
| fcfs       | request arrival (vLLM's default)             | prompt fits, engine preempts |
| sjf        | predicted request cost                       | prompt fits, engine preempts |
| vtc        | per-agent service counter (p + 2d), lifted   | prompt fits, engine preempts |
| parrot     | agent arrival (agent-level FCFS)             | footprint, non-preemptive    |
| srjf       | predicted remaining agent cost               | footprint, non-preemptive    |
| justitia   | virtual finish tag, KV token-time            | footprint, non-preemptive    |
| justitia-c | virtual finish tag, compute tokens (p + 2d)  | footprint, non-preemptive    |

"Footprint" admission reserves p + expected d (bounded by max_tokens) against M and admits
in strict key order, so the engine never has to preempt when the estimate is right. "Prompt
fits" is what vLLM does natively: admit when the prompt fits in free memory now; requests
grow afterwards and the engine preempts (recompute) when memory runs out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cost import COMPUTE, KV

if TYPE_CHECKING:  # pragma: no cover
    from .dispatcher import AgentState, RequestState

FOOTPRINT = "footprint"
PROMPT = "prompt"


@dataclass(frozen=True)
class Policy:
    """An ordering key and an admission rule."""

    name: str
    admission: str = FOOTPRINT
    cost_model: str = KV  # cost units of the virtual clock and of consumed_cost
    description: str = ""

    @property
    def preemptive(self) -> bool:
        """True when the engine is expected to preempt (vLLM's native admission)."""
        return self.admission == PROMPT

    def request_order(self, req: "RequestState") -> tuple:
        """Order of an agent's own pending requests (default: arrival)."""
        return (req.seq,)

    def agent_key(self, agent: "AgentState", head: "RequestState") -> tuple:
        """Key of an agent whose first pending request is `head`; smallest runs first."""
        raise NotImplementedError

    def static_key(self, agent: "AgentState") -> Any:
        """A key for ETA projections (agents with or without pending requests)."""
        return agent.seq

    def priority(self, agent: "AgentState", req: "RequestState | None") -> int:
        """An int rank for vLLM's priority scheduling (lower runs first)."""
        return 0


class FCFS(Policy):
    def agent_key(self, agent, head):
        return (head.seq,)

    def static_key(self, agent):
        return agent.seq


class SJF(Policy):
    def request_order(self, req):
        return (req.est_cost, req.seq)

    def agent_key(self, agent, head):
        return (head.est_cost, head.seq)

    def static_key(self, agent):
        return agent.predicted_cost

    def priority(self, agent, req):
        return int(req.est_cost) if req is not None else int(agent.predicted_cost)


class Parrot(Policy):
    def agent_key(self, agent, head):
        return (agent.seq, head.seq)

    def priority(self, agent, req):
        return agent.seq


class SRJF(Policy):
    def agent_key(self, agent, head):
        return (agent.remaining_predicted, agent.seq, head.seq)

    def static_key(self, agent):
        return (agent.remaining_predicted, agent.seq)

    def priority(self, agent, req):
        return int(agent.remaining_predicted)


class VTC(Policy):
    def agent_key(self, agent, head):
        return (agent.vtc_counter, agent.seq, head.seq)

    def static_key(self, agent):
        return (agent.vtc_counter, agent.seq)

    def priority(self, agent, req):
        return int(agent.vtc_counter)


class Justitia(Policy):
    def agent_key(self, agent, head):
        return (agent.virtual_finish, agent.seq, head.seq)

    def static_key(self, agent):
        return (agent.virtual_finish, agent.seq)

    def priority(self, agent, req):
        # vLLM needs an int; flooring a tag keeps the order (ties fall back to arrival).
        return int(agent.virtual_finish)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        FCFS("fcfs", PROMPT, KV, "request arrival order (vLLM default)"),
        SJF("sjf", PROMPT, KV, "shortest predicted request first"),
        VTC("vtc", PROMPT, KV, "virtual token counter: instantaneous fair share"),
        Parrot("parrot", FOOTPRINT, KV, "agent-level FCFS"),
        SRJF("srjf", FOOTPRINT, KV, "shortest predicted remaining agent cost first"),
        Justitia("justitia", FOOTPRINT, KV, "GPS virtual finish tags, KV token-time"),
        Justitia("justitia-c", FOOTPRINT, COMPUTE, "GPS virtual finish tags, compute tokens"),
    )
}
POLICY_NAMES = tuple(POLICIES)


def get_policy(name: str) -> Policy:
    """The policy called `name` (see POLICY_NAMES)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}") from None
