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
| ewsjf      | density-weighted score of per-group queues   | prompt fits, engine preempts |
| equinox    | per-agent user + resource fairness counters  | prompt fits, engine preempts |

"Footprint" admission reserves p + expected d (bounded by max_tokens) against M and admits
in strict key order, so the engine never has to preempt when the estimate is right. "Prompt
fits" is what vLLM does natively: admit when the prompt fits in free memory now; requests
grow afterwards and the engine preempts (recompute) when memory runs out.

Two policies need more than a key (docs/concepts.md has their sources and assumptions):

- ewsjf (EWSJF, arXiv 2601.21758) orders requests by a score that grows with waiting time, so
  no static heap key exists. It owns its queue (`owns_queue`): the dispatcher routes submitted
  requests to it and asks it for the next one (`select`), and it learns from the service
  times it measures (`on_finish`).
- equinox (Equinox, arXiv 2508.16646) keys agents by two counters that are charged on
  admission with a predicted output length and corrected on finish with the true one.

Such state lives in the instance `bind()` makes for one dispatcher; the instances in
POLICIES are configuration only and are shared. The hooks (`on_submit`, `on_admit`,
`on_finish`, `on_drop`) are called by the dispatcher only for policies with `hooked` set, so
the other policies pay nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .cost import COMPUTE, KV
from .ewsjf import EwsjfConfig, EwsjfState

if TYPE_CHECKING:  # pragma: no cover
    from .dispatcher import AgentState, Dispatcher, RequestState

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

    # -- state and feedback (stateful policies only) -------------------------------------
    # A policy that learns or keeps counters needs to hear what happens to requests; these
    # hooks are how the dispatcher tells it. All take `now` from the caller (no clock here).
    hooked = False  # the dispatcher calls the hooks below only when this is True
    owns_queue = False  # the policy holds pending requests itself (select / on_admit)

    def bind(self, seed: int = 0) -> "Policy":
        """The instance one dispatcher uses: stateless policies are shared; stateful ones
        return a fresh copy, seeded, so that runs are reproducible and never share state."""
        return self

    def on_submit(self, d: "Dispatcher", agent: "AgentState", req: "RequestState", now: float,
                  first: bool) -> None:
        """A request was queued; `first`: its agent had nothing pending before."""

    def select(self, d: "Dispatcher", now: float) -> "RequestState | None":
        """The next request to admit (owns_queue policies only)."""
        return None

    def on_admit(self, d: "Dispatcher", agent: "AgentState", req: "RequestState", now: float) -> None:
        """The request was admitted into the engine (called before its agent is re-keyed)."""

    def on_finish(self, d: "Dispatcher", agent: "AgentState", req: "RequestState", prompt_tokens: int,
                  output_tokens: int, now: float) -> None:
        """An admitted request finished with its true lengths (before its agent is re-keyed)."""

    def on_drop(self, d: "Dispatcher", agent: "AgentState", req: "RequestState") -> None:
        """The request is forgotten without finishing: cancelled, or rejected before admission."""

    def is_idle(self) -> bool:
        """True when the policy's own bookkeeping is back to zero (nothing queued or charged)."""
        return True

    def describe(self) -> dict:
        """Plain-data state worth reporting after a run (learned parameters, ...)."""
        return {}


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


@dataclass(frozen=True)
class EWSJF(Policy):
    """Request-level: per-group FIFO queues, the head of the best-scoring group next."""

    config: EwsjfConfig = field(default_factory=EwsjfConfig)
    state: EwsjfState | None = field(default=None, compare=False, repr=False)

    hooked = True
    owns_queue = True

    def bind(self, seed: int = 0) -> "EWSJF":
        return replace(self, state=EwsjfState(self.config, seed))

    def agent_key(self, agent, head):  # never used: the policy owns the queue
        return (head.seq,)

    def on_submit(self, d, agent, req, now, first):
        self.state.enqueue(req)

    def select(self, d, now):
        return self.state.select(now, d.tau)

    def on_admit(self, d, agent, req, now):
        self.state.take(req)

    def on_finish(self, d, agent, req, prompt_tokens, output_tokens, now):
        self.state.observe(req, now, d.tau)

    def on_drop(self, d, agent, req):
        self.state.drop(req)

    def priority(self, agent, req):
        # the group index: if the engine must preempt, it preempts the slowest group first
        return int(req.pstate) if req is not None and req.pstate is not None else 0

    def is_idle(self):
        return self.state is None or self.state.queued == 0

    def describe(self):
        return self.state.describe() if self.state is not None else {}


