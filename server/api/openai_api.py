"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from server.api import errors
from server.api.auth import rate_limited_tenant, tenant_of
from server.api.bodies import caller, is_large, parsed
from server.api.disconnect import ClientDisconnected, run_unless_disconnected
from server.api.openai_schemas import (
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
from server.api.request_limits import RequestLimits, check_messages, check_schema, check_stop
from server.api.sessions import session_of
from server.api.tool_calls import ToolCallParser, ToolPlan, plan_tools
from server.engine.base import EngineError, EngineOutput, SamplingOptions, SequenceOutput, TokenLogprob
from server.runtime.agents import AgentEntry
from server.runtime.limits import check_request_size
from server.runtime.service import InferenceService, PreparedRequest, off_loop_if, render_chat
from server.runtime.shutdown import SHUTTING_DOWN, Shutdown, shutdown_of

router = APIRouter()

AGENT_HEADER = "X-Justitia-Agent"


def _service(request: Request) -> InferenceService:
    return request.app.state.service


def _sampling(body: SamplingFields, json_schema: str | None = None) -> SamplingOptions:
    """The engine's options; `json_schema` (a forced tool call's grammar) replaces the
    response format's."""
    limit = body.output_limit()
    return SamplingOptions(
        # no limit given: `prepare` sets the rest of the context (fill_context)
        max_tokens=limit if limit is not None else 1,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop_tuple(),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        n=body.n,
        logprobs=body.logprobs_k(),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        json_object=body.json_object(),
        json_schema=json_schema if json_schema is not None else body.json_schema_text(),
    )


def _check_model(service: InferenceService, body: SamplingFields) -> None:
    if body.model is not None and body.model != service.model_name:
        raise errors.FieldHTTPException(
            404, f"model {body.model!r} is not served here; this server serves {service.model_name!r}",
            param="model", code="model_not_found")


def _usage(out: EngineOutput) -> dict:
    usage = Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.output_tokens,
        total_tokens=out.prompt_tokens + out.output_tokens,
    ).model_dump(exclude_none=True)
    if out.cached_tokens is not None:  # OpenAI's field: prompt tokens served from the prefix cache
        usage["prompt_tokens_details"] = {"cached_tokens": out.cached_tokens}
    return usage


@dataclass
class _Final:
    """A finished request: its last output and each sequence's token log probabilities."""

    out: EngineOutput
    logprobs: dict[int, list[TokenLogprob]]


async def _final(service: InferenceService, prepared: PreparedRequest, agent: AgentEntry) -> _Final:
    last: EngineOutput | None = None
    logprobs: dict[int, list[TokenLogprob]] = defaultdict(list)
    async for out in service.stream(prepared, agent):
        last = out
        for q in out.sequences:
            logprobs[q.index].extend(q.delta_logprobs)
    assert last is not None and last.finished
    return _Final(last, logprobs)


class _News:
    """What each streamed output adds, per sequence: new text or tokens, or its end."""

    def __init__(self) -> None:
        self.ended: set[int] = set()
        self.started: set[int] = set()

    def of(self, out: EngineOutput) -> list[tuple[SequenceOutput, str | None, bool]]:
        """(sequence, its finish reason if it just ended, whether it is its first chunk)."""
        news = []
        for q in out.each():
            ends = q.finish_reason is not None and q.index not in self.ended
            if ends or q.delta_text or q.delta_logprobs:
                first = q.index not in self.started
                self.started.add(q.index)
                if ends:
                    self.ended.add(q.index)
                news.append((q, q.finish_reason if ends else None, first))
        return news


def _completion_logprobs(tokens: Sequence[TokenLogprob], offset: int) -> dict:
    """OpenAI's legacy completions logprobs; `offset`: the text length before these tokens."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens],
            "text_offset": offsets}


def _chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
                        for t in tokens]}


def _sse(chunks: AsyncGenerator[dict, None], shutdown: Shutdown) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(chunks) as each:
                async for chunk in each:
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if shutdown.drain_over:  # the grace period for requests in flight is over
                        raise EngineError(SHUTTING_DOWN)
        except Exception as exc:  # headers are sent: report the error in the stream
            error = errors.openai_error(errors.status_of(exc), str(exc),
                                        getattr(exc, "param", None))
            yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _start(request: Request, body: SamplingFields, prompt: str | list[int], text: str,
                 agent_header: str | None, tenant: str, id_prefix: str, json_schema: str | None = None,
                 ) -> tuple[InferenceService, PreparedRequest, AgentEntry]:
    """Validate, tokenize and find the request's agent: everything before it may wait."""
    service = _service(request)
    _check_model(service, body)
    await check_request_limits(request, body, json_schema)
    limits = request.app.state.request_size_limits
    prepared = await service.prepare_async(new_id(id_prefix), prompt, _sampling(body, json_schema),
                                           fill_context=body.output_limit() is None,
                                           token_cap=limits.for_tenant(tenant))
    check_request_size(limits, tenant, len(prepared.prompt_token_ids),
                       prepared.sampling.max_tokens)
    agent_id = _agent_id(agent_header, body)
    session = session_of(request.headers) if agent_id is None else None
    agent = service.agent_for(agent_id, tenant, prepared, text, session)
    return service, prepared, agent


