"""Errors as the API reports them: a 4xx (or 503) with `{"detail": "<one sentence>"}`.

FastAPI's own validation errors carry a list of dicts in `detail`; the HTTP contract says
`detail` is a string, so they are flattened into one readable sentence here.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine.base import EngineError, InvalidRequestError
from server.live import AgentConflict, AgentNotFound


def _describe(error: dict) -> str:
    loc = [str(p) for p in error.get("loc", ()) if p not in ("body",)]
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

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return JSONResponse({"detail": f"the body is not valid JSON: {exc}"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=exc.headers)
