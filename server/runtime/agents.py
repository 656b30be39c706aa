"""Agents as the server tracks them: the live entry and the record the API returns.

An agent moves one way through its states:

    queued ──(first request admitted)──▶ running ⇄ paused ──▶ finished / failed (its code raised)
       │                                      │
       └──────────────┬───────────────────────┴──▶ cancelled (DELETE) / expired (lease ran out)

A running agent with nothing in flight is *paused* (a tool call, a user's think time) until
it sends its next request: it keeps its place in the fair order, and its record says since
when.

Only `finished` agents are complete runs: they alone become predictor training samples.

The scheduler core (server/scheduler) owns the agent's tag, costs and ETA while it is live;
this module owns identity, tenancy, lifecycle and the request log written to the history.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.runtime.declared import declared_shape
from server.scheduler import AgentShape, AgentView, PromiseKind


class AgentStatus(enum.StrEnum):
    """Where an agent is in its life (the diagram above; server/runtime/lifecycle.py has
    its transitions). The values are the API's `state` strings."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL: frozenset[AgentStatus] = frozenset(
    {AgentStatus.FINISHED, AgentStatus.FAILED, AgentStatus.CANCELLED, AgentStatus.EXPIRED})
MAX_ERROR_CHARS = 2000

#: Where an agent's predicted_cost came from (docs/predictors.md, "Where a cost came from"):
#: "declared" the caller's predicted_cost; "request" the exact cost of the one request of an
#: untagged OpenAI call; "model" the trained predictor of its type; "cold_start" the online
#: estimate of a type without one; "fallback" no predictor (or it failed): the prompt's size.
CostSource = Literal["declared", "request", "model", "cold_start", "fallback"]


class _RandomIds:
    """Ids of 64 random bits from the OS's CSPRNG, read 4 KiB at a time: one getrandom call
    per 512 ids instead of one per id (each was ~8% of the event loop's time with every
    OpenAI request a one-request agent, measured with py-spy at 128 in flight)."""

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def __call__(self) -> str:
        if self._at >= len(self._pool):
            self._pool, self._at = os.urandom(4096), 0
        at, self._at = self._at, self._at + 8
        return f"agt-{self._pool[at:at + 8].hex()}"


new_agent_id = _RandomIds()


#: An ended agent keeps metadata up to this size in memory for its record; larger metadata
#: is only in the history.
ENDED_METADATA_BYTES = 1024


def encode_metadata(metadata: dict[str, Any]) -> bytes:
    """Metadata as the server keeps it: compact JSON, UTF-8."""
    return json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode()


def metadata_size_floor(metadata: Any, over: int) -> int:
    """A lower bound of `len(encode_metadata(metadata))`, or the first count past `over`.

    Encoding 4 MB of metadata only to find it over --max-metadata-bytes held the
    interpreter for 40-170 ms in one C call; summing its strings' lengths (each encodes to
    at least its length plus two quotes) costs microseconds per value."""
    size = 0
    stack: list[Any] = [metadata]
    while stack and size <= over:
        value = stack.pop()
        if isinstance(value, str):
            size += len(value) + 2
        elif isinstance(value, dict):
            size += 2
            for key, item in value.items():
                size += len(str(key)) + 3  # quotes and colon
                stack.append(item)
        elif isinstance(value, list):
            size += 2
            stack.extend(value)
        else:
            size += 1
    return size


@dataclass(frozen=True)
class SessionRef:
    """A request's session (server/api/sessions.py reads it from the headers): its id and
    the agent type its agent gets if it is new."""

    session_id: str
    agent_type: str


# The type of the one-request agent made for an untagged request (server/runtime/service.py).
DEFAULT_AGENT_TYPE = "default"


