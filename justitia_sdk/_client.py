"""The HTTP clients: `AsyncClient` (httpx + anyio) and `Client`, its synchronous facade.

Every call goes through `AsyncClient._request`, which adds the bearer key, retries what is
safe to retry (connection refused, 429 and 503, with exponential backoff and jitter, honoring
`Retry-After`) and turns error statuses into `APIError` subclasses carrying the server's
`detail`. One liveness clock per client (`_Liveness`) decides when the server is gone, for
all the client's requests at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import anyio
import anyio.from_thread
import httpx

from justitia_sdk._context import current_agent_id, current_client, current_run
from justitia_sdk._errors import (
    AgentNotFoundError,
    NotJustitiaError,
    ServerGoneError,
    ServerUnavailableError,
    error_for,
)
from justitia_sdk._models import AgentRecord, Completion, Usage

if TYPE_CHECKING:
    from justitia_sdk._agent import Agent
    from justitia_sdk._batch import AgentHandle, Batch
    from justitia_sdk._context import AgentRun

T = TypeVar("T")
_R = TypeVar("_R")
_P = ParamSpec("_P")
#: After an interrupt, how long the sync client waits for its agents to be cancelled.
_INTERRUPT_CLEANUP_S = 20.0

DEFAULT_URL = "http://127.0.0.1:8000"
AGENT_HEADER = "X-Justitia-Agent"
RETRY_STATUSES = frozenset({429, 503})
_INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Connections one client opens at most. Requests past it wait in the client's pool; no
#: long-lived stream holds one per agent (a batch watches all its agents over one), so the
#: pool cannot fill with streams and starve the completions (the 100-agent deadlock). It
#: stays well under the usual limit of 1,024 open files of a notebook process.
MAX_CONNECTIONS = 512
#: Seconds without a request getting through before a client takes its server for gone:
#: longer than a restart of the bundled server takes (55-90 s on 2 CPU cores).
SERVER_GONE_S = 120.0
#: Failures further apart than this (no request tried in between) are not one outage: the
#: clock starts again from the later one.
_OUTAGE_GAP_S = 30.0


class _Liveness:
    """When the client's requests last got through to the server, shared by all of them.

    A request gets through when the server answers it with anything but 503 (a 429 is a
    live server asking to slow down). Refused and broken connections and 503s are failures.
    The server is *gone* once failures have lasted `gone_s` seconds with no request getting
    through in between: from then on a request fails at its first failure, without retries,
    until one gets through again.
    """

    def __init__(self, gone_s: float) -> None:
        self.gone_s = gone_s
        self.down_since: float | None = None
        self.last_failure: float | None = None
        self.last_ok: float | None = None

    def ok(self) -> None:
        self.down_since = self.last_failure = None
        self.last_ok = time.monotonic()

    def failed(self, since: float) -> None:
        """A request failed that was sent at `since` (monotonic; for a connection that
        broke, when it broke): nothing has got through since then, or since the last
        request that did, whichever is later."""
        now = time.monotonic()
        since = max(min(since, now), self.last_ok or since)
        if (self.down_since is None or self.last_failure is None
                or now - self.last_failure > _OUTAGE_GAP_S):
            self.down_since = since
        else:
            self.down_since = min(self.down_since, since)
        self.last_failure = now

    def down_for(self) -> float:
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    @property
    def gone(self) -> bool:
        return self.down_since is not None and self.down_for() >= self.gone_s


def default_url() -> str:
    """`JUSTITIA_URL`, or the default local server."""
    return os.environ.get("JUSTITIA_URL") or DEFAULT_URL


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _not_json(response: httpx.Response, base_url: str) -> NotJustitiaError:
    kind = response.headers.get("content-type", "no content type").split(";")[0]
    return NotJustitiaError(
        response.status_code,
        f"the server at {base_url} answered with {kind}, not Justitia's JSON: is "
        f"JUSTITIA_URL (or base_url) the address of a Justitia server?",
        method=response.request.method, url=response.request.url.path)


def _is_json(response: httpx.Response) -> bool:
    return "json" in response.headers.get("content-type", "")


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # OpenAI's shape
        message = body["error"].get("message")
        if isinstance(message, str):
            return message
    return json.dumps(body)[:300]


def _sampling(**fields: Any) -> dict[str, Any]:
    """Only the sampling fields the caller set: the server's defaults apply to the rest."""
    return {k: v for k, v in fields.items() if v is not None}