@dataclass
class FairCounters:
    """Equinox's two counters of one agent, and the key that combines them."""

    user: float = 0.0  # U: input + w_out * output tokens, as the agent sees its service
    resource: float = 0.0  # R: KV token-time, what its requests hold in the engine
    key: float = 0.0  # H: alpha * U + (1 - alpha) * rho * R, plus lifts
    provisional: int = 0  # admitted requests charged with a predicted length, not yet corrected


@dataclass
class _Outstanding:
    charges: int = 0  # provisional charges over all agents (back to 0 when idle)


@dataclass(frozen=True)
class Equinox(Policy):
    """Agent-level fair sharing on a holistic counter: user tokens and KV token-time."""

    alpha: float = 0.5  # weight of the user counter; 1 - alpha weighs the resource counter
    output_weight: float = 2.0  # an output token counts this many input tokens (VTC's w_q/w_p)
    state: _Outstanding | None = field(default=None, compare=False, repr=False)

    hooked = True

    def bind(self, seed: int = 0) -> "Equinox":
        return replace(self, state=_Outstanding())

    def _counters(self, agent: "AgentState") -> FairCounters:
        if agent.pstate is None:
            agent.pstate = FairCounters()
        return agent.pstate

    def _charge(self, d: "Dispatcher", p: int, out: int) -> tuple[float, float, float]:
        u = p + self.output_weight * out
        r = p * out + out * (out + 1) // 2  # kv_cost(p, out), inlined: this runs per admission
        # rho converts KV token-time into tokens at the ratio of the requests submitted so far,
        # so that with alpha = 0.5 both counters weigh the same for the average request.
        return u, r, self.alpha * u + (1.0 - self.alpha) * d.compute_per_kv * r

    def agent_key(self, agent, head):
        return (agent.pstate.key, agent.seq, head.seq)

    def static_key(self, agent):
        return (agent.pstate.key if agent.pstate is not None else 0.0, agent.seq)

    def priority(self, agent, req):
        return int(agent.pstate.key) if agent.pstate is not None else 0

    def on_submit(self, d, agent, req, now, first):
        c = self._counters(agent)
        if first:
            # VTC's lift: a newly backlogged agent starts no lower than the least-served
            # backlogged one, so that time spent idle earns no credit.
            leader = d.leader()
            if leader is not None and leader is not agent and leader.pstate is not None:
                c.key = max(c.key, leader.pstate.key)

    def on_admit(self, d, agent, req, now):
        # Charged before it runs, with the predicted output length (the request's estimate)
        c = agent.pstate
        u, r, h = self._charge(d, req.spec.prompt_tokens, req.spec.expected_tokens)
        c.user += u
        c.resource += r
        c.key += h
        c.provisional += 1
        req.pstate = (u, r, h)
        self.state.charges += 1

    def on_finish(self, d, agent, req, prompt_tokens, output_tokens, now):
        # ... and corrected when the true length is known: shorter than predicted credits back.
        c = agent.pstate
        u0, r0, h0 = req.pstate
        u, r, h = self._charge(d, prompt_tokens, output_tokens)
        c.user += u - u0
        c.resource += r - r0
        c.key += h - h0
        c.provisional -= 1
        req.pstate = None
        self.state.charges -= 1

    def on_drop(self, d, agent, req):
        if req.running and req.pstate is not None:  # a cancelled request: its charge goes too
            req.pstate = None
            self.state.charges -= 1
            if agent.pstate is not None:
                agent.pstate.provisional -= 1

    def is_idle(self):
        return self.state is None or self.state.charges == 0


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
        EWSJF("ewsjf", PROMPT, KV, "EWSJF: learned request groups, density-weighted score, tuned online"),
        Equinox("equinox", PROMPT, KV, "Equinox: user + resource fairness counters, corrected on finish"),
    )
}
POLICY_NAMES = tuple(POLICIES)


def get_policy(name: str) -> Policy:
    """The policy called `name` (see POLICY_NAMES)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}") from None
