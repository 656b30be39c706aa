"""Remote engine backend: one or more vLLM OpenAI servers (replicas) behind Justitia.

Each replica is a `vllm serve` / `python -m vllm.entrypoints.openai.api_server` process,
ideally started with `--scheduling-policy priority` so that the int priority Justitia sends
decides whom vLLM preempts if it must. The backend is three pieces:

- `server/engine/replicas.py`, the `ReplicaPool`: membership, health, the KV capacity M and
  its changes, placement with prefix affinity, and the iteration time read from the
  replicas' `/metrics`;
- `server/engine/openai_wire.py`: the request body and the parsing of the streamed chunks;
- this module, `RemoteVLLMEngine`: the HTTP session, the tokenizer, and streaming one
  request from its replica, resent to another replica if its replica fails before the
  first token (nothing was emitted, so resending is safe); one that fails later ends with
  a clear error.

Closing a request's stream (our consumer stopped, the agent was cancelled) makes vLLM abort
the request and free its KV cache.

Token counts must be known before a request is admitted, so the tokenizer is loaded here from
the replicas' model (`root` in `/v1/models`) or from `tokenizer=`; it must be available
locally (a folder, or a hub id already in the local cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp

from server.engine.base import (
    NOT_RUNNING,
    CapacityListener,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InvalidRequestError,
    StepListener,
)
from server.engine.openai_wire import RemoteSequences, read_stream, sampling_body
from server.engine.replicas import Replica, ReplicaPool
from server.engine.tokens import TokenizerEngine, fast_encoder

log = logging.getLogger("justitia.engine.remote")


class _ReplicaFailed(Exception):
    """The replica itself failed (unreachable, 5xx, connection lost mid-stream)."""


class RemoteVLLMEngine(TokenizerEngine):
    """vLLM OpenAI servers as one engine: M is the sum of their KV capacities.

    Capabilities (server/engine/base.py): `StepStatistics`, `Placement`, `CapacityChanges`
    and `ReplicaAdmin`, all answered by its `ReplicaPool`.
    """

    def __init__(self, urls: list[str], *, tokenizer: str | None = None,
                 poll_interval_s: float = 0.5, send_priority: bool = True) -> None:
        self.pool = ReplicaPool(urls)
        self.tokenizer_name = tokenizer
        self.poll_interval_s = poll_interval_s
        self.send_priority = send_priority
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._streams: dict[str, aiohttp.ClientResponse] = {}
        # First of the capacity listeners: `info` follows M before the scheduler hears.
        self.pool.add_capacity_listener(self._on_capacity)

    # -- lifecycle --------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._session is not None and self.pool.any_serving

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # Drop idle connections before the replica does (uvicorn closes them after 5 s):
            # a request written into a connection the server is closing fails.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        await self.pool.describe_all(self._session)
        replicas = self.pool.replicas
        self._tokenizer = self._load_tokenizer()
        self._encode = fast_encoder(self._tokenizer)
        self._info = EngineInfo(
            model=replicas[0].model,
            kv_capacity_tokens=sum(r.kv_capacity_tokens for r in replicas),
            block_size=max(r.block_size for r in replicas),
            max_model_len=min(r.max_model_len for r in replicas),
            served_name=replicas[-1].served_name,
        )
        self.pool.started(self._info.kv_capacity_tokens)
        self._poller = asyncio.create_task(self._poll_forever(), name="justitia-remote-metrics")

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        name = self.tokenizer_name or self.pool.replicas[0].model
        try:
            return AutoTokenizer.from_pretrained(name)
        except Exception as exc:
            raise EngineError(
                f"cannot load the tokenizer {name!r} here (the scheduler counts tokens before "
                f"admitting a request): {exc}; pass --tokenizer PATH"
            ) from exc

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
            await self.pool.poll_all()

    def _on_capacity(self, kv_capacity_tokens: int) -> None:
        if self._info is not None:
            self._info = dataclasses.replace(self._info, kv_capacity_tokens=kv_capacity_tokens)

    # -- capabilities: the pool's -----------------------------------------------------
    def add_step_listener(self, listener: StepListener) -> None:
        self.pool.add_step_listener(listener)

    @property
    def capacity(self) -> int:
        """M: the KV tokens of the replicas taking requests now."""
        return self.pool.capacity

    def add_capacity_listener(self, listener: CapacityListener) -> None:
        """`listener(M)` after every change of M (replica added, removed, failed, back)."""
        self.pool.add_capacity_listener(listener)

    def describe_replicas(self) -> list[dict[str, Any]]:
        return self.pool.describe_replicas()

    async def add_replica(self, url: str) -> dict[str, Any]:
        return await self.pool.add_replica(url)

    def remove_replica(self, url: str) -> dict[str, Any]:
        return self.pool.remove_replica(url)

    def place(self, request_id: str, agent_id: str, footprint: int) -> bool:
        return self.pool.place(request_id, agent_id, footprint)

    def release(self, request_id: str) -> None:
        self.pool.release(request_id)

    def stats(self) -> EngineStats:
        return self.pool.stats()

    # -- requests ---------------------------------------------------------------------
    async def _post(self, replica: Replica, body: dict[str, Any]) -> aiohttp.ClientResponse:
        assert self._session is not None
        url = replica.url + "/v1/completions"
        try:
            try:
                return await self._session.post(url, json=body)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                # Nothing was answered: a pooled connection the replica had just closed.
                # Sending again is safe; a second failure means the replica is gone.
                return await self._session.post(url, json=body)
        except aiohttp.ClientError as exc:
            self.pool.set_health(replica, False)
            raise _ReplicaFailed(f"replica {replica.url} failed: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        resp = self._streams.pop(request_id, None)
        if resp is not None:
            resp.close()  # vLLM aborts a request whose client went away

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self._session is None:
            raise EngineError(NOT_RUNNING)
        s = request.sampling
        footprint = s.n * (len(request.prompt_token_ids) + s.max_tokens)
        failed: list[Replica] = []
        while True:
            replica, held = self.pool.claim(request.request_id, footprint, failed)
            emitted = False
            try:
                async for out in self._stream(replica, request):
                    emitted = True
                    yield out
                return
            except _ReplicaFailed as exc:
                failed.append(replica)
                if emitted or not self.pool.others_serving(failed):
                    raise EngineError(str(exc)) from exc
                log.warning("%s before its first token; resending %s to another replica",
                            exc, request.request_id)
            finally:
                self.pool.unclaim(replica, held)

    async def _stream(self, replica: Replica, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        p = len(request.prompt_token_ids)
        # The replica's own name for the model (replicas added later may name it otherwise).
        body = {"model": replica.served_name, "prompt": list(request.prompt_token_ids),
                **sampling_body(request.sampling), "stream": True,
                "stream_options": {"include_usage": True}, "request_id": request.request_id}
        if self.send_priority:
            body["priority"] = int(request.priority)
        seqs = RemoteSequences(request.sampling.n)
        try:
            resp = await self._post(replica, body)
            self._streams[request.request_id] = resp
            async with resp:
                if resp.status >= 400:
                    detail = await resp.text()
                    if resp.status < 500:
                        raise InvalidRequestError(f"the engine refused the request: {detail}")
                    raise _ReplicaFailed(f"replica {replica.url} answered {resp.status}: {detail}")
                try:
                    k = request.sampling.logprobs or 0
                    async with contextlib.aclosing(read_stream(resp, k)) as updates:
                        async for choices, usage in updates:
                            if request.request_id not in self._streams:
                                break  # aborted: what is still buffered is not relayed
                            if seqs.update(choices, usage):
                                yield seqs.output(request.request_id, p, finished=False)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    if request.request_id in self._streams:  # not our abort: the replica failed
                        self.pool.set_health(replica, False)
                        raise _ReplicaFailed(f"replica {replica.url} failed mid-request: {exc}") from exc
                    seqs.abort()
            if request.request_id not in self._streams:
                seqs.abort()
            yield seqs.output(request.request_id, p, finished=True)
        finally:
            self._streams.pop(request.request_id, None)
