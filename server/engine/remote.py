"""Remote engine backend: a vLLM OpenAI server behind Justitia.

The server is a `vllm serve` / `python -m vllm.entrypoints.openai.api_server` process (one
GPU, or a tensor/pipeline-parallel group spanning several), ideally started with
`--scheduling-policy priority` so that the int priority Justitia sends decides whom vLLM
preempts if it must. Several engine replicas are Ray Serve's business
(server/engine/ray_serve.py); this backend keeps to one server, as one replica of the same
placement code (`server/engine/placement.py`: M, health, the KV ledger). It is three pieces:

- `server/engine/remote_replica.py`: what the server says about itself (its model, its KV
  cache from `/metrics`, its health and its iteration time, polled);
- `server/engine/openai_wire.py`: the request body and the parsing of the streamed chunks;
- this module, `RemoteVLLMEngine`: the HTTP session, the tokenizer, and streaming one
  request from the server; a request that fails before its first token because the server
  dropped the connection is sent once more, one that fails later ends with a clear error.

Closing a request's stream (our consumer stopped, the agent was cancelled) makes vLLM abort
the request and free its KV cache.

Token counts must be known before a request is admitted, so the tokenizer is loaded here from
the server's model (`root` in `/v1/models`) or from `tokenizer=`; it must be available
locally (a folder, or a hub id already in the local cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp

from server.engine.base import (
    NOT_RUNNING,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InvalidRequestError,
    StepListener,
)
from server.engine.openai_wire import RemoteSequences, read_stream, sampling_body
from server.engine.placement import NoReplica, PlacedReplicas, ReplicaFailed, ReplicaPlacement, footprint
from server.engine.remote_replica import RemoteReplica
from server.engine.tokens import TokenizerEngine, fast_encoder

log = logging.getLogger("justitia.engine.remote")


class RemoteVLLMEngine(PlacedReplicas, TokenizerEngine):
    """A vLLM OpenAI server as the engine (see the module docstring).

    Capabilities (server/engine/base.py): `StepStatistics`, `Placement`, `CapacityChanges`
    and `ReplicaList`, answered by its `ReplicaPlacement` of one replica.
    """

    def __init__(self, url: str, *, tokenizer: str | None = None,
                 poll_interval_s: float = 0.5, send_priority: bool = True) -> None:
        self.replica = RemoteReplica(url.rstrip("/"))
        self.placement = ReplicaPlacement()
        self.tokenizer_name = tokenizer
        self.poll_interval_s = poll_interval_s
        self.send_priority = send_priority
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._streams: dict[str, aiohttp.ClientResponse] = {}
        self._step_listeners: list[StepListener] = []

    # -- lifecycle --------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._session is not None and bool(self.placement.serving)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # Drop idle connections before the server does (uvicorn closes them after 5 s):
            # a request written into a connection the server is closing fails.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        r = self.replica
        await r.describe(self._session)
        self._tokenizer = self._load_tokenizer(r.model)
        self._encode = fast_encoder(self._tokenizer)
        self.placement.join(r.url, r.kv_capacity_tokens).detail["url"] = r.url
        self._info = EngineInfo(model=r.model, kv_capacity_tokens=self.placement.started(),
                                block_size=r.block_size, max_model_len=r.max_model_len,
                                served_name=r.served_name)
        self._poller = asyncio.create_task(self._poll_forever(), name="justitia-remote-metrics")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self._poll()

    async def _poll(self) -> None:
        assert self._session is not None
        r = self.replica
        answers, step_s = await r.poll(self._session)
        self._set_health(answers, "it does not answer")
        slot = self.placement.replicas.get(r.url)
        if slot is not None:
            slot.stats = r.stats()
            # a counter: the dashboard's throughput of this replica is its rate
            slot.detail["generation_tokens"] = r.metrics.get("vllm:generation_tokens_total", 0.0)
        if step_s is not None:
            kv_in_use = r.metrics.get("vllm:kv_cache_usage_perc", 0.0) * self.capacity
            for listener in self._step_listeners:
                listener(step_s, kv_in_use)

    def _set_health(self, answers: bool, why: str) -> None:
        r = self.replica
        slot = self.placement.replicas.get(r.url)
        if slot is not None:
            self.placement.set_serving(slot, answers, why)
        elif answers:  # down, it had left the table: it joins again
            self.placement.join(r.url, r.kv_capacity_tokens).detail["url"] = r.url
        self.placement.announce()

    # -- capabilities -------------------------------------------------------------------
    def add_step_listener(self, listener: StepListener) -> None:
        self._step_listeners.append(listener)

    def stats(self) -> EngineStats:
        return self.replica.stats()

    # -- requests ---------------------------------------------------------------------
    async def _post(self, body: dict[str, Any]) -> aiohttp.ClientResponse:
        assert self._session is not None
        url = self.replica.url + "/v1/completions"
        try:
            try:
                return await self._session.post(url, json=body)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                # Nothing was answered: a pooled connection the server had just closed.
                # Sending again is safe; a second failure means the server is gone.
                return await self._session.post(url, json=body)
        except aiohttp.ClientError as exc:
            self._set_health(False, str(exc))
            raise ReplicaFailed(f"replica {self.replica.url} failed: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        resp = self._streams.pop(request_id, None)
        if resp is not None:
            resp.close()  # vLLM aborts a request whose client went away

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self._session is None:
            raise EngineError(NOT_RUNNING)
        try:
            slot, held = self.placement.claim(request.request_id, footprint(request))
        except NoReplica as exc:
            raise EngineError(f"replica {self.replica.url} is not answering") from exc
        try:
            async for out in self._stream(request):
                yield out
        except ReplicaFailed as exc:
            raise EngineError(str(exc)) from exc
        finally:
            self.placement.unclaim(slot, held)

    async def _stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        p = len(request.prompt_token_ids)
        body = {"model": self.replica.served_name, "prompt": list(request.prompt_token_ids),
                **sampling_body(request.sampling), "stream": True,
                "stream_options": {"include_usage": True}, "request_id": request.request_id}
        if self.send_priority:
            body["priority"] = int(request.priority)
        seqs = RemoteSequences(request.sampling.n)
        url = self.replica.url
        try:
            resp = await self._post(body)
            self._streams[request.request_id] = resp
            async with resp:
                if resp.status >= 400:
                    detail = await resp.text()
                    if resp.status < 500:
                        raise InvalidRequestError(f"the engine refused the request: {detail}")
                    raise ReplicaFailed(f"replica {url} answered {resp.status}: {detail}")
                try:
                    k = request.sampling.logprobs or 0
                    async with contextlib.aclosing(read_stream(resp, k)) as updates:
                        async for choices, usage in updates:
                            if request.request_id not in self._streams:
                                break  # aborted: what is still buffered is not relayed
                            if seqs.update(choices, usage):
                                yield seqs.output(request.request_id, p, finished=False)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    if request.request_id in self._streams:  # not our abort: the server failed
                        self._set_health(False, str(exc))
                        raise ReplicaFailed(f"replica {url} failed mid-request: {exc}") from exc
                    seqs.abort()
            if request.request_id not in self._streams:
                seqs.abort()
            yield seqs.output(request.request_id, p, finished=True)
        finally:
            self._streams.pop(request.request_id, None)
