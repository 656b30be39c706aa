"""The scheduler's state: requests, agents, what policies may see, and what an agent is told.

Everything here is plain data. The dispatcher (`dispatcher.py`) owns the tables and moves a
request through its statuses; the queues (`queues.py`) order the pending ones; the policies
(`policies.py`, `ewsjf.py`) read the fields they key on and keep their own data in the typed
slots below (`AgentState.vtc_counter`, `AgentState.fair`, `AgentState.las_service`, `RequestState.charge`,
`RequestState.ticket`). docs/architecture.md shows how the modules fit together;
docs/concepts.md explains the policies.
"""

from __future__ import annotations

import enum
import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .bounds import AgentShape, BoundLimits, DelayBound
from .prefix import PrefixLedger, PrefixRef, Segment

if TYPE_CHECKING:
    from .tight_promise import PromiseParts


@dataclass(frozen=True)
class RequestSpec:
    """One inference request as the dispatcher sees it."""

    request_id: str
    agent_id: str
    prompt_tokens: int
    max_tokens: int
    expected_output_tokens: int | None = None
    # Sequences sampled from the prompt (OpenAI's `n`): vLLM runs each as a request of its
    # own with its own copy of the prompt (measured: n=3 holds 3 prompts' KV blocks), so
    # footprint and cost are n times those of one sequence.
    n: int = 1
    # The prompt prefixes it shares with other requests, shortest first (prefix.py): named
    # by a workload, or block hashes of its token ids on the live server. Empty: all private.
    prefix: tuple[PrefixRef, ...] = ()

    @property
    def expected_tokens(self) -> int:
        """Expected output length, bounded by max_tokens (max_tokens when unknown)."""
        if self.expected_output_tokens is None:
            return self.max_tokens
        return max(0, min(self.expected_output_tokens, self.max_tokens))


class PromiseKind(enum.StrEnum):
    """How far an agent's deadline can be trusted. The values are the API's `promise`
    strings."""

    FIRM = "firm"  # the server expects to keep it
    WIDENED = "widened"  # widened by its uncertainty (promise_reason says why)
    NONE = "none"  # the policy keeps no delay bound


class RequestStatus(enum.Enum):
    """Where a request is. A request leaves the dispatcher's table when it is DONE."""

    PENDING = "pending"  # submitted, waiting in the queue for admission
    RUNNING = "running"  # admitted into the engine: its footprint is reserved
    DONE = "done"  # finished or dropped: its reservation (if any) is released


# -- per-policy state ----------------------------------------------------------------------
class Charge(NamedTuple):
    """Equinox: what an admitted request was charged with its predicted output length."""

    user: float  # user tokens: p + w_out * d
    resource: float  # KV token-time
    key: float  # the combined counter's increment


@dataclass
class FairCounters:
    """Equinox's two counters of one agent, and the key that combines them."""

    user: float = 0.0  # U: input + w_out * output tokens, as the agent sees its service
    resource: float = 0.0  # R: KV token-time, what its requests hold in the engine
    key: float = 0.0  # H: alpha * U + (1 - alpha) * rho * R, plus lifts
    provisional: int = 0  # admitted requests charged with a predicted length, not yet corrected


@dataclass
class GroupTicket:
    """EWSJF: the group queue a request was routed to, and when it was admitted."""

    group: int | None  # None once the request left the queue without being admitted
    admitted_at: float | None = None  # service time = finish - admission (what EWSJF learns)


# -- requests and agents -------------------------------------------------------------------
# A policy's ordering key (`request_order`, `agent_key`): numbers compared element-wise,
# smallest first, ending in a sequence number so that no two are equal.
SortKey = tuple[float, ...]