#: A schema longer than this is checked in a worker thread, off the event loop.
OFF_LOOP_SCHEMA_BYTES = 16 * 1024
#: A chat of more messages than this is rendered in a worker thread, off the event loop.
OFF_LOOP_MESSAGES = 1000
#: The status logged for a request whose client went away before the answer (nginx's
#: "client closed request"; nobody receives it).
CLIENT_CLOSED = 499


async def check_request_limits(request: Request, body: SamplingFields, tool_schema: str | None = None) -> None:
    """The limits of server/api/request_limits.py, before any work: stop sequences, then the
    JSON schema's size and structure, then its grammar, compiled under the time budget. A
    forced tool call's schema (`tool_schema`, built from the tools' parameters) is checked as
    a response format's is: a caller's function parameters are a schema of the caller's."""
    limits: RequestLimits = request.app.state.limits
    check_stop(body.stop_tuple(), limits)
    schema = tool_schema if tool_schema is not None else body.json_schema_text()
    param = "tools" if tool_schema is not None else "response_format"
    if schema is not None:
        await off_loop_if(len(schema) > OFF_LOOP_SCHEMA_BYTES, check_schema, schema, limits, param)
        await request.app.state.grammars.check(schema)


def _agent_id(header: str | None, body: SamplingFields) -> str | None:
    if header and body.agent_id and header != body.agent_id:
        raise errors.FieldHTTPException(
            400, f"the {AGENT_HEADER} header ({header}) and the body's agent_id "
                 f"({body.agent_id}) name different agents", param="agent_id")
    return header or body.agent_id


_INFERENCE_ERRORS = errors.responses(400, 401, 404, 409, 413, 429, 503, openai=True)


@router.get("/v1/models", responses=errors.responses(401, openai=True))
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
    service, prepared, agent = await _start(request, body, body.prompt, text, x_justitia_agent,
                                      tenant, "cmpl")
    rid = prepared.request_id
    created = now_s()
    with_logprobs = prepared.sampling.logprobs is not None

    def chunk(choices: list[dict], out: EngineOutput | None = None) -> dict:
        c = {"id": rid, "object": "text_completion", "created": created,
             "model": service.model_name, "choices": choices}
        if out is not None:
            c["usage"] = _usage(out)
        return c

    if body.stream:

        async def chunks() -> AsyncGenerator[dict, None]:
            news, offsets = _News(), defaultdict[int, int](int)
            async for out in service.stream(prepared, agent):
                choices = []
                for q, finish, _ in news.of(out):
                    lp = None
                    if with_logprobs:
                        lp = _completion_logprobs(q.delta_logprobs, offsets[q.index])
                        offsets[q.index] += sum(len(t.token) for t in q.delta_logprobs)
                    choices.append({"index": q.index, "text": q.delta_text, "logprobs": lp,
                                    "finish_reason": finish})
                if choices or out.finished:
                    yield chunk(choices, out if out.finished else None)

        return _sse(chunks(), shutdown_of(request.app))

    try:
        final = await run_unless_disconnected(request, lambda: _final(service, prepared, agent))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    out = final.out
    return JSONResponse(chunk(
        [{"index": q.index, "text": q.text,
          "logprobs": _completion_logprobs(final.logprobs[q.index], 0) if with_logprobs else None,
          "finish_reason": q.finish_reason} | ({"token_ids": list(q.token_ids)} if body.return_token_ids else {})
         for q in out.each()],
        out))


@router.post("/v1/chat/completions",
             responses={**streamed_or(ChatCompletionResponse, "the chat completion"),
                        **_INFERENCE_ERRORS})
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    x_justitia_agent: str | None = Header(default=None),
    tenant: str = Depends(rate_limited_tenant),
) -> Response:
    check_messages(len(body.messages), request.app.state.limits)
    parser: ToolCallParser | None = request.app.state.tool_parser
    plan = plan_tools(body.functions(), body.tool_choice_value(), body.parallel_tool_calls,
                      parser.name if parser is not None else None)
    tools = [{"type": "function", "function": f} for f in body.functions()] or None
    prompt = await off_loop_if(len(body.messages) > OFF_LOOP_MESSAGES, render_chat,
                               [m.for_template() for m in body.messages], _service(request).engine, tools)
    service, prepared, agent = await _start(request, body, prompt, prompt, x_justitia_agent,
                                            tenant, "chatcmpl", plan.json_schema())
    rid = prepared.request_id
    created = now_s()
    with_logprobs = prepared.sampling.logprobs is not None

    def chunk(choices: list[dict], out: EngineOutput | None) -> dict:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created,
             "model": service.model_name, "choices": choices}
        if out is not None:
            c["usage"] = _usage(out)
        return c

    if body.stream:

        async def chunks() -> AsyncGenerator[dict, None]:
            news = _News()
            deltas = _ToolDeltas(plan, parser)
            async for out in service.stream(prepared, agent):
                choices = []
                for q, finish, first in news.of(out):
                    delta, finish = deltas.of(q, finish, first)
                    if first:
                        delta["role"] = "assistant"
                    choices.append({"index": q.index, "delta": delta,
                                    "logprobs": (_chat_logprobs(q.delta_logprobs)
                                                 if with_logprobs else None),
                                    "finish_reason": finish})
                if choices or out.finished:
                    yield chunk(choices, out if out.finished else None)

        return _sse(chunks(), shutdown_of(request.app))

    try:
        final = await run_unless_disconnected(request, lambda: _final(service, prepared, agent))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    out = final.out
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": service.model_name,
            "choices": [
                {
                    "index": q.index,
                    **_answer(plan, parser, q.text, q.finish_reason),
                    "logprobs": _chat_logprobs(final.logprobs[q.index]) if with_logprobs else None,
                }
                for q in out.each()
            ],
            "usage": _usage(out),
        }
    )


