"""`APIClient`: the HTTP API of a Justitia server, for agents and for the code that runs them.

It speaks the API as it is: registering, finishing, cancelling and watching agents, and the
completions an agent makes (tagged with its id, from the contextvar of the run it executes
in). `AsyncClient` (`_client.py`) adds running agents and batches on top; agents called
without a client make one of these for the call.

Retries and the liveness clock are its transport's (`_transport.RetryTransport`); this layer
turns answers into records and error statuses into `APIError` subclasses carrying the
server's `detail`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Self, TypedDict, TypeVar, Unpack

import httpx

from justitia_sdk._context import AgentRun, current_agent_id, current_run
from justitia_sdk._errors import AgentNotFoundError, NotJustitiaError, ServerGoneError, error_for
from justitia_sdk._models import AgentRecord, Completion, Usage
from justitia_sdk._transport import (
    NO_RETRY,
    SERVER_GONE_S,
    Liveness,
    RetryBudget,
    RetryTransport,
    detail_of,
)

DEFAULT_URL = "http://127.0.0.1:8000"
AGENT_HEADER = "X-Justitia-Agent"
#: Connections one client opens at most. Requests past it wait in the client's pool; no
#: long-lived stream holds one per agent (a batch watches all its agents over one), so the
#: pool cannot fill with streams and starve the completions (the 100-agent deadlock). It
#: stays well under the usual limit of 1,024 open files of a notebook process.
MAX_CONNECTIONS = 512
#: Idle connections kept open for reuse.
_KEEPALIVE = 64
_ONCE = {NO_RETRY: True}

#: The client that agents called without one use: set by `client.run`, a batch, an
#: enclosing agent, or `client.as_default()`.
current_client: ContextVar[APIClient | None] = ContextVar("justitia_client", default=None)


def default_url() -> str:
    """`JUSTITIA_URL`, or the default local server."""
    return os.environ.get("JUSTITIA_URL") or DEFAULT_URL


def _not_json(response: httpx.Response, base_url: str) -> NotJustitiaError:
    kind = response.headers.get("content-type", "no content type").split(";")[0]
    return NotJustitiaError(
        response.status_code,
        f"the server at {base_url} answered with {kind}, not Justitia's JSON: is "
        f"JUSTITIA_URL (or base_url) the address of a Justitia server?",
        method=response.request.method, url=response.request.url.path)


def _is_json(response: httpx.Response) -> bool:
    return "json" in response.headers.get("content-type", "")


class ClientOptions(TypedDict, total=False):
    """The keyword options of a client, as `APIClient` takes them (its signature gives their
    defaults): `AsyncClient` and the blocking `Client` pass them on unchanged."""

    api_key: str | None
    timeout: float
    request_timeout: float | None
    max_retries: int | None
    retry_window_s: float
    server_gone_s: float
    max_connections: int
    transport: httpx.AsyncBaseTransport | None


class Sampling(TypedDict, total=False):
    """How a completion or a chat is sampled; a field left out (or None) is the server's
    default. Other fields of the OpenAI request body may be passed too, as they are."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | Sequence[str] | None
    ignore_eos: bool | None
    min_tokens: int | None
    model: str | None


F = TypeVar("F", bound=Callable[..., Any])


def parameters_of(model: Callable[..., Any]) -> Callable[[F], F]:
    """Decorator: the decorated callable, which passes its options on to `model`, shows
    `model`'s parameters and defaults (to `inspect.signature`, `help()` and the parity check
    of the blocking client)."""

    def show(fn: F) -> F:
        fn.__signature__ = inspect.signature(model)  # type: ignore[attr-defined]
        return fn

    return show