@dataclass
class RequestState:
    """A submitted request: its estimates, its place in the order and its status."""

    spec: RequestSpec
    seq: int
    submitted_at: float
    footprint: int  # KV tokens reserved when admitted (p + expected d, whole blocks)
    est_cost: float  # estimated cost in the policy's cost units
    est_kv_cost: float
    # Shared prompt prefixes (prefix-aware policies): its segments, the footprint left when
    # they are taken out, and the KV token-time charged for them at submission.
    segments: tuple[Segment, ...] = ()
    private_footprint: int = 0
    shared_charge: float = 0.0
    order: SortKey = ()  # the policy's order among the agent's own pending requests
    status: RequestStatus = RequestStatus.PENDING
    ticket: GroupTicket | None = None  # EWSJF's routing
    charge: Charge | None = None  # Equinox's provisional charge while running
    admitted_at: float | None = None  # when it entered the engine (its memory frees when it ends)


HeapEntry = tuple[SortKey, int, RequestState]  # (order, seq, request): an agent's pending heap


@dataclass
class AgentState:
    """A registered agent: its GPS charge, its costs, its requests and its place in line."""

    agent_id: str
    seq: int
    agent_type: str | None
    submitted_at: float
    predicted_cost: float  # KV token-time predicted at arrival
    charged_cost: float  # work charged to the virtual clock (policy cost units)
    virtual_finish: float
    bound: DelayBound
    shape: AgentShape
    # The charge its promise allows for (policy cost units): its prediction's p90 where the
    # prediction is uncertain (a predictor's interval), else its charge.
    promise_charge: float = 0.0
    # The shape its ETA expects, where that is not the one its bound covers: a type's
    # learned shape bounds an agent at the type's p90 and estimates it at the median.
    eta_shape: AgentShape | None = None
    committed_cost: float = 0.0  # estimates of submitted requests, corrected on finish
    committed_kv: float = 0.0  # the same in KV token-time: real work, not a declaration
    longest_decode: int = 0  # longest expected output of its requests (ETA critical path)
    tenant: str | None = None  # whose declarations may widen this agent's bound
    # In the GPS reference (B) only from its first request on: an agent that never sends
    # one does not slow the virtual clock (docs/concepts.md, "Promises no one else can break").
    in_reference: bool = False
    ended: bool = False  # finished, cancelled or expired: gone from the dispatcher's tables
    eta_key_at: float | None = None  # several tenants: its H-GPS finish, for ETAs before the next pass
    eta_at: float | None = None  # ETA (caller's clock) from the last refresh_etas pass
    fair_at: float | None = None  # GPS finish from that pass (None: its tag changed since)
    deadline_at: float | None = None  # the promised deadline (caller's clock), set at registration
    promise: PromiseKind = PromiseKind.FIRM
    promise_reason: str = ""
    promise_assumes: str = ""  # what a deadline tighter than the worst case rests on (tight_promise.py)
    # The client's tool time its deadline allows before its later stages (the worst case's
    # allowance, pauses.py; 0.0: none, as a calibrated deadline or one with no pause seen)
    tool_allowance_s: float = 0.0
    promise_context: int | None = None  # its place in the queue at registration (tight_promise.py)
    promise_large: bool = False  # large for the recent mix or the cache at registration (tight_promise.py)
    promise_burst_head: bool = False  # among the first of a burst at registration (tight_promise.py)
    promise_parts: PromiseParts | None = None  # what its first deadline was made of (tight_promise.py)
    eta_scale: float = 1.0  # its ETA told is the replay's times this, its context's at registration (eta_interval.py)
    eta_pausing: bool = False  # its first ETA expected pauses: its scale is of agents whose ETAs did too
    # Its ETA counts tool time apart from the engine's (tool_time.py): fixed at registration,
    # with the distribution of its remaining time then (a few equally likely points)
    eta_tools: bool = False
    eta_times: tuple[float, ...] = ()
    # Its first ETA by the replay (seconds from registration) and the engine's part of it,
    # the pauses it expected taken out: what its ratios are of when it finishes
    # (eta_interval.py; the engine's part: tool_time.py)
    eta_replay_s: float | None = None
    eta_engine_s: float | None = None
    # its cost is a guess (no predictor knows its type): no calibrated deadline, and no record of
    # how far ETAs fall short learns from it (eta_estimator.py)
    cost_guessed: bool = False
    consumed_cost: float = 0.0  # real cost of finished requests (policy cost units)
    consumed_kv: float = 0.0  # real KV token-time of finished requests
    # The latest re-prediction of its total KV cost as it runs (reprediction.py): ETAs count
    # what of it is not consumed yet. None: not re-predicted; the charge not consumed counts.
    expected_kv: float | None = None
    request_ids: set[str] = field(default_factory=set)  # submitted, unfinished requests
    pending: int = 0  # requests submitted and not yet admitted
    running: int = 0  # requests admitted and not yet finished
    # Paused (pauses.py): since when it has had nothing in flight (None: it has some, or has
    # not started), how many stages it has started, and how long it has paused in all.
    idle_since: float | None = None
    stages_started: int = 0
    paused_s: float = 0.0
    # In a tool call its client announced (pauses.py, `tool_started`): the tool's name, since
    # when, and how long the client expects it to take (None: not said).
    tool: str | None = None
    tool_since: float | None = None
    tool_expected_s: float | None = None
    requests_total: int = 0
    requests_done: int = 0
    # Owned by AgentHeapQueue (queues.py): the agent's pending requests in `order`, and the
    # validity of its entry in the queue's heap of agents (entries of older versions are stale).
    heap: list[HeapEntry] = field(default_factory=list)
    version: int = 0
    in_heap: bool = False
    heap_key: object = None  # the key of its valid entry (while in_heap)
    # Per-policy state
    vtc_counter: float = 0.0  # VTC: service received (p on admission, 2 d on finish), lifted
    fair: FairCounters | None = None  # Equinox
    # LAS: log2 of its attained service scaled to time 0 (-inf: none yet); see policies.LAS
    las_service: float = -math.inf
    prefixes: PrefixLedger | None = None  # its holds of shared prefixes (prefix-aware charges)

    @property
    def pending_requests(self) -> int:
        """Requests submitted and not yet admitted."""
        return self.pending

    @property
    def remaining_predicted(self) -> float:
        """Predicted KV cost not yet consumed (SRJF's key)."""
        return max(0.0, self.predicted_cost - self.consumed_kv)


