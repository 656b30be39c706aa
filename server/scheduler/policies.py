"""Scheduling policies: one ordering key each, over one shared dispatcher.

For all but ewsjf the dispatcher's queue is an `AgentHeapQueue` (queues.py): every agent keeps
a small heap of its pending requests, and the queue a heap of agents ordered by
`agent_key(agent, head)`, where `head` is the agent's first pending request in
`request_order`. The request admitted next is the head of the agent with the smallest key.
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
| justitia-nocache | virtual finish tag, prefix-blind KV cost | prefix-blind footprint   |
| justitia-noretain | justitia, paused agents' contexts never kept | footprint, non-preemptive |
| ewsjf      | density-weighted score of per-group queues   | prompt fits, engine preempts |
| equinox    | per-agent user + resource fairness counters  | prompt fits, engine preempts |
| las        | decayed attained service p + 2d per agent    | prompt fits, engine preempts |

"Footprint" admission reserves p + expected d (bounded by max_tokens) against M and admits
in strict key order, so the engine never has to preempt when the estimate is right. "Prompt
fits" is what vLLM does natively: admit when the prompt fits in free memory now; requests
grow afterwards and the engine preempts (recompute) when memory runs out.

Shared prompt prefixes (prefix.py) are counted once by every policy's admission (a prefix
that running requests hold takes no memory again: footprint policies reserve it once, prompt
policies see what vLLM's prefix cache sees) and in the KV charges of justitia; the ablation
justitia-nocache (`prefix_aware=False`) reserves and charges every prompt token as private.
justitia-noretain is Justitia that never keeps a paused agent's context (retention.py): the
ablation of retention. Policies other than Justitia's never keep contexts.

Four policies keep state of their own (docs/concepts.md has their sources and assumptions):

- vtc (VTC, Sheng et al., OSDI 2024) keys agents by a service counter: charged the prompt on
  admission and twice the output on finish, and lifted, when an agent becomes backlogged, to
  the counter of the agent served next, so that idle time earns no credit.
- ewsjf (EWSJF, arXiv 2601.21758) orders requests by a score that grows with waiting time, so
  no static heap key exists. Its queue is its own (`make_queue` returns its group queues),
  and it learns from the service times it measures (`on_finish`).
- equinox (Equinox, arXiv 2508.16646) keys agents by two counters that are charged on
  admission with a predicted output length and corrected on finish with the true one.
- las (llm-d-router's program-aware fairness, PR #1534) keys agents by the service they have
  attained, p + 2d charged when a request finishes, decayed with a half-life. The decay is
  kept in log space against time 0 (`LAS` below), so that decay never reorders agents and
  keys stay static between charges.

They keep their data in typed slots of the state (state.py) and, for what spans the whole
dispatcher, in the instance `bind()` makes for one dispatcher; the instances in POLICIES are
configuration only and are shared. The hooks (`on_submit`, `on_admit`, `on_finish`,
`on_drop`) are called by the dispatcher only for policies with `hooked` set, so the other
policies pay nothing for them; they get a `SchedulerContext` (tau, compute_per_kv, leader),
not the dispatcher.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .cost import COMPUTE, KV
from .ewsjf import EwsjfConfig, EwsjfState, ticket_of
from .las import LasScoreQueue, log2_add
from .policy_base import FOOTPRINT as FOOTPRINT  # re-exported: the admission modes and the base
from .policy_base import PROMPT as PROMPT
from .policy_base import Policy as Policy
from .queues import AgentHeapQueue, RequestQueue, TenantQueue
from .state import (
    AgentState,
    Charge,
    FairCounters,
    RequestState,
    RequestStatus,
    SchedulerContext,
    SortKey,
)


class FCFS(Policy):
    """Request arrival order (vLLM's default)."""

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (head.seq,)

    def static_key(self, agent: AgentState) -> Any:
        return agent.seq

    def arrival_gap(self, agent: AgentState, v: float, closing: float = 0.0) -> float:
        return 0.0  # nothing that arrives later goes first


class SJF(Policy):
    """Shortest predicted request first."""

    def request_order(self, req: RequestState) -> SortKey:
        return (req.est_cost, req.seq)

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (head.est_cost, head.seq)

    def static_key(self, agent: AgentState) -> Any:
        return (agent.predicted_cost, agent.seq)  # ties in arrival order, as in the pass

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        return int(req.est_cost) if req is not None else int(agent.predicted_cost)

    def arrival_gap(self, agent: AgentState, v: float, closing: float = 0.0) -> float:
        return agent.predicted_cost


class Parrot(Policy):
    """Agent-level FCFS."""

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (agent.seq, head.seq)

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        return agent.seq

    def arrival_gap(self, agent: AgentState, v: float, closing: float = 0.0) -> float:
        return 0.0


class SRJF(Policy):
    """Shortest predicted remaining agent cost first."""

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (agent.remaining_predicted, agent.seq, head.seq)

    def static_key(self, agent: AgentState) -> Any:
        return (agent.remaining_predicted, agent.seq)

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        return int(agent.remaining_predicted)

    def arrival_gap(self, agent: AgentState, v: float, closing: float = 0.0) -> float:
        return agent.remaining_predicted


class VTC(Policy):
    """Virtual token counter: an instantaneous fair share of the tokens served."""

    hooked = True

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (agent.vtc_counter, agent.seq, head.seq)

    def static_key(self, agent: AgentState) -> Any:
        return (agent.vtc_counter, agent.seq)

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        return int(agent.vtc_counter)

    def on_submit(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, now: float,
                  first: bool) -> None:
        if first:
            # The counter lift: a newly backlogged agent starts no lower than the least-served
            # backlogged agent, so idle time earns no credit.
            leader = ctx.leader()
            if leader is not None and leader is not agent:
                agent.vtc_counter = max(agent.vtc_counter, leader.vtc_counter)

    def on_admit(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, now: float) -> None:
        agent.vtc_counter += req.spec.prompt_tokens

    def on_finish(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, prompt_tokens: int,
                  output_tokens: int, now: float) -> None:
        agent.vtc_counter += 2.0 * output_tokens


def closing_gap(gap: float, closing: float) -> float:
    """The mean, over the arrivals' span, of the gap a newcomer's cost must stay below to go
    ahead of an agent: a newcomer at V(t) goes ahead if V(t) + c < F_j, and V closes the gap
    G = F_j - V by `closing` over the span (linearly: G - V't). Its mean is G - closing / 2
    while V stays below F_j, and G^2 / (2 closing) when V reaches F_j within the span (the
    later arrivals go behind). Not G / 2 whatever the span: a burst's arrivals come early in
    a long wait, when the gap is nearly whole."""
    if gap <= 0.0:
        return 0.0
    if closing <= gap:
        return gap - 0.5 * closing
    return gap * gap / (2.0 * closing)


class Justitia(Policy):
    """GPS virtual finish tags (KV token-time, or compute tokens for justitia-c).

    Tenants first: with agents of several tenants, the queue orders tenants by the
    hierarchical GPS finish of the agent each would serve next (`TenantQueue`), and each
    tenant's agents by their tags in the tenant's own clock (tenant_clock.py)."""

    def make_queue(self, ctx: SchedulerContext, backfill_depth: int) -> RequestQueue:
        return TenantQueue(self.agent_key, ctx.tenant_position, backfill_depth)

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (agent.virtual_finish, agent.seq, head.seq)

    def static_key(self, agent: AgentState) -> Any:
        return (agent.virtual_finish, agent.seq)

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        # vLLM needs an int; flooring a tag keeps the order (ties fall back to arrival).
        return int(agent.virtual_finish)

    def arrival_gap(self, agent: AgentState, v: float, closing: float = 0.0) -> float:
        return closing_gap(agent.virtual_finish - v, closing)


@dataclass(frozen=True)
class EWSJF(Policy):
    """EWSJF: learned request groups, a density-weighted score, tuned online.

    Request-level: per-group FIFO queues, the head of the best-scoring group next."""

    config: EwsjfConfig = field(default_factory=EwsjfConfig)
    state: EwsjfState | None = field(default=None, compare=False, repr=False)

    hooked = True

    def bind(self, seed: int = 0) -> EWSJF:
        return replace(self, state=EwsjfState(self.config, seed))

    @property
    def bound_state(self) -> EwsjfState:
        """The state `bind` made (the shared configuration instance in POLICIES has none)."""
        if self.state is None:
            raise RuntimeError("the ewsjf policy is not bound to a dispatcher: use policy.bind()")
        return self.state

    def make_queue(self, ctx: SchedulerContext, backfill_depth: int) -> RequestQueue:
        return self.bound_state.attach(ctx)  # the group queues; no backfill past the chosen head

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (head.seq,)  # never used: the group queues order requests

    def on_admit(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, now: float) -> None:
        ticket_of(req).admitted_at = now  # service time is measured from here

    def on_finish(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, prompt_tokens: int,
                  output_tokens: int, now: float) -> None:
        self.bound_state.observe(req, now, ctx.tau)

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        # the group index: if the engine must preempt, it preempts the slowest group first
        ticket = req.ticket if req is not None else None
        return int(ticket.group) if ticket is not None and ticket.group is not None else 0

    def is_idle(self) -> bool:
        return self.state is None or self.state.queued == 0

    def describe(self) -> dict[str, Any]:
        return self.state.describe() if self.state is not None else {}


@dataclass
class _Outstanding:
    charges: int = 0  # provisional charges over all agents (back to 0 when idle)


@dataclass(frozen=True)
class Equinox(Policy):
    """Equinox: agent-level fair sharing on a holistic counter (user tokens and KV
    token-time), charged on admission and corrected on finish."""

    alpha: float = 0.5  # weight of the user counter; 1 - alpha weighs the resource counter
    output_weight: float = 2.0  # an output token counts this many input tokens (VTC's w_q/w_p)
    state: _Outstanding | None = field(default=None, compare=False, repr=False)

    hooked = True

    def bind(self, seed: int = 0) -> Equinox:
        return replace(self, state=_Outstanding())

    @property
    def outstanding(self) -> _Outstanding:
        """The state `bind` made (the shared configuration instance in POLICIES has none)."""
        if self.state is None:
            raise RuntimeError("the equinox policy is not bound to a dispatcher: use policy.bind()")
        return self.state

    def _counters(self, agent: AgentState) -> FairCounters:
        if agent.fair is None:
            agent.fair = FairCounters()
        return agent.fair

    def _charge(self, ctx: SchedulerContext, p: int, out: int) -> Charge:
        u = p + self.output_weight * out
        r = p * out + out * (out + 1) // 2  # kv_cost(p, out), inlined: this runs per admission
        # rho converts KV token-time into tokens at the ratio of the requests submitted so far,
        # so that with alpha = 0.5 both counters weigh the same for the average request.
        return Charge(u, r, self.alpha * u + (1.0 - self.alpha) * ctx.compute_per_kv * r)

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (_fair(agent).key, agent.seq, head.seq)

    def static_key(self, agent: AgentState) -> Any:
        return (agent.fair.key if agent.fair is not None else 0.0, agent.seq)

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        return int(agent.fair.key) if agent.fair is not None else 0

    def on_submit(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, now: float,
                  first: bool) -> None:
        c = self._counters(agent)
        if first:
            # VTC's lift: a newly backlogged agent starts no lower than the least-served
            # backlogged one, so that time spent idle earns no credit.
            leader = ctx.leader()
            if leader is not None and leader is not agent and leader.fair is not None:
                c.key = max(c.key, leader.fair.key)

    def on_admit(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, now: float) -> None:
        # Charged before it runs, with the predicted output length (the request's estimate)
        c = _fair(agent)
        charge = self._charge(ctx, req.spec.prompt_tokens, req.spec.expected_tokens)
        c.user += charge.user
        c.resource += charge.resource
        c.key += charge.key
        c.provisional += 1
        req.charge = charge
        self.outstanding.charges += 1

    def on_finish(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, prompt_tokens: int,
                  output_tokens: int, now: float) -> None:
        # ... and corrected when the true length is known: shorter than predicted credits back.
        c = _fair(agent)
        old = req.charge
        if old is None:
            raise RuntimeError(f"equinox: request {req.spec.request_id!r} finished without an admission charge")
        new = self._charge(ctx, prompt_tokens, output_tokens)
        c.user += new.user - old.user
        c.resource += new.resource - old.resource
        c.key += new.key - old.key
        c.provisional -= 1
        req.charge = None
        self.outstanding.charges -= 1

    def on_drop(self, ctx: SchedulerContext, agent: AgentState, req: RequestState) -> None:
        if req.status is RequestStatus.RUNNING and req.charge is not None:
            req.charge = None  # a cancelled request: its charge goes too
            self.outstanding.charges -= 1
            if agent.fair is not None:
                agent.fair.provisional -= 1

    def is_idle(self) -> bool:
        return self.state is None or self.state.charges == 0


@dataclass(frozen=True)
class LAS(Policy):
    """Least attained service per agent, as llm-d's program-aware fairness plugin does.

    An agent's service is sum_i x_i * 2^(-(now - t_i) / h) over its finished requests i
    (x_i = p_i + 2 d_i, charged at the request's finish t_i; h the half-life). Decay
    multiplies every agent's service by the same factor, so the order only changes when a
    request finishes. The key stores log2 of the service scaled to time 0,
    L = log2(sum_i x_i * 2^(t_i / h)): the same order at every `now`, no overflow however long
    the server runs, and -inf for an agent that has attained nothing.

    The next agent is the plugin's: the best 0.8 x (1 - normalized service) + 0.2 x
    normalized head wait over the backlogged agents (las.py, `LasScoreQueue`). With
    `head_wait_weight` 0 that is the least attained service, ties to the oldest head, and
    the keys below order an ordinary agent heap.
    """

    half_life_s: float = 60.0
    output_weight: float = 2.0  # the plugin's weightOutputToken (input tokens weigh 1)
    service_weight: float = 0.8  # the plugin's lasWeightService
    head_wait_weight: float = 0.2  # the plugin's lasWeightHeadWait

    hooked = True

    def __post_init__(self) -> None:
        if not self.half_life_s > 0 or math.isinf(self.half_life_s):
            raise ValueError(f"las half-life must be a positive number of seconds, not {self.half_life_s!r}")
        if not 0 <= self.head_wait_weight < math.inf:
            raise ValueError(f"las head-wait weight must be a number >= 0, not {self.head_wait_weight!r}")

    def make_queue(self, ctx: SchedulerContext, backfill_depth: int) -> RequestQueue:
        if self.head_wait_weight > 0:
            return LasScoreQueue(self.service_weight, self.head_wait_weight)  # no backfill
        return AgentHeapQueue(self.agent_key, backfill_depth)

    def agent_key(self, agent: AgentState, head: RequestState) -> SortKey:
        return (agent.las_service, head.seq)

    def static_key(self, agent: AgentState) -> Any:
        return (agent.las_service, agent.seq)

    def priority(self, agent: AgentState, req: RequestState | None) -> int:
        # L is log2 of tokens plus now / h: 1/1024 of a doubling is finer than any order the
        # engine's preemption needs; an agent with no service ranks first.
        return -1 if agent.las_service == -math.inf else int(agent.las_service * 1024)

    def on_finish(self, ctx: SchedulerContext, agent: AgentState, req: RequestState, prompt_tokens: int,
                  output_tokens: int, now: float) -> None:
        # Charged on completion with the true lengths, as the plugin does from the response's usage.
        x = prompt_tokens + self.output_weight * output_tokens
        if x > 0:
            agent.las_service = log2_add(agent.las_service, math.log2(x) + now / self.half_life_s)

    def service(self, agent: AgentState, now: float) -> float:
        """The agent's decayed attained service at `now` (tokens, p + 2d)."""
        if agent.las_service == -math.inf:
            return 0.0
        return float(2.0 ** (agent.las_service - now / self.half_life_s))


def _fair(agent: AgentState) -> FairCounters:
    """Equinox's counters of an agent with a submitted request (`on_submit` makes them)."""
    if agent.fair is None:
        raise RuntimeError(f"equinox: agent {agent.agent_id!r} has no counters: no request was submitted")
    return agent.fair


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        FCFS("fcfs", PROMPT, KV),
        SJF("sjf", PROMPT, KV),
        VTC("vtc", PROMPT, KV),
        Parrot("parrot", FOOTPRINT, KV),
        SRJF("srjf", FOOTPRINT, KV),
        Justitia("justitia", FOOTPRINT, KV, retains=True),
        Justitia("justitia-c", FOOTPRINT, COMPUTE, retains=True),
        Justitia("justitia-nocache", FOOTPRINT, KV, prefix_aware=False, retains=True),
        Justitia("justitia-noretain", FOOTPRINT, KV),
        EWSJF("ewsjf", PROMPT, KV),
        Equinox("equinox", PROMPT, KV),
        LAS("las", PROMPT, KV),
    )
}
POLICY_NAMES = tuple(POLICIES)


def get_policy(name: str, *, las_half_life_s: float | None = None,
               las_head_wait_weight: float | None = None) -> Policy:
    """The policy called `name` (see POLICY_NAMES); the las_ options set las's half-life
    and head-wait weight (None: the plugin's defaults, 60 s and 0.2; other policies ignore
    them)."""
    try:
        policy = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}") from None
    if isinstance(policy, LAS):
        if las_half_life_s is not None:
            policy = replace(policy, half_life_s=float(las_half_life_s))
        if las_head_wait_weight is not None:
            policy = replace(policy, head_wait_weight=float(las_head_wait_weight))
    return policy