def _body(head: dict[str, Any], max_tokens: int, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """A completion's or chat's body: `head` (the prompt or messages), `max_tokens`, the
    sampling fields the caller set (the server's defaults apply to the rest) and any other
    field as given."""
    fields = {k: v for k, v in sampling.items() if not (k in Sampling.__annotations__ and v is None)}
    stop = fields.get("stop")
    if isinstance(stop, (list, tuple)):
        fields["stop"] = list(stop)
    if max_tokens is not None:  # None: the server's default, as for the sampling fields
        head = {**head, "max_tokens": max_tokens}
    return {**head, **fields}


def _io_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """httpx's API over aiohttp's connection pool.

    With a few hundred requests in flight (a batch of agents fanning out), httpx's own pool
    cost agents most of their time on a 2-core machine: 40 agents x 12 parallel calls took
    21.2 s with it and 6.2 s over aiohttp (benchmarks/sdk_transport.py, same server, same
    run). Without httpx-aiohttp installed, httpx's pool is used.
    """
    try:
        from httpx_aiohttp import AiohttpTransport
    except ImportError:
        return httpx.AsyncHTTPTransport(limits=limits)
    # Its pool has its own limit (100 by default), whatever the httpx client's says.
    return AiohttpTransport(limits=limits)


class APIClient:
    """The server's HTTP API (see `AsyncClient` for the parameters)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        request_timeout: float | None = 900.0,
        max_retries: int | None = None,
        retry_window_s: float = 120.0,
        server_gone_s: float = SERVER_GONE_S,
        max_connections: int = MAX_CONNECTIONS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = (base_url or default_url()).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("JUSTITIA_API_KEY")
        self.timeout = timeout
        self.request_timeout = request_timeout
        self._liveness = Liveness(server_gone_s)
        self._budget = RetryBudget(max_retries, retry_window_s)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # Agents fan out: one connection per in-flight request. A bounded pool, large enough
        # that what a batch sends reaches the scheduler rather than queuing here.
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=_KEEPALIVE)
        self._transport = RetryTransport(
            transport or _io_transport(limits), liveness=self._liveness, budget=self._budget,
            base_url=self.base_url)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                       timeout=httpx.Timeout(timeout), limits=limits,
                                       transport=self._transport)

    @property
    def max_retries(self) -> int | None:
        """Retries of one request at most (None: as many as `retry_window_s` allows)."""
        return self._budget.max_retries

    @max_retries.setter
    def max_retries(self, value: int | None) -> None:
        self._budget.max_retries = value

    @property
    def retry_window_s(self) -> float:
        """Seconds one request keeps retrying 429, 503 and refused connections."""
        return self._budget.window_s

    @retry_window_s.setter
    def retry_window_s(self, value: float) -> None:
        self._budget.window_s = value

    @property
    def server_gone_s(self) -> float:
        """Seconds without a request getting through before the server is taken for gone."""
        return self._liveness.gone_s

    @server_gone_s.setter
    def server_gone_s(self, value: float) -> None:
        if value <= 0:
            raise ValueError("server_gone_s must be > 0 seconds")
        self._liveness.gone_s = value

    @property
    def server_gone(self) -> bool:
        """True once no request has got through to the server for `server_gone_s` seconds
        (until one does again)."""
        return self._liveness.gone

    def gone_error(self, last: str) -> ServerGoneError:
        """The `ServerGoneError` this client raises now, `last` its last failure."""
        return self._transport.gone_error(last)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing -------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None | httpx.Timeout = None,
    ) -> Any:
        """One call of the API: its JSON answer, or the `APIError` for its error status
        (what can be retried, the transport has)."""
        response = await self._http.request(
            method, path, json=json_body, headers=headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        if response.content and not _is_json(response):
            raise _not_json(response, self.base_url)
        if response.status_code >= 400:
            raise error_for(response.status_code, detail_of(response), method=method, url=path)
        if not response.content:
            return None
        return response.json()

    # -- the agent API ----------------------------------------------------------------------

    async def register_agent(
        self,
        type: str,
        prompt: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        lease_s: float | None = None,
    ) -> AgentRecord:
        """Register an agent: the server predicts its cost from `prompt` and gives it a tag.

        `lease_s`: the server expires the agent after this many idle seconds without a
        finish (default: the server's lease).
        """
        body: dict[str, Any] = {"type": type, "prompt": prompt}
        if metadata:
            body["metadata"] = dict(metadata)
        if lease_s is not None:
            body["lease_s"] = lease_s
        return AgentRecord.model_validate(await self._request("POST", "/v1/agents", json_body=body))

    async def get_agent(self, agent_id: str) -> AgentRecord:
        return AgentRecord.model_validate(await self._request("GET", f"/v1/agents/{agent_id}"))

    async def list_agents(self, *, state: str | None = None,
                          limit: int | None = None) -> list[AgentRecord]:
        """The caller's agents (the tenant of the API key) in registration order, every
        page of them (at most `limit`); `state` keeps those in that state."""
        out: list[AgentRecord] = []
        cursor: str | None = None
        while limit is None or len(out) < limit:
            page = 1000 if limit is None else min(1000, limit - len(out))
            params = f"?limit={page}" + (f"&state={state}" if state else "")
            if cursor is not None:
                params += f"&cursor={cursor}"
            body = await self._request("GET", "/v1/agents" + params)
            out.extend(AgentRecord.model_validate(r) for r in body.get("agents", []))
            cursor = body.get("next_cursor")
            if not cursor:
                break
        return out

    async def finish_agent(self, agent_id: str, *, error: str | None = None) -> AgentRecord:
        """Tell the server the agent is done (its cost is settled, its tag retired). With
        `error` it ends `failed`: an incomplete run, never a predictor training sample."""
        body = {"error": error} if error is not None else None
        return AgentRecord.model_validate(
            await self._request("POST", f"/v1/agents/{agent_id}/finish", json_body=body)
        )

    async def pause_agent(self, agent_id: str, tool: str = "tool", *,
                          expected_s: float | None = None) -> AgentRecord:
        """Tell the server the agent is in tool call `tool` from now (and how long it is
        expected to take, if known): the scheduler judges the rest of its pause from it."""
        body: dict[str, Any] = {"tool": tool}
        if expected_s is not None:
            body["expected_s"] = expected_s
        return AgentRecord.model_validate(
            await self._request("POST", f"/v1/agents/{agent_id}/pause", json_body=body))

    async def resume_agent(self, agent_id: str) -> AgentRecord:
        """Tell the server the tool call announced by `pause_agent` has ended."""
        return AgentRecord.model_validate(await self._request("POST", f"/v1/agents/{agent_id}/resume"))

    async def cancel_agent(self, agent_id: str) -> AgentRecord:
        """Cancel the agent: the server aborts its running requests in the engine."""
        return AgentRecord.model_validate(await self._request("DELETE", f"/v1/agents/{agent_id}"))

    async def watch_agent(self, agent_id: str) -> AsyncIterator[AgentRecord]:
        """The agent's record each time it changes (server-sent events), until it is terminal."""
        async for record in self._sse(f"/v1/agents/{agent_id}/events"):
            yield record
            if record.terminal:
                return

    async def watch_agents(self, ids: Iterable[str] | None = None) -> AsyncIterator[AgentRecord]:
        """Records of the caller's agents as they change, over one connection: first the
        live ones, then each agent that changed (at most a few updates a second per agent).
        `ids` (at most 1,000) narrows it to those agents. It ends only when the caller stops
        iterating."""
        path = "/v1/agents/events"
        if ids is not None:
            path += "?ids=" + ",".join(ids)
        async for record in self._sse(path):
            yield record

    async def _sse(self, path: str) -> AsyncIterator[AgentRecord]:
        async with self._http.stream(
            "GET", path, timeout=httpx.Timeout(self.timeout, read=None), extensions=_ONCE
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                raise error_for(response.status_code, detail_of(response), method="GET", url=path)
            if "text/event-stream" not in response.headers.get("content-type", ""):
                await response.aread()
                raise _not_json(response, self.base_url)
            data: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line and data:
                    payload, data = "\n".join(data), []
                    if payload.strip() in ("", "[DONE]"):
                        continue
                    yield AgentRecord.model_validate_json(payload)

    async def scheduler(self) -> dict[str, Any]:
        """The scheduler's snapshot: policy, V, M, tau, backlog, queue."""
        snapshot: dict[str, Any] = await self._request("GET", "/v1/scheduler")
        return snapshot

    async def models(self) -> list[dict[str, Any]]:
        models: list[dict[str, Any]] = (await self._request("GET", "/v1/models"))["data"]
        return models

    async def ready(self) -> bool:
        """True when the server answers /readyz with 200 (no retries)."""
        try:
            return (await self._http.get("/readyz", extensions=_ONCE)).status_code == 200
        except httpx.HTTPError:
            return False

    # -- inference ------------------------------------------------------------------------

    async def _reregister(self, run: AgentRun, stale_id: str) -> str:
        """A new id for `run` after the server forgot `stale_id` (once for all its
        concurrent requests: the first to get here registers, the others reuse it)."""
        async with run._reregister_lock:
            if run.id == stale_id:
                record = await self.register_agent(run.type, run.prompt or run.type, run.metadata)
                run.former_ids.add(stale_id)
                run.id, run.record = record.id, record
                run.reregistrations += 1
                if run.on_reregister is not None:
                    run.on_reregister(run)
        return run.id

    def _tag(self, agent_id: str | None) -> tuple[dict[str, str], str | None]:
        aid = agent_id if agent_id is not None else current_agent_id()
        return ({AGENT_HEADER: aid} if aid else {}), aid

    async def _inference(self, path: str, body: dict[str, Any], agent_id: str | None,
                         text_of: Callable[[dict[str, Any]], str]) -> Completion:
        headers, aid = self._tag(agent_id)
        timeout = httpx.Timeout(self.timeout, read=self.request_timeout)
        # If this call is cancelled (a sibling failed, the agent was cancelled), httpx closes
        # the connection; the server sees the disconnect and aborts the engine request.
        try:
            raw = await self._request("POST", path, json_body=body, headers=headers,
                                      timeout=timeout)
        except AgentNotFoundError:
            run = current_run.get()
            # A parallel call of the same run may have registered it again already: its
            # forgotten id is one of the run's former ids, and the request goes to the new one.
            if agent_id is not None or run is None or (run.id != aid and aid not in run.former_ids):
                raise
            # The server no longer knows the running agent: it restarted (agents live in
            # its memory). The refused request ran nothing, so registering the agent again
            # and resending is safe; its earlier requests are not charged twice.
            aid = await self._reregister(run, aid)
            raw = await self._request("POST", path, json_body=body, headers={AGENT_HEADER: aid},
                                      timeout=timeout)
        choice = raw["choices"][0]
        completion = Completion(
            id=raw.get("id", ""),
            text=text_of(choice),
            finish_reason=choice.get("finish_reason"),
            usage=Usage.model_validate(raw.get("usage") or {}),
            agent_id=aid,
            raw=raw,
        )
        run = current_run.get()
        if run is not None and run.id == aid:
            run.add_usage(completion.usage)
        return completion

    async def complete(self, /, prompt: str, *, max_tokens: int = 256, agent_id: str | None = None,
                       **sampling: Unpack[Sampling]) -> Completion:
        """One completion. Inside an agent it is tagged with the agent's id (or `agent_id`).
        `sampling`: the fields of `Sampling`, and any other field of the request body."""
        body = _body({"prompt": prompt}, max_tokens, sampling)
        return await self._inference("/v1/completions", body, agent_id, lambda c: c.get("text", ""))

    async def chat(
        self,
        /,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        system: str | None = None,
        max_tokens: int = 256,
        agent_id: str | None = None,
        **sampling: Unpack[Sampling],
    ) -> Completion:
        """One chat completion; `messages` may be a plain string (one user message).
        `sampling`: as `complete`'s."""
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else [
            dict(m) for m in messages]
        if system is not None:
            msgs.insert(0, {"role": "system", "content": system})
        body = _body({"messages": msgs}, max_tokens, sampling)
        return await self._inference(
            "/v1/chat/completions", body, agent_id,
            lambda c: (c.get("message") or {}).get("content") or "")