@dataclass(frozen=True, slots=True)
class AgentView:
    """What the scheduler tells of an agent at one moment (`Dispatcher.view`): its tag,
    costs, ETA and promise; the times are seconds from its submission. The runtime joins
    it with its own entry into the API's record (server/runtime/records.py), and keeps an
    ended agent's last one."""

    agent_id: str
    agent_type: str | None
    submitted_at: float  # on the caller's clock
    predicted_cost: float
    charged_cost: float
    consumed_cost: float
    virtual_finish: float
    fair_finish_s: float
    eta_s: float
    delay_bound_s: float
    deadline_s: float
    bound: DelayBound  # the three terms of delay_bound_s
    requests_total: int
    requests_done: int
    pending: int
    running: int
    promise: PromiseKind = PromiseKind.FIRM  # how far deadline_s can be trusted
    promise_reason: str = ""  # why a promise is widened (or none)
    promise_assumes: str = ""  # what deadline_s rests on where it is tighter than the worst case
    tool_allowance_s: float = 0.0  # the client's tool time deadline_s allows (AgentState.tool_allowance_s)
    paused_s: float = 0.0  # time spent paused so far, the pause under way included (pauses.py)
    expected_cost: float | None = None  # re-predicted total KV cost (None: not re-predicted)
    eta_interval_s: tuple[float, float] | None = None  # [p10, p90] around eta_s (eta_interval.py)
    tool: str | None = None  # the tool call its client announced it is in (pauses.py)
    pause_remaining_s: float | None = None  # the expected rest of its pause (None: not paused, or unknown)