def _answer(plan: ToolPlan, parser: ToolCallParser | None, text: str, finish: str | None) -> dict:
    """A finished sequence's `message` and `finish_reason`: the tool calls it made, if any."""
    if not plan.calls_tools:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish}
    content, calls = plan.calls(text, parser)
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        finish = "tool_calls" if finish == "stop" else finish
    return {"message": message, "finish_reason": finish}


class _ToolDeltas:
    """Each streamed sequence's `delta`. A named function's arguments stream as they are
    generated (the grammar makes them its whole answer); a `required` list or a parser's
    reading needs the whole answer, so those calls come in the sequence's last chunk."""

    def __init__(self, plan: ToolPlan, parser: ToolCallParser | None) -> None:
        self.plan, self.parser = plan, parser
        self.texts: dict[int, str] = defaultdict(str)
        self.call_ids: dict[int, str] = {}

    def of(self, q: SequenceOutput, finish: str | None, first: bool) -> tuple[dict, str | None]:
        if not self.plan.calls_tools:
            return {"content": q.delta_text}, finish
        if self.plan.mode == "named":
            entry: dict = {"index": 0, "function": {"arguments": q.delta_text}}
            if first:
                self.call_ids[q.index] = new_id("call")
                entry |= {"id": self.call_ids[q.index], "type": "function",
                          "function": {"name": self.plan.name, "arguments": q.delta_text}}
            return {"tool_calls": [entry]}, ("tool_calls" if finish == "stop" else finish)
        self.texts[q.index] += q.delta_text
        if finish is None:
            return {}, None
        answer = _answer(self.plan, self.parser, self.texts[q.index], finish)
        message, delta = answer["message"], {}
        if message["content"]:
            delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        return delta, answer["finish_reason"]


# -- the inference hot path --------------------------------------------------------------
# FastAPI's per-call machinery (dependency solving, header parameters, JSON decoding then
# validation in two passes) cost ~70 us of the ~1.6 ms of CPU the API process spends per
# completion (measured: 95 us against 23 us for the same body and checks on a plain
# Starlette handler). At 128 requests in flight the API process shares a saturated core, so
# that CPU becomes latency. The two inference routes keep their FastAPI declarations (the
# OpenAPI document, fuzzing, clients see them unchanged) but are served by the handlers
# below, which do the same steps directly and call the same endpoint functions.


def _precheck(raw: bytes, limits: RequestLimits) -> None:
    """The count limits on a large body's plain JSON, before the model validates it."""
    if (raw.count(b'"role"') <= limits.max_messages and b'"stop"' not in raw
            and b'"json_schema"' not in raw):
        return
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return  # the model's parser says what is wrong with it
    if not isinstance(data, dict):
        return
    messages, stop = data.get("messages"), data.get("stop")
    if isinstance(messages, list):
        check_messages(len(messages), limits)
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        check_stop(stop, limits)
    fmt = data.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if isinstance(schema, dict):
        text = json.dumps(schema)
        if len(text.encode()) > limits.max_schema_bytes:
            check_schema(text, limits)  # refuses it, naming the limit


def _direct(model: type[BaseModel], endpoint: Callable[..., Awaitable[Response]]):
    async def handle(request: Request) -> Response:
        # The key and the rate limit first: a caller over its rate costs no body read.
        tenant = await caller(request, rate_limited=True)
        raw = await request.body()
        if is_large(raw):
            # Over a count limit: refused before validation (pydantic holds the GIL while
            # it validates, seconds for 110,000 messages, even in a worker thread).
            await off_loop_if(True, _precheck, raw, request.app.state.limits)
        # Parsing a large body (a 10^6-token id list, 200k chat messages) takes seconds:
        # not on the loop that answers everyone else.
        body = await parsed(model, raw)
        return await endpoint(body, request, request.headers.get(AGENT_HEADER), tenant)

    return handle


DIRECT = {("POST", "/v1/completions"): _direct(CompletionRequest, completions),
          ("POST", "/v1/chat/completions"): _direct(ChatCompletionRequest, chat_completions)}
