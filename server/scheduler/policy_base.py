"""The policy protocol: an ordering key and an admission rule, and the hooks through which a
stateful policy hears what happens to requests. policies.py has the policies themselves."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .cost import KV
from .queues import AgentHeapQueue, RequestQueue
from .state import AgentState, RequestState, SchedulerContext, SortKey


class AdmissionMode(enum.StrEnum):
    """How a policy admits: against reserved footprints (p + expected d against M, in
    strict order, so that the engine need not preempt) or as vLLM does natively (while the
    prompt fits in free memory, leaving preemption to the engine). Its value is the name
    results and snapshots carry."""

    FOOTPRINT = "footprint"
    PROMPT = "prompt"
    # Everything is handed to the engine at once and queues there (the engine's own order):
    # what serving without a scheduler in front does. Only the live server has such an engine
    # queue; the simulator does not run this admission.
    ENGINE = "engine"


FOOTPRINT = AdmissionMode.FOOTPRINT
PROMPT = AdmissionMode.PROMPT
ENGINE = AdmissionMode.ENGINE


@dataclass(frozen=True)
class Policy:
    """An ordering key and an admission rule."""

    name: str
    admission: AdmissionMode = FOOTPRINT
    cost_model: str = KV  # cost units of the virtual clock and of consumed_cost
    prefix_aware: bool = True  # shared prefixes counted once in admission and KV charges
    # keeps paused agents' contexts as `--retain` says (retention.py); False: never. Only
    # policies with a fair order to yield in (Justitia's tags) keep contexts.
    retains: bool = False

    def request_order(self, req: RequestState) -> SortKey:
        """Order of an agent's own pending requests (default: arrival)."""
        return (req.seq,)

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        """Key of an agent whose first pending request is `head`; smallest runs first."""
        raise NotImplementedError

    def static_key(self, agent: AgentState) -> Any:
        """A key for ETA projections (agents with or without pending requests): a total
        order, ending in the agent's `seq`, so that the pass and the slow path place ties alike."""
        return agent.seq

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        """An int rank for vLLM's priority scheduling (lower runs first)."""
        return 0

    def arrival_gap(self, agent: AgentState, v: float, closing: float = 0.0) -> float:
        """ETA allowance: a new agent whose cost is below this is served before `agent`
        (default, fair-share policies: one with less work than `agent` has left).
        `closing`: how far the virtual time V advances while the arrivals counted go on
        (policies whose gap is measured in V close it by as much)."""
        return max(0.0, agent.charged_cost - agent.consumed_cost)

    # -- state and feedback (stateful policies only) -------------------------------------
    # A policy that learns or keeps counters needs to hear what happens to requests; these
    # hooks are how the dispatcher tells it. All take `now` from the caller (no clock here).
    hooked = False  # the dispatcher calls the hooks below only when this is True

    def bind(self, seed: int = 0) -> Policy:
        """The instance one dispatcher uses: stateless policies are shared; stateful ones
        return a fresh copy, seeded, so that runs are reproducible and never share state."""
        return self

    def make_queue(self, ctx: SchedulerContext, backfill_depth: int) -> RequestQueue:
        """The queue the dispatcher admits from (called once, on the bound instance):
        agents ordered by `agent_key`, looking past at most `backfill_depth` blocked ones."""
        return AgentHeapQueue(self.agent_key, backfill_depth)

    def on_submit(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, now: float,
                  first: bool) -> None:
        """A request was queued (before its agent is re-keyed); `first`: its agent had
        nothing pending before."""

    def on_admit(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, now: float) -> None:
        """The request was admitted into the engine (called before its agent is re-keyed)."""

    def on_finish(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, prompt_tokens: int,
                  output_tokens: int, now: float) -> None:
        """An admitted request finished with its true lengths (before its agent is re-keyed)."""

    def on_drop(self, ctx: SchedulerContext, agent: AgentState, req: RequestState) -> None:
        """The request is forgotten without finishing: cancelled, or rejected before admission
        (its status is still RUNNING or PENDING)."""

    def is_idle(self) -> bool:
        """True when the policy's own bookkeeping is back to zero (nothing queued or charged)."""
        return True

    def describe(self) -> dict[str, Any]:
        """Plain-data state worth reporting after a run (learned parameters, ...)."""
        return {}