# -- what the dispatcher has observed ------------------------------------------------------
@dataclass
class ObservedLimits:
    """The largest costs the scheduler can trust: the delay bound's limits when none are
    declared.

    c_max and d_max come from submitted requests (real prompts and max_tokens, which the
    server caps at the engine's context length). C_max is per tenant: the largest *real*
    agent cost of the agent's own tenant (KV token-time of the submitted requests of its
    live agents, corrected to their true lengths as they finish; of its ended agents, what
    was admitted), and its own predictions. Another tenant's agents, declarations and
    queued-then-cancelled requests widen no one else's bound: under the hierarchical fair
    share another tenant's work takes that tenant's share, not this agent's (docs/concepts.md).
    """

    max_request_cost: float = 0.0  # c_max: KV token-time of the largest request
    max_agent_cost: float = 0.0  # largest committed KV token-time of any agent (reported)
    max_output_tokens: int = 0  # d_max: the largest max_tokens
    declared: dict[str | None, float] = field(default_factory=dict)  # tenant -> largest prediction
    # tenant -> heap of (-committed KV, agent seq, agent) of its live agents (lazy: stale
    # entries, whose agent ended or committed more since, are dropped when they surface)
    live: dict[str | None, list[tuple[float, int, AgentState]]] = field(default_factory=dict)
    ended: dict[str | None, float] = field(default_factory=dict)  # tenant -> largest admitted work of an ended agent
    _kept: dict[str | None, int] = field(default_factory=dict)  # live heap sizes after the last compaction

    def declare(self, tenant: str | None, predicted_cost: float) -> None:
        self.declared[tenant] = max(self.declared.get(tenant, 0.0), predicted_cost)

    def commit(self, agent: AgentState) -> None:
        """The agent's committed KV changed (a request submitted, or corrected as it ended)."""
        self.max_agent_cost = max(self.max_agent_cost, agent.committed_kv)
        heap = self.live.setdefault(agent.tenant, [])
        heapq.heappush(heap, (-agent.committed_kv, agent.seq, agent))
        if len(heap) > 64 and len(heap) > 4 * self._kept.get(agent.tenant, 0):
            # stale entries below the top: keep each live agent's current one
            fresh = {a.seq: (c, s, a) for c, s, a in heap if not a.ended and a.committed_kv == -c}
            heap[:] = list(fresh.values())
            heapq.heapify(heap)
            self._kept[agent.tenant] = len(heap)

    def drop(self, agent: AgentState, admitted_kv: float) -> None:
        """The agent ended; `admitted_kv`: the work it really had admitted (its queued
        requests, dropped, are not counted)."""
        agent.ended = True  # its live entries are stale from now on
        if admitted_kv > self.ended.get(agent.tenant, 0.0):
            self.ended[agent.tenant] = admitted_kv

    def agent_cost(self, tenant: str | None) -> float:
        """C_max of `tenant`'s bounds."""
        best = max(self.ended.get(tenant, 0.0), self.declared.get(tenant, 0.0))
        heap = self.live.get(tenant)
        while heap:
            cost, _, agent = heap[0]
            if not agent.ended and agent.committed_kv == -cost:
                return max(best, -cost)
            heapq.heappop(heap)
        return best

    def as_limits(self, tenant: str | None = None) -> BoundLimits:
        return BoundLimits(self.max_request_cost, self.agent_cost(tenant), int(self.max_output_tokens))


@dataclass
class CostMix:
    """Compute and KV cost of the requests submitted so far: the ratio converts between the
    two cost models (justitia-c's rate, Equinox's resource weight)."""

    compute: float = 0.0
    kv: float = 0.0

    @property
    def compute_per_kv(self) -> float:
        """Compute tokens (p + 2d) per unit of KV token-time (1/256 before any request)."""
        return self.compute / self.kv if self.kv > 0 else 1.0 / 256.0


class SchedulerContext(Protocol):
    """What a policy may ask of the dispatcher in its hooks (and nothing more)."""

    @property
    def tau(self) -> float:
        """The engine's iteration time, seconds."""
        ...

    @property
    def compute_per_kv(self) -> float:
        """Compute tokens per unit of KV token-time over the requests submitted so far."""
        ...

    def leader(self) -> AgentState | None:
        """The agent whose head request is admitted next (agent-keyed queues), or None."""
        ...

    def tenant_position(self, agent: AgentState) -> float:
        """The agent's hierarchical GPS finish on the tenants' virtual scale (the order of
        tenants, tenant_clock.py), at the clock's current time."""
        ...
