"""Errors as the API reports them: a 4xx (or 503) with `{"detail": "<one sentence>"}`.

FastAPI's own validation errors carry a list of dicts in `detail`; the HTTP contract says
`detail` is a string, so they are flattened into one readable sentence here.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from server.engine.base import EngineError, InvalidRequestError
from server.limits import QuotaExceeded
from server.live import AgentConflict, AgentNotFound


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_tag(part: object) -> bool:
    """Pydantic names the member of a union in the error location ('constrained-str',
    'list[constrained-int]'); the caller needs the field, not our types."""
    text = str(part)
    return isinstance(part, str) and (
        text in _TYPE_TAGS or "[" in text or text.startswith(("constrained-", "function-")))


class ErrorBody(BaseModel):
    detail: str


_MEANING = {
    400: "Bad input: a malformed body, a bad field, a request over the context or the "
         "tenant's --max-request-tokens.",
    401: "Missing or wrong API key (only when the server has keys).",
    403: "The call needs the key of the tenant named 'admin'.",
    404: "Unknown agent (or another tenant's), unknown model, or unknown replica.",
    409: "The agent has ended (finished, cancelled, expired), or the call does not apply to "
         "this server's engine.",
    413: "The body is over the server's size limit.",
    429: "The tenant is over its --rate-limit, --max-agents or --max-queued; retry after "
         "Retry-After seconds.",
    503: "The engine is not running.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "integer"}}}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route can give, for `responses=`."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": ErrorBody, "description": _MEANING[code]}
        if code == 429:
            out[code]["headers"] = _RETRY_AFTER
    return out


def document_errors_as_sent(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with parameters; this server answers bad
    input with 400 (`install` below), so the 422 entries are dropped from the schema."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe(error: dict) -> str:
    loc = [str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    where = ".".join(loc)
    if error.get("type") == "json_invalid":
        return f"the body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
    msg = error.get("msg", "invalid value")
    return f"{where}: {msg}" if where else msg


def validation_message(exc: RequestValidationError) -> str:
    return "; ".join(_describe(e) for e in exc.errors()) or "invalid request"


# Our own errors carry a one-sentence message; only the status differs.
_STATUS: dict[type[Exception], int] = {
    InvalidRequestError: 400,
    AgentNotFound: 404,
    AgentConflict: 409,
    EngineError: 503,
}


def _as_status(status: int):
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status)

    return handler


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_message(exc)}, status_code=400)

    for exc_type, status in _STATUS.items():
        app.add_exception_handler(exc_type, _as_status(status))

    @app.exception_handler(QuotaExceeded)
    async def _quota(_: Request, exc: QuotaExceeded) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=429,
                            headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return JSONResponse({"detail": f"the body is not valid JSON: {exc}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:
            allowed = allowed_methods(request)
            detail = f"{request.method} is not allowed here; allowed: {', '.join(allowed)}"
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path. Starlette's 405 names only the methods of
    the first route that matched the path, and /v1/agents, say, is one route per method."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        route_methods = getattr(route, "methods", None)
        # PARTIAL: the path matches and the method does not; FULL: both match
        if route_methods and route.matches(request.scope)[0] != Match.NONE:
            methods |= route_methods
    return sorted(methods)