@dataclass
class RequestLog:
    """One finished request of an agent, as the history keeps it."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    submitted_s: float  # seconds since the agent's submission
    admitted_s: float | None
    finished_s: float
    finish_reason: str | None
    preemptions: int = 0
    cached_tokens: int | None = None  # prompt tokens the prefix cache served (None: not reported)
    # Its time inside the engine, by the engine's clocks (server/engine/base.py `EngineTimes`;
    # None where the engine does not report it): the way in, the engine's queue, prefill,
    # decode, the way back. admitted_s to finished_s less these is the server's own time.
    to_engine_s: float | None = None
    engine_queued_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    from_engine_s: float | None = None


@dataclass
class AgentEntry:
    id: str
    type: str
    tenant: str
    prompt: str
    # The caller's metadata arrives as a dict and is kept as compact JSON bytes
    # (`metadata_json`): 21,700 empty objects are 64 KB of JSON but 1.5 MB of Python dicts.
    # `meta()` parses it when something needs it.
    metadata: InitVar[dict[str, Any] | None]
    submitted_at: float  # unix seconds
    submitted_mono: float  # the scheduler's clock (seconds since server start)
    predicted_cost: float
    auto: bool = False  # a one-request agent made for an untagged OpenAI request
    session: str | None = None  # the session id of an implicit session agent (server/api/sessions.py)
    lease_s: float | None = None  # None: the server's lease
    cost_source: CostSource = "fallback"
    state: AgentStatus = AgentStatus.QUEUED
    finished_at: float | None = None
    # While paused: since when, on the scheduler's clock and in unix seconds (None otherwise).
    paused_mono: float | None = None
    paused_at: float | None = None
    last_activity_mono: float = 0.0
    in_flight: int = 0
    requests: list[RequestLog] = field(default_factory=list)
    # KV token-time its finished requests consumed: the scheduler's count (`AgentState.consumed_kv`),
    # copied after each request, and kept once the scheduler has forgotten the agent
    consumed_kv_cost: float = 0.0
    # The predictor's (p50, p90) of its total cost, when it gives one; and the stages the
    # agent has completed (no request in flight): where re-prediction starts from.
    cost_interval: tuple[float, float] | None = None
    stages_done: int = 0
    first_eta_s: float | None = None
    # what the scheduler scaled its ETAs by (`AgentState.eta_scale`): its first ETA over
    # this is the replay's, what the calibration records when it finishes
    eta_scale: float = 1.0
    first_eta_interval_s: tuple[float, float] | None = None
    error: str | None = None  # why a failed agent failed, as its client reported it
    # Frozen at the end so that a finished agent's record stays readable after the
    # dispatcher forgets it.
    final_view: AgentView | None = None
    version: int = 0
    seq: int = 0  # registration order in this server (the cursor of GET /v1/agents)
    held_bytes: int = 0  # its prompt and metadata, against the tenant's --max-agent-bytes
    metadata_json: bytes = b"{}"
    # The structure its metadata declared (server/runtime/declared.py), parsed once.
    declared: AgentShape | None = None
    # An ended agent's metadata over ENDED_METADATA_BYTES is let go (the history has it).
    metadata_dropped: bool = False
    # Made only while someone watches (SSE): touch() runs several times per request.
    _changed: asyncio.Event | None = None
    # The scheduler's change feed (multiplexed event streams of the agent's tenant).
    on_change: Callable[[AgentEntry], None] | None = field(default=None, repr=False)

    def __post_init__(self, metadata: dict[str, Any] | None) -> None:
        if metadata:
            self.metadata_json = encode_metadata(metadata)
            if self.declared is None:
                self.declared = declared_shape(metadata)

    def meta(self) -> dict[str, Any]:
        """The metadata, parsed (a new dict each call)."""
        if self.metadata_json == b"{}":
            return {}
        return json.loads(self.metadata_json)

    def let_go(self) -> None:
        """The agent has ended and its history row is queued: what only the history needs
        leaves memory. Its prompt goes; its metadata stays when small (records show it)."""
        self.prompt = ""
        if len(self.metadata_json) > ENDED_METADATA_BYTES:
            self.metadata_json = b"{}"
            self.metadata_dropped = True

    @property
    def declared_stages(self) -> int | None:
        """The stages its metadata declared (None: not declared)."""
        return self.declared.stages if self.declared is not None else None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def touch(self) -> None:
        """Something about the agent changed: wake its event streams."""
        self.version += 1
        if self.on_change is not None:
            self.on_change(self)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def next_change(self) -> asyncio.Event:
        """An event set at the next touch()."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed


