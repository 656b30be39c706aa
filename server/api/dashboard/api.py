"""HTTP routes of the dashboard: the page, its static files, and its event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from server.api import errors
from server.api.auth import ADMIN_TENANT, tenant_of
from server.api.dashboard.shared import DashboardStreams, StreamLimitExceeded
from server.runtime.shutdown import FAREWELL, shutdown_of

router = APIRouter()

STATIC = Path(__file__).parent / "static"
# The page's files, by name: nothing else on disk can be asked for.
ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
# The page may load only its own files and talk only to its own server (no CDN, no inline
# script): a key typed into it cannot be sent anywhere else.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

_EVENTS: dict[int | str, dict[str, Any]] = {200: {"description": (
    "Server-sent events: `event: frame` with what changed (at most two a second; the first "
    "frame has `reset: true` and the whole state), `: keep-alive` comments every 15 s when "
    "nothing changes. docs/dashboard.md describes the frame."),
    "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> FileResponse:
    """The page itself needs no key: it asks for one when the server has keys."""
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


@router.get("/dashboard/settings.json", include_in_schema=False)
async def dashboard_settings(request: Request) -> JSONResponse:
    """Whether the page must ask for a key: it asks before its first call, instead of
    drawing a 401 (which browsers log as an error) to find out."""
    return JSONResponse({"keys": bool(request.app.state.config.api_keys)}, headers=_PAGE_HEADERS)


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> FileResponse:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(404, f"no dashboard file {name!r}")
    return FileResponse(STATIC / name, media_type=media_type, headers=_PAGE_HEADERS)


@router.get("/v1/scheduler/events", tags=["operations"], response_class=StreamingResponse,
            responses={**_EVENTS, **errors.responses(401, 429, 503)})
async def scheduler_events(request: Request, tenant: str = Depends(tenant_of)) -> StreamingResponse:
    """The scheduler as it changes, for the dashboard: the queue's top 200 agents in the
    policy's order, KV cache and throughput samples, finished agents. The admin key (or a
    server without keys) sees every agent and its tenant; a tenant's key sees its own
    agents only, with their position in the whole queue. Each tenant may hold
    `--max-dashboard-streams` streams (default 8); one more gets a 429. The frames of a
    tenant are built once per tick and shared by all its streams."""
    streams: DashboardStreams | None = getattr(request.app.state, "dashboard_streams", None)
    if streams is None:
        raise HTTPException(503, "the server is starting")
    admin = not request.app.state.config.api_keys or tenant == ADMIN_TENANT
    try:
        release = streams.reserve(tenant)
    except StreamLimitExceeded as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
    stream = shutdown_of(request.app).until_closing(streams.stream(tenant, admin), FAREWELL)
    return _CountedStream(stream, release, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _CountedStream(StreamingResponse):
    """A stream that gives back its place among the tenant's streams when it ends, however
    it ends (even a client gone before the first byte)."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