def _default_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport | None:
    """httpx's API over aiohttp's connection pool.

    With a few hundred requests in flight (a batch of agents fanning out), httpx's own pool
    cost agents most of their time on a 2-core machine: 40 agents x 12 parallel calls took
    21.2 s with it and 6.2 s over aiohttp (benchmarks/sdk_transport.py, same server, same
    run). Without httpx-aiohttp installed, httpx's pool is used.
    """
    try:
        from httpx_aiohttp import AiohttpTransport
    except ImportError:
        return None
    # Its pool has its own limit (100 by default), whatever the httpx client's says.
    return AiohttpTransport(limits=limits)


class AsyncClient:
    """Talks to a Justitia server.

    ```python
    async with AsyncClient("http://127.0.0.1:8000") as client:
        summary = await client.run(summarize, doc)
        batch = await client.submit_many(summarize, docs)
    ```

    `base_url` defaults to `JUSTITIA_URL` (else http://127.0.0.1:8000), `api_key` to
    `JUSTITIA_API_KEY`. `timeout` bounds control calls; `request_timeout` bounds one
    completion, which may legitimately wait a long time behind agents the scheduler serves
    first. 429 and 503 answers and refused connections are retried with backoff for
    `retry_window_s` seconds (120 by default: longer than a server restart takes), or at most
    `max_retries` times when that is set; a completion whose connection broke (the server
    died under it) is sent again, within a window of its own from the break.
    `server_gone_s` (120 by default) is the client's liveness window: once none of its
    requests has got through to the server (refused or broken connections, 503s) for that
    long, the server is taken for gone and every request fails at once with
    `ServerGoneError` until one gets through again; a batch then fails all its pending inputs.
    `max_connections` bounds the connections it opens (requests past it wait their turn).
    """

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
        if server_gone_s <= 0:
            raise ValueError("server_gone_s must be > 0 seconds")
        self.base_url = (base_url or default_url()).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("JUSTITIA_API_KEY")
        self.timeout = timeout
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.retry_window_s = retry_window_s
        self._liveness = _Liveness(server_gone_s)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # Agents fan out: one connection per in-flight request. A bounded pool, large enough
        # that what a batch sends reaches the scheduler rather than queuing here.
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout),
            limits=limits,
            transport=transport or _default_transport(limits),
        )
        #: The latest batch started on this client: still here after an interrupt.
        self.last_batch: Batch | None = None

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

    async def __aenter__(self) -> AsyncClient:
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
        attempt = 0
        started = time.monotonic()
        # A completion is safe to send again when its connection broke: the server died under
        # it, so nothing of it survives there. Agent calls are not (a lost answer to a
        # registration would register twice).
        resend_on_break = method == "POST" and path in _INFERENCE_PATHS
        while True:
            sent = time.monotonic()
            try:
                response = await self._http.request(
                    method, path, json=json_body, headers=headers,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                    httpx.ReadError) as exc:
                broke = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
                self._liveness.failed(time.monotonic() if broke else sent)
                if self._liveness.gone:
                    raise self._gone(f"{exc!r}") from exc
                if broke and resend_on_break:
                    started = time.monotonic()  # the server died under it: a new window
                if (broke and not resend_on_break) or self._give_up(attempt, started):
                    raise ServerUnavailableError(
                        f"cannot reach the Justitia server at {self.base_url}: {exc!r}"
                        f"{self._tried(attempt, started)}"
                    ) from exc
                await anyio.sleep(self._until_gone(self._backoff(attempt)))
                attempt += 1
                continue
            self._note_answer(response, sent)
            if response.status_code in RETRY_STATUSES:
                if self._give_up(attempt, started):
                    raise ServerUnavailableError(
                        f"{method} {path}: the server stayed busy ({response.status_code}: "
                        f"{_detail(response)}){self._tried(attempt, started)}"
                    )
                pause = _retry_after(response) or self._backoff(attempt)
                if response.status_code == 503:
                    pause = self._until_gone(pause)
                await anyio.sleep(pause)
                attempt += 1
                continue
            if response.content and not _is_json(response):
                raise _not_json(response, self.base_url)
            if response.status_code >= 400:
                raise error_for(response.status_code, _detail(response), method=method, url=path)
            if not response.content:
                return None
            return response.json()

    def _gone(self, last: str) -> ServerGoneError:
        return ServerGoneError(
            f"the Justitia server at {self.base_url} is gone: no request has got through "
            f"for {self._liveness.down_for():.0f} s (server_gone_s={self.server_gone_s:g}); "
            f"last failure: {last}")

    def _note_answer(self, response: httpx.Response, sent: float) -> None:
        """The liveness clock after an answer: a 503 is a failure (raises `ServerGoneError`
        once the window has passed), anything else gets through."""
        if response.status_code != 503:
            self._liveness.ok()
            return
        self._liveness.failed(sent)
        if self._liveness.gone:
            raise self._gone(f"503: {_detail(response)}")

    def _until_gone(self, pause: float) -> float:
        """`pause`, cut short to try again as the liveness window ends: a gone server is
        found out when the window ends, not a backoff later."""
        left = self._liveness.gone_s - self._liveness.down_for()
        return min(pause, max(0.05, left))

    def _give_up(self, attempt: int, started: float) -> bool:
        if self.max_retries is not None and attempt >= self.max_retries:
            return True
        return time.monotonic() - started >= self.retry_window_s

    def _tried(self, attempt: int, started: float) -> str:
        return (f" through {attempt} retries over {time.monotonic() - started:.0f} s" if attempt
                else "")

    @staticmethod
    def _backoff(attempt: int) -> float:
        # Exponential with full jitter, so that many agents refused at once do not retry in
        # lockstep.
        return min(8.0, 0.25 * 2.0**attempt) * (0.5 + random.random())

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
            "GET", path, timeout=httpx.Timeout(self.timeout, read=None)
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                raise error_for(response.status_code, _detail(response), method="GET", url=path)
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
            return (await self._http.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    # -- inference ------------------------------------------------------------------------

    async def _reregister(self, run: AgentRun, stale_id: str) -> str:
        """A new id for `run` after the server forgot `stale_id` (once for all its
        concurrent requests: the first to get here registers, the others reuse it)."""
        async with run._reregister_lock:
            if run.id == stale_id:
                record = await self.register_agent(run.type, run.prompt or run.type, run.metadata)
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
            if agent_id is not None or run is None or run.id != aid:
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

    async def complete(
        self,
        prompt: str,
        *,
        max_tokens: int = 256,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool | None = None,
        min_tokens: int | None = None,
        model: str | None = None,
        agent_id: str | None = None,
        **extra: Any,
    ) -> Completion:
        """One completion. Inside an agent it is tagged with the agent's id (or `agent_id`)."""
        body = {"prompt": prompt, **_sampling(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=list(stop) if isinstance(stop, (list, tuple)) else stop,
            ignore_eos=ignore_eos, min_tokens=min_tokens, model=model), **extra}
        return await self._inference("/v1/completions", body, agent_id, lambda c: c.get("text", ""))

    async def chat(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        system: str | None = None,
        max_tokens: int = 256,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool | None = None,
        min_tokens: int | None = None,
        model: str | None = None,
        agent_id: str | None = None,
        **extra: Any,
    ) -> Completion:
        """One chat completion; `messages` may be a plain string (one user message)."""
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else [
            dict(m) for m in messages]
        if system is not None:
            msgs.insert(0, {"role": "system", "content": system})
        body = {"messages": msgs, **_sampling(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=list(stop) if isinstance(stop, (list, tuple)) else stop,
            ignore_eos=ignore_eos, min_tokens=min_tokens, model=model), **extra}
        return await self._inference(
            "/v1/chat/completions", body, agent_id,
            lambda c: (c.get("message") or {}).get("content") or "")

    # -- running agents -----------------------------------------------------------------------

    async def run(self, agent: Agent[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Submit one agent run on this client and wait for its result."""
        from justitia_sdk._batch import resolve_agents

        result: T = await resolve_agents(agent, 1)[0].invoke(args, kwargs, client=self)
        return result

    async def submit_many(
        self,
        agent: Agent[..., Any] | str | Sequence[Agent[..., Any] | str],
        inputs: Iterable[Any],
        *,
        concurrency: int | None = None,
        progress: bool = True,
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retries: int = 0,
    ) -> Batch:
        """Run one agent per input and wait for all of them; returns the batch.

        An input that is a dict is passed as keyword arguments, a tuple as positional
        arguments, anything else as the single argument. `agent` is an `@agent` (or the
        name of one), or a sequence of them, one per input (a mixed batch).
        `concurrency` caps the agents running at once (default 64). `timeout` (seconds)
        cancels a run that takes longer; `retries` runs a failed or timed-out input again,
        up to that many times, when a retry can change the outcome (`is_retryable`: never
        after a 4xx about the input). One agent's failure is recorded on its handle and does
        not stop the others; the handles are in input order. If the client takes the server
        for gone (`server_gone_s`), every input not ended fails at once with one
        `ServerGoneError` (`batch.server_error`). If the batch is interrupted
        (Ctrl-C, cancellation) its live agents are cancelled on the server and the batch,
        with the results that finished, stays in `client.last_batch`.
        """
        async with self.batch(agent, inputs, concurrency=concurrency, progress=progress,
                              title=title, metadata=metadata, timeout=timeout,
                              retries=retries) as batch:
            pass
        return batch

    @contextlib.asynccontextmanager
    async def batch(
        self,
        agent: Agent[..., Any] | str | Sequence[Agent[..., Any] | str],
        inputs: Iterable[Any],
        *,
        concurrency: int | None = None,
        progress: bool = True,
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retries: int = 0,
    ) -> AsyncIterator[Batch]:
        """`submit_many` as a context: the batch runs while the block runs, so results can
        be used as they come; leaving the block waits for the rest, an error in the block
        cancels them.

        ```python
        async with client.batch(summarize, docs) as batch:
            async for handle in batch.as_completed():
                print(handle.index, handle.status, handle.result)
        ```
        """
        from justitia_sdk._batch import make_batch, run_batch

        batch = make_batch(agent, inputs, title)
        self.last_batch = batch
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(
                run_batch, self, batch, concurrency=concurrency, progress=progress,
                metadata=metadata, timeout=timeout, retries=retries))
            try:
                yield batch
            except BaseException:
                batch.cancel()
                raise

    def as_default(self) -> AbstractContextManager[AsyncClient]:
        """`with client.as_default():` agents called directly (`await my_agent(x)`) use it."""
        return _Default(self)


class _Default(AbstractContextManager["AsyncClient"]):
    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    def __enter__(self) -> AsyncClient:
        self._token = current_client.set(self.client)
        return self.client

    def __exit__(self, *exc: object) -> None:
        current_client.reset(self._token)


def _result(future: concurrent.futures.Future[_R]) -> _R:
    """`future.result()` in short waits, so that Ctrl-C lands at once on any platform."""
    while True:
        try:
            return future.result(timeout=0.2)
        except TimeoutError:
            if future.done():
                raise


def _get(items: queue.Queue[Any]) -> Any:
    while True:
        try:
            return items.get(timeout=0.2)
        except queue.Empty:
            continue


class Client:
    """The synchronous facade: the same calls, for scripts without an event loop.

    It runs an `AsyncClient` on an event loop in a background thread (an anyio blocking
    portal). Close it (or use `with Client() as c:`) to stop that thread.
    """

    def __init__(self, base_url: str | None = None, **kwargs: Any) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()

        async def make() -> AsyncClient:
            return AsyncClient(base_url, **kwargs)

        self._async: AsyncClient = self._portal.call(make)
        self.base_url = self._async.base_url

    def _call(self, fn: Callable[_P, Awaitable[_R]], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return self._portal.call(functools.partial(fn, *args, **kwargs))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._portal_cm is None:
            return
        try:
            self._portal.call(self._async.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None  # type: ignore[assignment]

    @property
    def async_client(self) -> AsyncClient:
        return self._async

    def run(self, agent: Agent[..., T], /, *args: Any, **kwargs: Any) -> T:
        return self._call(self._async.run, agent, *args, **kwargs)

    @property
    def last_batch(self) -> Batch | None:
        """The latest batch started on this client: still here after an interrupt."""
        return self._async.last_batch

    def _run_interruptibly(self, fn: Callable[[], Awaitable[_R]]) -> _R:
        """Run `fn()` on the portal's loop. On Ctrl-C, cancel it there (its agents are
        cancelled on the server) and wait for that before re-raising."""
        finished = threading.Event()

        async def task() -> _R:
            try:
                return await fn()
            finally:
                finished.set()

        future = self._portal.start_task_soon(task)
        try:
            return _result(future)
        except KeyboardInterrupt:
            future.cancel()
            finished.wait(_INTERRUPT_CLEANUP_S)
            raise

    def submit_many(self, agent: Any, inputs: Iterable[Any], **kwargs: Any) -> Batch:
        """Run one agent per input and wait for all (see `AsyncClient.submit_many`). On
        Ctrl-C the batch's live agents are cancelled on the server before
        KeyboardInterrupt propagates; `client.last_batch` keeps what finished."""
        from justitia_sdk._batch import check_inputs

        values = check_inputs(inputs)
        return self._run_interruptibly(
            functools.partial(self._async.submit_many, agent, values, **kwargs))

    def as_completed(self, agent: Any, inputs: Iterable[Any], **kwargs: Any
                     ) -> Iterator[AgentHandle]:
        """Run a batch (as `submit_many`) and yield its handles as their runs end. Leaving
        the loop early, or Ctrl-C, cancels the runs still going; `client.last_batch`
        keeps the batch."""
        from justitia_sdk._batch import check_inputs

        values = check_inputs(inputs)
        ended: queue.Queue[Any] = queue.Queue()
        stop = object()

        async def run() -> None:
            async with self._async.batch(agent, values, **kwargs) as batch:
                async for handle in batch.as_completed():
                    ended.put(handle)

        finished = threading.Event()

        async def task() -> None:
            try:
                await run()
            finally:
                ended.put(stop)
                finished.set()

        future = self._portal.start_task_soon(task)
        try:
            while (item := _get(ended)) is not stop:
                yield item
            _result(future)
        finally:
            if not future.done():
                future.cancel()
                finished.wait(_INTERRUPT_CLEANUP_S)

    def complete(self, prompt: str, **kwargs: Any) -> Completion:
        return self._call(self._async.complete, prompt, **kwargs)

    def chat(self, messages: Any, **kwargs: Any) -> Completion:
        return self._call(self._async.chat, messages, **kwargs)

    def register_agent(self, type: str, prompt: str,
                       metadata: Mapping[str, Any] | None = None) -> AgentRecord:
        return self._call(self._async.register_agent, type, prompt, metadata)

    def get_agent(self, agent_id: str) -> AgentRecord:
        return self._call(self._async.get_agent, agent_id)

    def list_agents(self, *, state: str | None = None,
                    limit: int | None = None) -> list[AgentRecord]:
        return self._call(self._async.list_agents, state=state, limit=limit)

    def finish_agent(self, agent_id: str, *, error: str | None = None) -> AgentRecord:
        return self._call(self._async.finish_agent, agent_id, error=error)

    def cancel_agent(self, agent_id: str) -> AgentRecord:
        return self._call(self._async.cancel_agent, agent_id)

    def scheduler(self) -> dict[str, Any]:
        return self._call(self._async.scheduler)

    def models(self) -> list[dict[str, Any]]:
        return self._call(self._async.models)

    def ready(self) -> bool:
        return self._call(self._async.ready)


__all__ = ["AsyncClient", "Client", "default_url"]
