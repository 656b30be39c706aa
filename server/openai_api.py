"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.routing import request_response

from server import errors
from server.agents import AgentEntry
from server.auth import bearer_scheme, rate_limited_tenant, tenant_of
from server.disconnect import ClientDisconnected, run_unless_disconnected
from server.engine.base import EngineOutput, SamplingOptions
from server.limits import check_request_size
from server.openai_schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    Usage,
    new_id,
    now_s,
    streamed_or,
)
from server.service import InferenceService, PreparedRequest, render_chat

router = APIRouter()

AGENT_HEADER = "X-Justitia-Agent"


def _service(request: Request) -> InferenceService:
    return request.app.state.service


def _sampling(body: SamplingFields) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=body.max_tokens or 16,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop_tuple(),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
    )


def _check_model(service: InferenceService, body: SamplingFields) -> None:
    if body.model is not None and body.model != service.model_name:
        raise HTTPException(
            404, f"model {body.model!r} is not served here; this server serves {service.model_name!r}"
        )


def _usage(out: EngineOutput) -> dict:
    return Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.output_tokens,
        total_tokens=out.prompt_tokens + out.output_tokens,
    ).model_dump()


async def _final(service: InferenceService, prepared: PreparedRequest, agent: AgentEntry) -> EngineOutput:
    last: EngineOutput | None = None
    async for out in service.stream(prepared, agent):
        last = out
    assert last is not None and last.finished
    return last


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # headers are sent: report the error in the stream
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': type(exc).__name__}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _start(request: Request, body: SamplingFields, prompt: str | list[int], text: str,
           agent_header: str | None, tenant: str, id_prefix: str,
           ) -> tuple[InferenceService, PreparedRequest, AgentEntry]:
    """Validate, tokenize and find the request's agent: everything before it may wait."""
    service = _service(request)
    _check_model(service, body)
    prepared = service.prepare(new_id(id_prefix), prompt, _sampling(body))
    check_request_size(request.app.state.request_size_limits, tenant,
                       len(prepared.prompt_token_ids), prepared.sampling.max_tokens)
    agent = service.agent_for(_agent_id(agent_header, body), tenant, prepared, text)
    return service, prepared, agent


def _agent_id(header: str | None, body: SamplingFields) -> str | None:
    if header and body.agent_id and header != body.agent_id:
        raise HTTPException(400, f"the {AGENT_HEADER} header ({header}) and the body's agent_id "
                                 f"({body.agent_id}) name different agents")
    return header or body.agent_id


_INFERENCE_ERRORS = errors.responses(400, 401, 404, 409, 413, 429, 503)


@router.get("/v1/models", responses=errors.responses(401))
async def list_models(request: Request, tenant: str = Depends(tenant_of)) -> dict:
    service = _service(request)
    info = service.engine.info
    return {
        "object": "list",
        "data": [
            {
                "id": service.model_name,
                "object": "model",
                "created": now_s(),
                "owned_by": "justitia",
                "max_model_len": info.max_model_len,
            }
        ],
    }


@router.post("/v1/completions",
             responses={**streamed_or(CompletionResponse, "the completion"), **_INFERENCE_ERRORS})
async def completions(
    body: CompletionRequest,
    request: Request,
    x_justitia_agent: str | None = Header(default=None),
    tenant: str = Depends(rate_limited_tenant),
) -> Response:
    text = body.prompt if isinstance(body.prompt, str) else ""
    service, prepared, agent = _start(request, body, body.prompt, text, x_justitia_agent,
                                      tenant, "cmpl")
    rid = prepared.request_id
    created = now_s()

    def chunk(text: str, finish: str | None, out: EngineOutput | None = None) -> dict:
        c = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": service.model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
        if out is not None:
            c["usage"] = _usage(out)
        return c

    if body.stream:

        async def chunks() -> AsyncIterator[dict]:
            async for out in service.stream(prepared, agent):
                if out.delta_text or out.finished:
                    yield chunk(out.delta_text, out.finish_reason if out.finished else None,
                                out if out.finished else None)

        return _sse(chunks())

    try:
        out = await run_unless_disconnected(request, lambda: _final(service, prepared, agent))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(chunk(out.text, out.finish_reason, out))


@router.post("/v1/chat/completions",
             responses={**streamed_or(ChatCompletionResponse, "the chat completion"),
                        **_INFERENCE_ERRORS})
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    x_justitia_agent: str | None = Header(default=None),
    tenant: str = Depends(rate_limited_tenant),
) -> Response:
    tokenizer = getattr(_service(request).engine, "_tokenizer", None)
    prompt = render_chat([m.model_dump() for m in body.messages], tokenizer)
    service, prepared, agent = _start(request, body, prompt, prompt, x_justitia_agent,
                                      tenant, "chatcmpl")
    rid = prepared.request_id
    created = now_s()

    if body.stream:

        async def chunks() -> AsyncIterator[dict]:
            first = True
            async for out in service.stream(prepared, agent):
                delta: dict = {"content": out.delta_text}
                if first:
                    delta["role"] = "assistant"
                    first = False
                c = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": service.model_name,
                    "choices": [{"index": 0, "delta": delta,
                                 "finish_reason": out.finish_reason if out.finished else None}],
                }
                if out.finished:
                    c["usage"] = _usage(out)
                yield c

        return _sse(chunks())

    try:
        out = await run_unless_disconnected(request, lambda: _final(service, prepared, agent))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": service.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": out.text},
                    "finish_reason": out.finish_reason,
                }
            ],
            "usage": _usage(out),
        }
    )


# -- the inference hot path --------------------------------------------------------------
# FastAPI's per-call machinery (dependency solving, header parameters, JSON decoding then
# validation in two passes) cost ~70 us of the ~1.6 ms of CPU the API process spends per
# completion (measured: 95 us against 23 us for the same body and checks on a plain
# Starlette handler). At 128 requests in flight the API process shares a saturated core, so
# that CPU becomes latency. The two inference routes keep their FastAPI declarations (the
# OpenAPI document, fuzzing, clients see them unchanged) but are served by the handlers
# below, which do the same steps directly and call the same endpoint functions.


def _parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc
    if any(e["type"] == "json_invalid" for e in error.errors()):
        # pydantic's parser refuses some text Python's takes (a lone UTF-16 surrogate);
        # through Python's, the body validator names the field at fault, as it did before.
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # nesting past Python's recursion limit
            pass
        else:
            try:
                return model.model_validate(data)
            except ValidationError as exc:
                error = exc
    # the locations FastAPI would give, so that the 400 names the same fields
    raise RequestValidationError(
        [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)])


async def _tenant(request: Request) -> str:
    # the same bearer scheme object and checks as the FastAPI dependency, called directly
    return await rate_limited_tenant(request, await tenant_of(request, await bearer_scheme(request)))


def _direct(model: type[BaseModel], endpoint: Callable[..., Awaitable[Response]]):
    async def handle(request: Request) -> Response:
        body = _parse(model, await request.body())
        tenant = await _tenant(request)
        return await endpoint(body, request, request.headers.get(AGENT_HEADER), tenant)

    return handle


_FAST = {"/v1/completions": _direct(CompletionRequest, completions),
         "/v1/chat/completions": _direct(ChatCompletionRequest, chat_completions)}


def install_fast_paths(app: FastAPI) -> None:
    """Serve the inference routes of `app` with the direct handlers above."""
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.path in _FAST and "POST" in route.methods:
            route.app = request_response(_FAST[route.path])