class AgentRecord(BaseModel):
    """The agent record of the HTTP API (DESIGN section 8). Times ending in `_s` are
    seconds from `submitted_at`; `submitted_at` and `finished_at` are unix seconds."""

    id: str
    type: str
    tenant: str
    state: AgentStatus
    predicted_cost: float = Field(description="Predicted total KV token-time cost.")
    virtual_finish: float = Field(description="The agent's GPS virtual finish tag.")
    predicted_cost_p90: float | None = Field(default=None, description=(
        "The cost the agent stays under with probability 0.9, when its cost is predicted "
        "(trained and online models give an interval; the cold start and the fallback the "
        "spread their guesses have shown). Its promise allows for this cost."))
    expected_cost: float | None = Field(default=None, description=(
        "Its total cost re-predicted as it runs, after each finished request, from what it "
        "consumed and the stages it completed (null before its first request ends). ETAs "
        "use it; virtual_finish does not move for it."))
    consumed_cost: float = Field(description="KV token-time of its finished requests.")
    charged_cost: float = Field(description="Cost charged to the virtual clock (over-runs add to it).")
    requests_total: int
    requests_done: int
    requests_in_flight: int
    submitted_at: float
    fair_finish_s: float = Field(description="GPS finish projected from now, no further arrivals.")
    eta_s: float = Field(description="Projected finish under the running policy.")
    # A list, not a tuple: a tuple's JSON schema (prefixItems) is not valid OpenAPI 3.0-style
    # `items`, which schema-driven clients and fuzzers read.
    eta_interval_s: list[float] | None = Field(default=None, min_length=2, max_length=2, description=(
        "[p10, p90] around eta_s, seconds from submitted_at: the remaining time scaled by how "
        "far first ETAs of finished agents have been off (about 80% of agents finish inside "
        "their first interval); never past deadline_s when that is later than eta_s."))
    delay_bound_s: float = Field(description="Promise: finish by fair_finish_s + delay_bound_s.")
    delay_bound_terms: dict[str, float] = Field(default_factory=dict, description=(
        "delay_bound_s's three terms, in seconds: lag_s (the lag behind GPS), blocking_s "
        "(waiting for memory at each stage) and critical_path_s (its stages' decodes)."))
    deadline_s: float = Field(description=(
        "Promised at registration: the tighter of the worst case (the GPS finish with the work "
        "expected to arrive ahead of the agent, at a pessimistic rate, plus delay_bound_s) and "
        "the ETA scaled by how far first ETAs have fallen short (promise_assumes says so). "
        "Moves only by the agent's own doing (it starts late, or uses more than predicted)."))
    promise: PromiseKind = Field(default=PromiseKind.FIRM, description=(
        "firm: the server expects to keep deadline_s; widened: it could not promise firmly "
        "and widened the deadline by its uncertainty (promise_reason says why); none: the "
        "policy keeps no delay bound."))
    promise_reason: str = Field(default="", description="Why the promise is widened (or none).")
    promise_assumes: str = Field(default="", description=(
        "What deadline_s rests on where it is tighter than the worst case (fair_finish_s + "
        "delay_bound_s with the most work the measured arrivals can bring): the ETA scaled by "
        "how far first ETAs of finished agents have fallen short, holding while work arrives "
        "no faster than measured. Where deadline_s is the worst case and allows tool time "
        "before later stages, the tool time it allows (the client's calls, not the server's "
        "work). Empty: the worst case, resting on nothing but the measured rate."))
    tool_allowance_s: float = Field(default=0.0, description=(
        "The client's tool time (pauses between stages: tool calls, think time) deadline_s "
        "allows before the agent's later stages, seconds; 0 where it allows none. The server "
        "keeps the engine's part of a promise: a pause longer than allowed moves the finish "
        "past deadline_s by as much."))
    paused_s: float = Field(default=0.0, description=(
        "How long the agent has been paused in all (running, nothing in flight, between "
        "stages), seconds, the pause under way included."))
    first_eta_s: float | None = Field(default=None, description="ETA given at registration.")
    first_eta_interval_s: list[float] | None = Field(
        default=None, min_length=2, max_length=2, description="eta_interval_s given at registration.")
    cost_source: CostSource = Field(
        default="fallback",
        description=("Where predicted_cost came from: declared (the caller), request (an "
                     "untagged OpenAI request's own size), model (a trained predictor of the "
                     "type), cold_start (the online estimate of a type without one), fallback "
                     "(no predictor: the prompt's size)."))
    finished_at: float | None
    paused_at: float | None = Field(default=None, description=(
        "While the agent is `paused` (running, with no request in flight: a tool call, a "
        "user's think time): when the pause began, unix seconds; null otherwise."))
    paused_for_s: float | None = Field(default=None, description=(
        "While `paused`: how long the pause has lasted so far, seconds; null otherwise."))
    tool: str | None = Field(default=None, description=(
        "The tool call the agent's client announced it is in (POST /v1/agents/{id}/pause, "
        "the SDK's `tool()`), until it announces its end; null otherwise."))
    pause_remaining_s: float | None = Field(default=None, description=(
        "While paused (or in an announced tool call): the expected rest of the pause, "
        "seconds, from the length its client declared or from the pauses (the tool's calls) "
        "seen for its type; null when there is nothing to go on."))
    session: str | None = Field(default=None, description=(
        "The session id of an implicit session agent (OpenAI requests with a session header "
        "and no agent tag); null for other agents."))
    error: str | None = Field(default=None, description="Why a `failed` agent failed.")
    jct_s: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    metadata_dropped: bool = Field(default=False, description=(
        "The agent has ended and its metadata, over 1 KiB, is no longer held in memory: "
        "`metadata` is empty here and the history keeps it."))
