"""The agent API: register, inspect, watch, finish and cancel agents."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from server.agents import AgentEntry, AgentRecord
from server.auth import tenant_of
from server.engine.base import EngineError
from server.live import LiveScheduler

router = APIRouter(tags=["agents"])

MAX_PROMPT_CHARS = 1_000_000


class AgentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:\-]+$",
                      description="Agent type: selects the cost predictor.")
    prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS,
                        description="The text the cost predictor sees.")
    metadata: dict[str, Any] = Field(default_factory=dict)
    predicted_cost: float | None = Field(
        default=None, ge=0, allow_inf_nan=False,
        description=("The agent's total KV token-time cost, when the caller knows it (trace "
                     "replays, oracle benchmarks). Default: the server's predictor. Declaring "
                     "too little gains nothing: over-runs are charged as requests arrive."))
    lease_s: float | None = Field(
        default=None, gt=0, le=86_400,
        description="Expire the agent after this many idle seconds (default: the server's lease).")


class AgentList(BaseModel):
    agents: list[AgentRecord]


def _scheduler(request: Request) -> LiveScheduler:
    return request.app.state.scheduler


def _entry(agent_id: str, request: Request, tenant: str) -> AgentEntry:
    return _scheduler(request).get(agent_id, tenant)


@router.post("/v1/agents", status_code=201, response_model=AgentRecord)
async def register_agent(body: AgentCreate, request: Request,
                         tenant: str = Depends(tenant_of)) -> AgentRecord:
    s = _scheduler(request)
    entry = s.register(body.type, body.prompt, tenant, body.metadata,
                       predicted_cost=body.predicted_cost, lease_s=body.lease_s)
    return s.record(entry)


@router.get("/v1/agents", response_model=AgentList)
async def list_agents(request: Request, tenant: str = Depends(tenant_of),
                      state: str | None = Query(default=None)) -> AgentList:
    s = _scheduler(request)
    entries = [e for e in s.list(tenant) if state is None or e.state == state]
    return AgentList(agents=[s.record(e) for e in entries])


@router.get("/v1/agents/{agent_id}", response_model=AgentRecord)
async def get_agent(agent_id: str, request: Request, tenant: str = Depends(tenant_of)) -> AgentRecord:
    return _scheduler(request).record(_entry(agent_id, request, tenant))


@router.get("/v1/agents/{agent_id}/events")
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

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.post("/v1/agents/{agent_id}/finish", response_model=AgentRecord)
async def finish_agent(agent_id: str, request: Request, tenant: str = Depends(tenant_of)) -> AgentRecord:
    s = _scheduler(request)
    return s.record(await s.finish(_entry(agent_id, request, tenant)))


@router.delete("/v1/agents/{agent_id}", response_model=AgentRecord)
async def cancel_agent(agent_id: str, request: Request, tenant: str = Depends(tenant_of)) -> AgentRecord:
    s = _scheduler(request)
    return s.record(await s.cancel(_entry(agent_id, request, tenant)))


@router.get("/v1/scheduler", tags=["operations"])
async def scheduler_snapshot(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    snap = _scheduler(request).snapshot()
    # Other tenants' agents appear in the queue by position only, not by id.
    own = {e.id for e in _scheduler(request).list(tenant)}
    for item in snap["queue"]:
        if item["agent_id"] not in own:
            item["agent_id"] = None
    return snap


def _require_admin(request: Request, tenant: str) -> None:
    if request.app.state.config.api_keys and tenant != "admin":
        raise HTTPException(403, "admin calls need the key of the tenant named 'admin'")


@router.post("/v1/admin/pause", tags=["operations"])
async def pause_admission(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """Stop admitting requests (they queue; running ones finish): drain before maintenance."""
    _require_admin(request, tenant)
    _scheduler(request).pause()
    return {"paused": True}


@router.post("/v1/admin/resume", tags=["operations"])
async def resume_admission(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    _require_admin(request, tenant)
    _scheduler(request).resume()
    return {"paused": False}


class ReplicaRef(BaseModel):
    url: str = Field(min_length=1, max_length=2048, description="A vLLM OpenAI server's base URL.")


def _replicas(request: Request):
    engine = _scheduler(request).engine
    if not hasattr(engine, "add_replica"):
        raise HTTPException(409, "this server runs an in-process engine; replicas exist only "
                                 "with --engine-url")
    return engine


@router.get("/v1/admin/replicas", tags=["operations"])
async def list_replicas(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """The engine replicas: capacity, reservations, requests in flight, health."""
    _require_admin(request, tenant)
    engine = _replicas(request)
    return {"kv_capacity_tokens": engine.capacity, "replicas": engine.describe_replicas()}


@router.post("/v1/admin/replicas", tags=["operations"], status_code=201)
async def add_replica(body: ReplicaRef, request: Request, tenant: str = Depends(tenant_of)) -> dict:
    """Serve from one more vLLM replica (same model and block size): M grows by its KV
    capacity and the virtual clock's rate with it."""
    _require_admin(request, tenant)
    engine = _replicas(request)
    try:
        return await engine.add_replica(body.url)
    except EngineError as exc:
        raise HTTPException(400, str(exc)) from exc


@router.delete("/v1/admin/replicas", tags=["operations"])
async def remove_replica(request: Request, tenant: str = Depends(tenant_of),
                         url: str = Query(min_length=1, max_length=2048)) -> dict:
    """Stop sending requests to a replica: M shrinks now, the replica leaves once its
    requests in flight have finished."""
    _require_admin(request, tenant)
    engine = _replicas(request)
    try:
        return engine.remove_replica(url)
    except LookupError as exc:
        raise HTTPException(404, str(exc)) from exc


@router.get("/v1/history", tags=["operations"])
async def history_samples(request: Request, tenant: str = Depends(tenant_of),
                          agent_type: str | None = Query(default=None),
                          limit: int = Query(default=10_000, ge=1, le=100_000)) -> dict:
    """Finished agents of the caller's tenant as predictor training samples."""
    history = request.app.state.history
    return {"samples": history.samples(agent_type, tenant=tenant, limit=limit)}
