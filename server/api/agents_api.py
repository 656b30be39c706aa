"""The agent API: register, inspect, watch, finish and cancel agents."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from justitia_sdk import AGENT_TYPE_MAX_LENGTH, AGENT_TYPE_PATTERN
from server.api import errors
from server.api.auth import rate_limited_tenant, require_admin, tenant_of
from server.api.bodies import caller, is_large, json_response, parse_body, parsed
from server.api.openai_schemas import SSE_EVENT
from server.api.validation import RequestBody
from server.engine.base import ReplicaList
from server.runtime.agents import AgentEntry, AgentRecord, encode_metadata, metadata_size_floor
from server.runtime.limits import Quotas
from server.runtime.live import LiveScheduler
from server.runtime.service import off_loop_if
from server.runtime.shutdown import FAREWELL, shutdown_of

router = APIRouter(tags=["agents"])

MAX_PROMPT_CHARS = 1_000_000
# Far above any real agent (1e18 is about a million requests of a million tokens each); a
# larger declared cost let the record's times overflow to infinity, which JSON cannot carry.
MAX_PREDICTED_COST = 1e18
# The metadata keys the bound uses (server/runtime/declared.py), and the ranges that keep the
# bound's arithmetic finite.
_SHAPE_RANGES = {"stages": (1, 1_000_000), "critical_path_tokens": (0, 10**12), "prefill_tokens": (0, 10**12),
                 "first_request_tokens": (0, 10**12), "prefill_square_tokens": (0, 10**24)}


class AgentCreate(RequestBody):
    model_config = ConfigDict(extra="forbid")

    type: str = Field(min_length=1, max_length=AGENT_TYPE_MAX_LENGTH, pattern=AGENT_TYPE_PATTERN,
                      description="Agent type: selects the cost predictor.")
    prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS,
                        description="The text the cost predictor sees.")
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description=("The caller's (kept as compact JSON, at most --max-metadata-bytes, "
                     "64 KiB by default); `stages` (int, 1 to 1e6) and `critical_path_tokens` (int, "
                     "0 to 1e12) declare the agent's structure for its delay bound, "
                     "`prefill_tokens` (int, 0 to 1e12: the prompt tokens its requests will "
                     "compute) the prefill its ETA counts, `first_request_tokens` (int, 0 to "
                     "1e12: prompt and output of its first stage's largest request) the wait "
                     "for room for it its ETA counts, `prefill_square_tokens` (int, 0 to 1e24: "
                     "the sum of the squares of those prompts) the chunked prefill of prompts "
                     "past the engine's token budget per step its ETA counts, "
                     "`stage_request_tokens` (a list of ints, 0 to 1e12, one per stage: prompt "
                     "and output of each stage's largest request) the wait for room for them "
                     "the ETAs of the agents behind it count."))
    predicted_cost: float | None = Field(
        default=None, ge=0, le=MAX_PREDICTED_COST, allow_inf_nan=False,
        description=("The agent's total KV token-time cost, when the caller knows it (trace "
                     "replays, oracle benchmarks). Default: the server's predictor. Declaring "
                     "too little gains nothing: over-runs are charged as requests arrive."))
    lease_s: float | None = Field(
        default=None, gt=0, le=86_400,
        description="Expire the agent after this many idle seconds (default: the server's lease).")

    @field_validator("metadata")
    @classmethod
    def _shape_in_range(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        for key, (low, high) in _SHAPE_RANGES.items():
            value = metadata.get(key)
            # Other types are ignored, as before: metadata is the caller's.
            if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
                raise ValueError(f"metadata.{key} must be an integer from {low} to {high}")
        _check_stage_sizes(metadata)
        return metadata


def _check_stage_sizes(metadata: dict[str, Any]) -> None:
    """`stage_request_tokens`, a list of ints: one per declared stage, each in range. Other
    types are the caller's own, as for the other keys."""
    sizes = metadata.get("stage_request_tokens")
    if not isinstance(sizes, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return
    low, high = _SHAPE_RANGES["first_request_tokens"]
    if not sizes or not all(low <= v <= high for v in sizes):
        raise ValueError(f"metadata.stage_request_tokens must be a non-empty list of integers from {low} to {high}")
    stages = metadata.get("stages")
    if isinstance(stages, int) and not isinstance(stages, bool) and stages != len(sizes):
        raise ValueError(f"metadata.stage_request_tokens has {len(sizes)} entries; metadata.stages declares {stages}: "
                         "one entry per stage")


class AgentList(BaseModel):
    agents: list[AgentRecord]
    next_cursor: str | None = Field(
        default=None, description="Pass as `cursor` for the next page; null on the last page.")


DEFAULT_PAGE = 100
MAX_PAGE = 1000


class AgentFinish(RequestBody):
    model_config = ConfigDict(extra="forbid")

    error: str | None = Field(
        default=None, max_length=100_000,
        description=("Set when the agent's code raised: the agent ends `failed` with this "
                     "message (kept to its first 2,000 characters) and is not a training "
                     "sample. Without it the agent ends `finished`."))


class AgentPause(RequestBody):
    model_config = ConfigDict(extra="forbid")

    tool: str = Field(default="tool", min_length=1, max_length=AGENT_TYPE_MAX_LENGTH,
                      pattern=AGENT_TYPE_PATTERN,
                      description="The tool called (its calls are learned per agent type and tool).")
    expected_s: float | None = Field(
        default=None, ge=0, le=86_400, allow_inf_nan=False,
        description=("How long the caller expects the call to take, seconds (default: what the "
                     "server has seen of this tool's calls)."))


# An `ids` filter longer than this is better served by the unfiltered stream.
MAX_WATCH_IDS = 1000
# Characters an `ids` filter may spend per id: an agent id ("agt-" and 16 hex digits) and
# its comma, with room to spare.
WATCH_ID_CHARS = 40
# Cursors are SQLite rowids and registration counters: signed 64-bit integers.
MAX_CURSOR = 2**63
# Live agents whose records the stream without `ids` sends first; the rest are announced
# by `event: more` (their count and a cursor of GET /v1/agents) and sent when they change.
SNAPSHOT_AGENTS = 1000


_EVENTS: dict[int | str, dict[str, Any]] = {
    200: {"description": "Server-sent events: `event: agent` with the record as `data`, "
                              "at every change until the agent ends; `: keep-alive` comments "
                              "every 15 s",
                 "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def _cursor(cursor: str | None) -> int:
    """What a page's `cursor` continues after (0: the first page); a 400 for anything not a
    `next_cursor` this server gave."""
    if cursor is None:
        return 0
    if not cursor.isdigit() or int(cursor) >= MAX_CURSOR:
        raise HTTPException(400, "cursor must be the next_cursor of an earlier page")
    return int(cursor)


def _scheduler(request: Request) -> LiveScheduler:
    return request.app.state.scheduler


def _entry(agent_id: str, request: Request, tenant: str) -> AgentEntry:
    return _scheduler(request).get(agent_id, tenant)


@router.post("/v1/agents", status_code=201, response_model=AgentRecord,
             responses=errors.responses(400, 401, 413, 429))
async def register_agent(body: AgentCreate, request: Request,
                         tenant: str = Depends(rate_limited_tenant)) -> AgentRecord:
    s = _scheduler(request)
    entry = s.register(body.type, body.prompt, tenant, body.metadata,
                       predicted_cost=body.predicted_cost, lease_s=body.lease_s)
    return s.record(entry)


@router.get("/v1/agents", response_model=AgentList, responses=errors.responses(400, 401))
async def list_agents(request: Request, tenant: str = Depends(tenant_of),
                      state: str | None = Query(default=None),
                      limit: int = Query(default=DEFAULT_PAGE, ge=1, le=MAX_PAGE,
                                         description=f"At most this many agents (default "
                                                     f"{DEFAULT_PAGE}, at most {MAX_PAGE})."),
                      cursor: str | None = Query(default=None, max_length=32,
                                                 description="`next_cursor` of the page before"),
                      ) -> AgentList:
    """The caller's agents in registration order, a page at a time."""
    after = _cursor(cursor)
    s = _scheduler(request)
    entries, last = s.page(tenant, limit, after, state)
    return AgentList(agents=[s.record(e) for e in entries],
                     next_cursor=str(last) if last is not None else None)


@router.get("/v1/agents/events", response_class=StreamingResponse,
            responses={**_EVENTS, **errors.responses(400, 401)})
async def agents_events(request: Request, tenant: str = Depends(tenant_of),
                        ids: str | None = Query(
                            default=None, max_length=MAX_WATCH_IDS * WATCH_ID_CHARS,
                            description="Comma-separated agent ids (at most 1,000); "
                                        "default: every agent of the caller")) -> StreamingResponse:
    """One stream for many agents: `event: agent` with a record each time an agent of the
    caller changes (first the live ones, at most 1,000 of them: with more, `event: more`
    follows with `{"more": N, "shown": 1000, "cursor": C}`, C continuing `GET /v1/agents`;
    changes are coalesced to at most 4 updates a second per agent). A client watching a
    whole batch holds one connection, not one per agent."""
    wanted = None
    if ids is not None:
        wanted = frozenset(i for i in ids.split(",") if i)
        if not wanted or len(wanted) > MAX_WATCH_IDS:
            raise HTTPException(400, f"ids must name 1 to {MAX_WATCH_IDS} agents")

    async def stream() -> AsyncIterator[str]:
        s = _scheduler(request)
        initial, more = None, None
        if wanted is None:
            # At most SNAPSHOT_AGENTS records first, then `event: more` if there are more
            # live agents (no await between this and watch(): no change is missed).
            initial, rest, last = s.live_page(tenant, SNAPSHOT_AGENTS)
            if rest:
                more = {"more": rest, "shown": len(initial), "cursor": str(last)}
        sent = 0
        async for records in s.watch(tenant, wanted, initial=initial):
            if records is None:
                yield ": keep-alive\n\n"
                continue
            yield "".join(f"event: agent\ndata: {json.dumps(r.model_dump())}\n\n"
                          for r in records)
            sent += len(records)
            # `more` follows the whole snapshot, which the feed sends in chunks.
            if more is not None and initial is not None and sent >= len(initial):
                yield f"event: more\ndata: {json.dumps(more)}\n\n"
                more = None

    return StreamingResponse(shutdown_of(request.app).until_closing(stream(), FAREWELL),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/v1/agents/{agent_id}", response_model=AgentRecord,
            responses=errors.responses(401, 404))
async def get_agent(agent_id: str, request: Request, tenant: str = Depends(tenant_of)) -> AgentRecord:
    return _scheduler(request).record(_entry(agent_id, request, tenant))


@router.get("/v1/agents/{agent_id}/events", response_class=StreamingResponse,
            responses={**_EVENTS, **errors.responses(401, 404)})
async def agent_events(agent_id: str, request: Request,
                       tenant: str = Depends(tenant_of)) -> StreamingResponse:
    s = _scheduler(request)
    entry = _entry(agent_id, request, tenant)

    async def stream() -> AsyncIterator[str]:
        async for record in s.events(entry):
            if record is None:
                yield ": keep-alive\n\n"
            else:
                yield f"event: agent\ndata: {json.dumps(record.model_dump())}\n\n"

    return StreamingResponse(shutdown_of(request.app).until_closing(stream(), FAREWELL),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/v1/agents/{agent_id}/finish", response_model=AgentRecord,
             responses=errors.responses(400, 401, 404, 409, 503))
async def finish_agent(agent_id: str, request: Request, tenant: str = Depends(tenant_of),
                       body: AgentFinish | None = None) -> AgentRecord:
    """The agent is done: `finished`, or `failed` with `{"error": "..."}` when its code
    raised. Only finished agents become predictor training samples."""
    s = _scheduler(request)
    error = body.error if body is not None else None
    return s.record(await s.finish(_entry(agent_id, request, tenant), error=error))


@router.post("/v1/agents/{agent_id}/pause", response_model=AgentRecord,
             responses=errors.responses(400, 401, 404, 409))
async def pause_agent(agent_id: str, request: Request, body: AgentPause | None = None,
                      tenant: str = Depends(tenant_of)) -> AgentRecord:
    """The agent is in a tool call from now (`{"tool": "search", "expected_s": 2.0}`, both
    optional): the scheduler knows the pause and judges its rest from the declared length or
    the tool's calls seen; the record shows `tool` and `pause_remaining_s`. 409 once the
    agent has ended."""
    s = _scheduler(request)
    body = body or AgentPause()
    return s.record(s.tool_call(_entry(agent_id, request, tenant), body.tool, body.expected_s))


@router.post("/v1/agents/{agent_id}/resume", response_model=AgentRecord,
             responses=errors.responses(401, 404, 409))
async def resume_agent(agent_id: str, request: Request, tenant: str = Depends(tenant_of)) -> AgentRecord:
    """The tool call announced by `pause` ended (its length is learned); a no-op when none
    is in progress. 409 once the agent has ended."""
    s = _scheduler(request)
    return s.record(s.tool_call(_entry(agent_id, request, tenant), None))


class _Registration(NamedTuple):
    body: AgentCreate
    metadata_json: bytes | None  # encoded with the body when that was off the event loop


def _parse_registration(raw: bytes, tenant: str, quotas: Quotas) -> _Registration:
    body = parse_body(AgentCreate, raw)
    if not body.metadata or not is_large(raw):
        return _Registration(body, None)  # encoded by `register`, in microseconds
    limit = quotas.metadata_bytes.for_tenant(tenant)
    if limit is not None:  # over the limit: refused without encoding it all
        quotas.check_metadata(tenant, metadata_size_floor(body.metadata, limit), at_least=True)
    return _Registration(body, encode_metadata(body.metadata))


async def _register_directly(request: Request) -> Response:
    """`register_agent`, with a large body parsed, validated and its metadata encoded in a
    worker thread (a 4 MB registration held the event loop for a third of a second)."""
    tenant = await caller(request, rate_limited=True)
    raw = await request.body()
    s = _scheduler(request)
    body, metadata_json = await off_loop_if(is_large(raw), _parse_registration, raw, tenant, s.config.quotas)
    entry = s.register(body.type, body.prompt, tenant, body.metadata, predicted_cost=body.predicted_cost,
                       lease_s=body.lease_s, metadata_json=metadata_json)
    return json_response(s.record(entry), 201)


async def _finish_directly(request: Request) -> Response:
    """`finish_agent`, with a large body parsed in a worker thread."""
    tenant = await caller(request)
    raw = await request.body()
    body = await parsed(AgentFinish, raw) if raw else None
    s = _scheduler(request)
    entry = _entry(request.path_params["agent_id"], request, tenant)
    return json_response(s.record(await s.finish(entry, error=body.error if body is not None else None)))


#: The routes served by the direct handlers above (server/bodies.py says why).
DIRECT = {("POST", "/v1/agents"): _register_directly,
          ("POST", "/v1/agents/{agent_id}/finish"): _finish_directly}


@router.delete("/v1/agents/{agent_id}", response_model=AgentRecord,
               responses=errors.responses(401, 404, 409, 503))
async def cancel_agent(agent_id: str, request: Request, tenant: str = Depends(tenant_of)) -> AgentRecord:
    s = _scheduler(request)
    return s.record(await s.cancel(_entry(agent_id, request, tenant)))


@router.get("/v1/scheduler", tags=["operations"], responses=errors.responses(401))
async def scheduler_snapshot(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """The scheduler's state: summary counts (`agents`, `queued_agents`, requests), the
    engine, the time model, and the head of the queue (at most 50 agents, in the policy's
    order). Its cost is bounded whatever the number of agents."""
    s = _scheduler(request)
    snap = s.snapshot()
    # Other tenants' agents appear in the queue by position only, not by id.
    for item in snap["queue"]:
        entry = s.agents.get(item["agent_id"])
        if entry is None or entry.tenant != tenant:
            item["agent_id"] = None
    return snap


@router.post("/v1/admin/pause", tags=["operations"], responses=errors.responses(401, 403))
async def pause_admission(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """Stop admitting requests (they queue; running ones finish): drain before maintenance."""
    require_admin(request, tenant)
    _scheduler(request).pause()
    return {"paused": True}


@router.post("/v1/admin/resume", tags=["operations"], responses=errors.responses(401, 403))
async def resume_admission(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    require_admin(request, tenant)
    _scheduler(request).resume()
    return {"paused": False}


def _replicas(request: Request) -> ReplicaList:
    engine = _scheduler(request).capabilities.replicas
    if engine is None:
        raise HTTPException(409, "this server runs an in-process engine, which has no replicas "
                                 "(they exist with --ray or --engine-url)")
    return engine


@router.get("/v1/admin/replicas", tags=["operations"],
            responses=errors.responses(401, 403, 409))
async def list_replicas(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """The engine replicas (id, state, KV capacity, reserved tokens, requests in flight) and
    the latest changes of M (when, over how many replicas)."""
    require_admin(request, tenant)
    engine = _replicas(request)
    return {"kv_capacity_tokens": engine.capacity, "replicas": engine.describe_replicas(),
            "capacity_changes": engine.capacity_changes()}


@router.get("/v1/predictors", tags=["operations"], responses=errors.responses(401, 403))
async def list_predictors(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """What predicts each agent type (admin): the operator's trained models, and per tenant
    and type what online learning has seen: sample count, the serving model's kind, the
    recent error of the predictions served, when it last trained and what it decided."""
    require_admin(request, tenant)
    predictors = _scheduler(request).predictors
    describe = getattr(predictors, "describe", None)
    online = getattr(predictors, "online", None)
    return {"retrain_every": online.retrain_every if online is not None else 0,
            "predictors": describe() if describe is not None else []}


#: A page of GET /v1/history holds at most this many bytes (and at least one sample).
MAX_HISTORY_PAGE_BYTES = 16 << 20
#: Rows read from the history at a time while a page streams.
_HISTORY_CHUNK_ROWS = 32


@router.get("/v1/history", tags=["operations"], response_class=StreamingResponse,
            responses={200: {"description": "`{\"samples\": [...], \"next_cursor\": ...}`",
                             "content": {"application/json": {}}},
                       **errors.responses(400, 401)})
async def history_samples(request: Request, tenant: str = Depends(tenant_of),
                          agent_type: str | None = Query(default=None),
                          limit: int = Query(default=10_000, ge=1, le=100_000,
                                             description="At most this many samples (default "
                                                         "10,000, at most 100,000)."),
                          max_bytes: int = Query(default=MAX_HISTORY_PAGE_BYTES, ge=1,
                                                 le=MAX_HISTORY_PAGE_BYTES, description=(
                                                     "At most this many bytes of samples in "
                                                     "the page (default and most 16 MiB); a "
                                                     "page holds at least one sample.")),
                          cursor: str | None = Query(default=None, max_length=32,
                                                     description="`next_cursor` of the page before"),
                          ) -> StreamingResponse:
    """Finished agents of the caller's tenant as predictor training samples, oldest first,
    a page at a time (`next_cursor`: null on the last page). A page ends at `limit` samples
    or `max_bytes`, whichever comes first, and is streamed as it is read."""
    after = _cursor(cursor)
    history = request.app.state.history

    async def page() -> AsyncIterator[bytes]:
        yield b'{"samples": ['
        count, size, last = 0, 0, after
        next_cursor: int | None = None
        while True:
            want = min(_HISTORY_CHUNK_ROWS, limit - count)
            # SQLite reads (and the first one's wait for queued writes) leave the event loop.
            rows = await anyio.to_thread.run_sync(
                functools.partial(history.sample_rows, agent_type, tenant, want + 1, last,
                                  flush=count == 0 and last == after))
            full = False
            for rowid, sample in rows[:want]:
                data = json.dumps(sample).encode()
                if count and size + len(data) + 2 > max_bytes - 64:  # 64: the head and tail
                    full = True
                    break
                yield (b", " if count else b"") + data
                count, size, last = count + 1, size + len(data) + 2, rowid
            if full or (len(rows) > want and count >= limit):
                next_cursor = last
                break
            if len(rows) <= want:
                break
        tail = str(next_cursor) if next_cursor is not None else None
        yield b'], "next_cursor": ' + json.dumps(tail).encode() + b"}"

    return StreamingResponse(page(), media_type="application/json")
