"""Errors as the API reports them: a 4xx (or 503) with `{"detail": "<one sentence>"}`.

FastAPI's own validation errors carry a list of dicts in `detail`; the HTTP contract says
`detail` is a string, so they are flattened into one readable sentence here.

On the OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models) the body also has
OpenAI's `{"error": {"message", "type", "param", "code"}}`, the shape OpenAI's clients read
their exception's message from (with `detail` alone the official client said only
"Error code: 400"); `detail` stays, with the same sentence, for what reads the contract's
shape (Justitia's SDK).
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
from server.runtime.data_dir import HistoryUnwritable
from server.runtime.lifecycle import AgentConflict, AgentNotFound
from server.runtime.limits import QuotaExceeded, TooLarge

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_tag(part: object) -> bool:
    """Pydantic names the member of a union in the error location ('constrained-str',
    'list[constrained-int]'); the caller needs the field, not our types."""
    text = str(part)
    return isinstance(part, str) and (
        text in _TYPE_TAGS or "[" in text or text.startswith(("constrained-", "function-")))


class ErrorBody(BaseModel):
    detail: str


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(ErrorBody):
    """The error body of the OpenAI routes: `detail` and OpenAI's `error`, same message."""

    error: OpenAIError


OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")

# OpenAI's error types by status (its API's own names), and the codes it gives.
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
                499: "invalid_request_error", 503: "service_unavailable_error"}
_OPENAI_CODE = {401: "invalid_api_key", 413: "request_too_large",
                429: "rate_limit_exceeded", 503: "engine_unavailable"}


class FieldHTTPException(StarletteHTTPException):
    """An HTTP error about one request field (OpenAI's `param`), with OpenAI's `code`."""

    def __init__(self, status: int, detail: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(status, detail)
        self.param = param
        self.code = code


def is_openai_path(path: str) -> bool:
    return path in OPENAI_PATHS or path.startswith("/v1/models/")


def openai_error(status: int, message: str, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for a status and message."""
    return {"message": message, "type": _OPENAI_TYPE.get(status, "server_error"),
            "param": param, "code": code or _OPENAI_CODE.get(status)}


def error_response(path: str, status: int, message: str, *, param: str | None = None,
                   code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The error answer of a route: `detail`, and OpenAI's `error` on the OpenAI routes."""
    body: dict[str, Any] = {"detail": message}
    if is_openai_path(path):
        body["error"] = openai_error(status, message, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


_MEANING = {
    400: "Bad input: a malformed body, a bad field, a request over the context or the "
         "tenant's --max-request-tokens.",
    401: "Missing or wrong API key (only when the server has keys).",
    403: "The call needs the key of the tenant named 'admin'.",
    404: "Unknown agent (or another tenant's), unknown model, or unknown replica.",
    409: "The agent has ended (finished, cancelled, expired), or the call does not apply to "
         "this server's engine.",
    413: "The body is over the server's size limit, or the agent's metadata over "
         "--max-metadata-bytes (or its prompt and metadata over the tenant's whole "
         "--max-agent-bytes).",
    429: "The tenant is over its --rate-limit, --max-agents or --max-queued; retry after "
         "Retry-After seconds.",
    503: "The engine is not running; or, on finish and cancel, the history cannot be "
         "written (the agent's end is not acknowledged: retry once readiness is back).",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "integer"}}}


def responses(*codes: int, openai: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route can give, for `responses=`."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": OpenAIErrorBody if openai else ErrorBody,
                     "description": _MEANING[code]}
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


def validation_param(exc: RequestValidationError) -> str | None:
    """The body field the first error is about (OpenAI's `param`), if it is about one."""
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        if loc:
            return loc[0]
    return None


# Our own errors carry a one-sentence message; only the status differs.
_STATUS: dict[type[Exception], int] = {
    InvalidRequestError: 400,
    AgentNotFound: 404,
    AgentConflict: 409,
    TooLarge: 413,
    EngineError: 503,
    HistoryUnwritable: 503,
}


def status_of(exc: Exception) -> int:
    """The status an error of ours is answered with (500: not one of ours)."""
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code
    return next((status for t, status in _STATUS.items() if isinstance(exc, t)), 500)


def _as_status(status: int):
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request.url.path, status, str(exc),
                              param=getattr(exc, "param", None))

    return handler


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, 400, validation_message(exc),
                              param=validation_param(exc))

    for exc_type, status in _STATUS.items():
        app.add_exception_handler(exc_type, _as_status(status))

    @app.exception_handler(QuotaExceeded)
    async def _quota(request: Request, exc: QuotaExceeded) -> JSONResponse:
        return error_response(request.url.path, 429, str(exc), code="quota_exceeded",
                              headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(request.url.path, 400, f"the body is not valid JSON: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:
            allowed = allowed_methods(request)
            detail = f"{request.method} is not allowed here; allowed: {', '.join(allowed)}"
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        return error_response(request.url.path, exc.status_code, detail, headers=headers,
                              param=getattr(exc, "param", None), code=getattr(exc, "code", None))


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
