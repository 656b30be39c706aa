"""Request bodies parsed off the event loop when they are large.

FastAPI parses and validates a route's body on the event loop, before the endpoint runs:
for a 4 MB body that is a third of a second on an idle core (JSON parsing, the checks of
server/api/validation.py, pydantic), seconds on a loaded one, during which no other client is
answered, health checks included. The routes that take large bodies (completions, chats,
agent registrations, finishes) keep their FastAPI declarations (the OpenAPI document and
clients see them unchanged) but are served by direct handlers that read the body, parse
and validate it in a worker thread when it is over `OFF_LOOP_BYTES` (on the loop below it,
where a thread's hand-off would cost more than the parse), then call the same endpoint.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.routing import request_response

from server.api.auth import bearer_scheme, rate_limited_tenant, tenant_of
from server.api.validation import MAX_JSON_DEPTH
from server.runtime.service import off_loop_if

#: Bodies larger than this are parsed and validated in a worker thread.
OFF_LOOP_BYTES = 256 * 1024

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request], Awaitable[Response]]


def parse_body(model: type[M], raw: bytes) -> M:
    """`raw` as `model`, or the RequestValidationError FastAPI would raise (a 400 naming
    the fields at fault)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc
    if any(e["type"] == "json_invalid" for e in error.errors()):
        # pydantic's parser refuses some text Python's takes (a lone UTF-16 surrogate);
        # through Python's, the body validator names the field at fault.
        try:
            data = json.loads(raw)
        except RecursionError:  # nesting past Python's recursion limit (and pydantic's)
            raise RequestValidationError([{
                "type": "value_error", "loc": ("body",), "input": None,
                "msg": f"JSON nested deeper than {MAX_JSON_DEPTH} levels is not accepted"}]) from None
        except ValueError:
            pass
        else:
            try:
                return model.model_validate(data)
            except ValidationError as exc:
                error = exc
    # the locations FastAPI would give, so that the 400 names the same fields
    raise RequestValidationError(
        [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)])


def is_large(raw: bytes) -> bool:
    return len(raw) > OFF_LOOP_BYTES


async def parsed(model: type[M], raw: bytes) -> M:
    """`parse_body(model, raw)`, in a worker thread when `raw` is large."""
    return await off_loop_if(is_large(raw), parse_body, model, raw)


async def caller(request: Request, *, rate_limited: bool = False) -> str:
    """The caller's tenant, with the same checks as the FastAPI dependencies (`tenant_of`,
    and `rate_limited_tenant` for calls the rate limit counts)."""
    tenant = await tenant_of(request, await bearer_scheme(request))
    return await rate_limited_tenant(request, tenant) if rate_limited else tenant


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code, media_type="application/json")


def serve_directly(app: FastAPI, handlers: dict[tuple[str, str], Handler]) -> None:
    """Serve the routes of `app` named by (method, path) in `handlers` with those handlers."""
    for route in app.router.routes:
        if not isinstance(route, APIRoute):
            continue
        for method in route.methods:
            handler = handlers.get((method, route.path))
            if handler is not None:
                route.app = request_response(handler)
