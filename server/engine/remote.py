"""Remote engine backend: one or more vLLM OpenAI servers (replicas) behind Justitia.

Each replica is a `vllm serve` / `python -m vllm.entrypoints.openai.api_server` process,
ideally started with `--scheduling-policy priority` so that the int priority Justitia sends
decides whom vLLM preempts if it must. What the scheduler needs is read from the replicas:

- KV capacity M: the sum over replicas of (num_gpu_blocks - 1) x block_size, from the
  `vllm:cache_config_info` metric (one block per replica is vLLM's reserve);
- live usage: `vllm:kv_cache_usage_perc`, running and waiting counts and preemptions, polled
  from `/metrics`;
- the iteration time: between two polls a replica that keeps `r` requests running for `dt`
  seconds and generates `g` tokens took about `dt * r / g` seconds per step.

Requests go out as streaming completions of token ids with `stream_options.include_usage`;
vLLM streams one chunk per generated token. Closing the stream (our consumer stopped, the
agent was cancelled) makes vLLM abort the request and free its KV cache.

Several replicas act as one engine. The scheduler admits a request only once `place` found a
replica with room for its whole footprint (the sum of free memory is not enough: a request
cannot span replicas), preferring the replica that served the agent before, which holds its
prompt prefix in vLLM's prefix cache. Replicas can be added and removed while serving
(`add_replica`, `remove_replica`); a replica that stops answering leaves M until it answers
again, and capacity listeners hear every change of M. A request whose replica fails before
it produced a token is sent to another replica (nothing was emitted, so resending is safe);
one that fails later ends with a clear error.

Token counts must be known before a request is admitted, so the tokenizer is loaded here from
the replicas' model (`root` in `/v1/models`) or from `tokenizer=`; it must be available
locally (a folder, or a hub id already in the local cache).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
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
    SamplingOptions,
    SequenceOutput,
    StepListener,
    TokenLogprob,
)
from server.engine.tokens import TokenizerEngine, fast_encoder

log = logging.getLogger("justitia.engine.remote")


@dataclass
class Replica:
    url: str
    model: str = ""
    kv_capacity_tokens: int = 0
    block_size: int = 16
    max_model_len: int = 0
    reserved: int = 0  # tokens of our in-flight requests routed here (p + max_tokens)
    in_flight: int = 0
    healthy: bool = False
    draining: bool = False  # being removed: takes no new requests, leaves when empty

    @property
    def serving(self) -> bool:
        return self.healthy and not self.draining

    @property
    def room(self) -> int:
        return self.kv_capacity_tokens - self.reserved

    def describe(self) -> dict:
        return {
            "url": self.url, "model": self.model, "kv_capacity_tokens": self.kv_capacity_tokens,
            "block_size": self.block_size, "reserved_tokens": self.reserved,
            "requests_in_flight": self.in_flight, "healthy": self.healthy,
            "draining": self.draining,
            "kv_usage": self.metrics.get("vllm:kv_cache_usage_perc", 0.0),
        }
    metrics: dict[str, float] = field(default_factory=dict)
    last_poll: float | None = None


def _parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Sum of each vllm: metric over its label sets, and the cache_config_info labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    cache: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("vllm:"):
                continue
            if sample.name == "vllm:cache_config_info":
                cache = dict(sample.labels)
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values, cache


class _ReplicaFailed(Exception):
    """The replica itself failed (unreachable, 5xx, connection lost mid-stream)."""


AFFINITY_ENTRIES = 10_000  # agents remembered for prefix affinity (least recently used go)


class RemoteVLLMEngine(TokenizerEngine):
    """vLLM OpenAI servers as one engine: M is the sum of their KV capacities.

    Capabilities (server/engine/base.py): `StepStatistics`, `Placement`, `CapacityChanges`
    and `ReplicaAdmin`.
    """

    def __init__(self, urls: list[str], *, tokenizer: str | None = None,
                 poll_interval_s: float = 0.5, send_priority: bool = True) -> None:
        if not urls:
            raise ValueError("at least one replica URL is needed")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.tokenizer_name = tokenizer
        self.poll_interval_s = poll_interval_s
        self.send_priority = send_priority
        self._session: aiohttp.ClientSession | None = None
        self._served_name = ""
        self._poller: asyncio.Task[None] | None = None
        self._listeners: list[StepListener] = []
        self._capacity_listeners: list[CapacityListener] = []
        self._streams: dict[str, aiohttp.ClientResponse] = {}
        self._placed: dict[str, tuple[Replica, int]] = {}
        self._affinity: collections.OrderedDict[str, Replica] = collections.OrderedDict()

    # -- lifecycle --------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._session is not None and any(r.serving for r in self.replicas)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # Drop idle connections before the replica does (uvicorn closes them after 5 s):
            # a request written into a connection the server is closing fails.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        for r in self.replicas:
            await self._describe(r)
        models = {r.model for r in self.replicas}
        if len(models) != 1:
            raise EngineError(f"the replicas serve different models: {sorted(models)}")
        self._tokenizer = self._load_tokenizer()
        self._encode = fast_encoder(self._tokenizer)
        self._info = EngineInfo(
            model=self.replicas[0].model,
            kv_capacity_tokens=sum(r.kv_capacity_tokens for r in self.replicas),
            block_size=max(r.block_size for r in self.replicas),
            max_model_len=min(r.max_model_len for r in self.replicas),
            served_name=self._served_name,
        )
        self._poller = asyncio.create_task(self._poll_forever(), name="justitia-remote-metrics")

    async def _describe(self, r: Replica) -> None:
        assert self._session is not None
        try:
            async with self._session.get(r.url + "/v1/models") as resp:
                models = (await resp.json())["data"]
            async with self._session.get(r.url + "/metrics") as resp:
                values, cache = _parse_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as exc:
            raise EngineError(f"replica {r.url} did not answer as a vLLM OpenAI server: {exc}") from exc
        if not models or "num_gpu_blocks" not in cache:
            raise EngineError(f"replica {r.url} reports no model or no KV cache configuration (is it running with --disable-log-stats? Justitia reads its /metrics)")
        r.model = models[0].get("root") or models[0]["id"]
        r.max_model_len = int(models[0].get("max_model_len") or 0)
        r.block_size = int(cache.get("block_size", 16))
        r.kv_capacity_tokens = (int(cache["num_gpu_blocks"]) - 1) * r.block_size
        r.metrics = values
        r.healthy = True
        r.last_poll = time.monotonic()
        self._served_name = models[0]["id"]

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        name = self.tokenizer_name or self.replicas[0].model
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

    # -- observation ------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, r: Replica) -> None:
        assert self._session is not None
        now = time.monotonic()
        try:
            async with self._session.get(r.url + "/metrics",
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                values, _ = _parse_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            self._set_health(r, False)
            return
        before, then = r.metrics, r.last_poll
        r.metrics, r.last_poll = values, now
        self._set_health(r, True)
        if then is None:
            return
        running = (before.get("vllm:num_requests_running", 0) + values.get("vllm:num_requests_running", 0)) / 2
        generated = values.get("vllm:generation_tokens_total", 0) - before.get("vllm:generation_tokens_total", 0)
        if running >= 1 and generated > 0:
            step_s = (now - then) * running / generated
            # Reported against the whole M, as if every replica were as full as this one:
            # the estimator's tau is per full cache, and replicas share the load evenly.
            kv_in_use = values.get("vllm:kv_cache_usage_perc", 0.0) * self.capacity
            for listener in self._listeners:
                listener(step_s, kv_in_use)

    def add_step_listener(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    # -- capacity and replicas --------------------------------------------------------
    @property
    def capacity(self) -> int:
        """M: the KV tokens of the replicas taking requests now."""
        return sum(r.kv_capacity_tokens for r in self.replicas if r.serving)

    def add_capacity_listener(self, listener: CapacityListener) -> None:
        """`listener(M)` after every change of M (replica added, removed, failed, back)."""
        self._capacity_listeners.append(listener)

    def _capacity_changed(self) -> None:
        m = self.capacity
        if self._info is None or m <= 0 or m == self._info.kv_capacity_tokens:
            return  # with no replica left M keeps its last value: nothing is admitted anyway
        self._info = dataclasses.replace(self._info, kv_capacity_tokens=m)
        log.info("KV capacity is now %d tokens over %d replicas", m,
                 sum(r.serving for r in self.replicas))
        for listener in self._capacity_listeners:
            listener(m)

    def _set_health(self, r: Replica, healthy: bool) -> None:
        if r.healthy == healthy:
            return
        r.healthy = healthy
        if healthy:
            log.info("replica %s answers again", r.url)
        else:
            log.warning("replica %s stopped answering; its capacity leaves M", r.url)
        self._capacity_changed()

    def describe_replicas(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self.replicas]

    async def add_replica(self, url: str) -> dict[str, Any]:
        """Serve from one more replica; M grows by its capacity."""
        url = url.rstrip("/")
        if any(r.url == url for r in self.replicas):
            raise InvalidRequestError(f"replica {url} is already in use")
        r = Replica(url)
        await self._describe(r)
        first = self.replicas[0]
        if r.model != first.model or r.block_size != first.block_size:
            raise InvalidRequestError(
                f"replica {url} serves {r.model!r} with KV blocks of {r.block_size} tokens; "
                f"this server's replicas serve {first.model!r} with {first.block_size}"
            )
        self.replicas.append(r)
        self._capacity_changed()
        return r.describe()

    def remove_replica(self, url: str) -> dict[str, Any]:
        """Stop sending requests to a replica; it leaves once its requests have finished."""
        url = url.rstrip("/")
        r = next((r for r in self.replicas if r.url == url), None)
        if r is None:
            raise LookupError(f"no replica {url}")
        if not any(o.serving for o in self.replicas if o is not r):
            raise InvalidRequestError(f"replica {url} is the last one serving; add another first")
        r.draining = True
        self._capacity_changed()
        self._retire_if_drained(r)
        return r.describe()

    def _retire_if_drained(self, r: Replica) -> None:
        if r.draining and r.in_flight == 0 and r in self.replicas:
            self.replicas.remove(r)
            log.info("replica %s removed", r.url)

    def place(self, request_id: str, agent_id: str, footprint: int) -> bool:
        """Reserve room for an admitted request on one replica, or say there is none.

        The agent's previous replica first (its prefix is cached there), then the replica
        with the most room.
        """
        prev = self._affinity.get(agent_id)
        if prev is not None and prev.serving and prev in self.replicas and prev.room >= footprint:
            choice = prev
        else:
            fitting = [r for r in self.replicas if r.serving and r.room >= footprint]
            if not fitting:
                return False
            choice = max(fitting, key=lambda r: r.room)
        choice.reserved += footprint
        self._placed[request_id] = (choice, footprint)
        self._affinity[agent_id] = choice
        self._affinity.move_to_end(agent_id)
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return True

    def release(self, request_id: str) -> None:
        """Drop the placement of a request that never started (its client left first)."""
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            placed[0].reserved -= placed[1]

    def stats(self) -> EngineStats:
        total = sum(r.kv_capacity_tokens for r in self.replicas) or 1
        used = sum(r.metrics.get("vllm:kv_cache_usage_perc", 0.0) * r.kv_capacity_tokens
                   for r in self.replicas)
        return EngineStats(
            kv_usage=used / total,
            running=int(sum(r.metrics.get("vllm:num_requests_running", 0) for r in self.replicas)),
            waiting=int(sum(r.metrics.get("vllm:num_requests_waiting", 0) for r in self.replicas)),
            preemptions_total=int(sum(r.metrics.get("vllm:num_preemptions_total", 0)
                                      for r in self.replicas)),
        )

    # -- requests ---------------------------------------------------------------------
    def _route(self, exclude: list[Replica]) -> Replica:
        """A request admitted without a placement: the serving replica with the most room."""
        live = [r for r in self.replicas if r.serving and r not in exclude]
        if not live:
            raise EngineError("no replica is answering")
        return max(live, key=lambda r: r.room)

    async def _post(self, replica: Replica, body: dict) -> aiohttp.ClientResponse:
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
            self._set_health(replica, False)
            raise _ReplicaFailed(f"replica {replica.url} failed: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        resp = self._streams.pop(request_id, None)
        if resp is not None:
            resp.close()  # vLLM aborts a request whose client went away

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self._session is None:
            raise EngineError(NOT_RUNNING)
        footprint = request.sampling.n * (len(request.prompt_token_ids) + request.sampling.max_tokens)
        placed = self._placed.pop(request.request_id, None)
        failed: list[Replica] = []
        while True:
            if placed is not None:
                replica, held = placed
                placed = None
            else:
                replica, held = self._route(failed), footprint
                replica.reserved += held
            replica.in_flight += 1
            emitted = False
            try:
                async for out in self._stream(replica, request):
                    emitted = True
                    yield out
                return
            except _ReplicaFailed as exc:
                failed.append(replica)
                others = [r for r in self.replicas if r.serving and r not in failed]
                if emitted or not others:
                    raise EngineError(str(exc)) from exc
                log.warning("%s before its first token; resending %s to another replica",
                            exc, request.request_id)
            finally:
                replica.reserved -= held
                replica.in_flight -= 1
                self._retire_if_drained(replica)

    async def _stream(self, replica: Replica, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        p = len(request.prompt_token_ids)
        body = {"model": self._served_name, "prompt": list(request.prompt_token_ids),
                **_sampling_body(request.sampling), "stream": True,
                "stream_options": {"include_usage": True}, "request_id": request.request_id}
        if self.send_priority:
            body["priority"] = int(request.priority)
        seqs = _RemoteSequences(request.sampling.n)
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
                    async with contextlib.aclosing(_read_stream(resp, k)) as updates:
                        async for choices, usage in updates:
                            if request.request_id not in self._streams:
                                break  # aborted: what is still buffered is not relayed
                            if seqs.update(choices, usage):
                                yield seqs.output(request.request_id, p, finished=False)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    if request.request_id in self._streams:  # not our abort: the replica failed
                        self._set_health(replica, False)
                        raise _ReplicaFailed(f"replica {replica.url} failed mid-request: {exc}") from exc
                    seqs.abort()
            if request.request_id not in self._streams:
                seqs.abort()
            yield seqs.output(request.request_id, p, finished=True)
        finally:
            self._streams.pop(request.request_id, None)


def _sampling_body(s: SamplingOptions) -> dict:
    """The sampling fields of a vLLM OpenAI completions request."""
    body = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k, "seed": s.seed, "stop": list(s.stop) or None,
            "ignore_eos": s.ignore_eos, "min_tokens": s.min_tokens, "n": s.n,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty}
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
    if s.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "schema",
                                                   "schema": json.loads(s.json_schema)}}
    elif s.json_object:
        body["response_format"] = {"type": "json_object"}
    return body


@dataclass
class _ChoiceUpdate:
    """What one network read added to one choice (sequence) of a streamed completion."""

    text: str = ""
    tokens: int = 0
    finish: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class _RemoteSequences:
    """Each sequence's text and token count so far, from the replica's streamed choices."""

    def __init__(self, n: int) -> None:
        self.text = [""] * n
        self.tokens = [0] * n
        self.finish: list[str | None] = [None] * n
        self.total: int | None = None  # vLLM's own count (usage), once it is sent
        self.last: dict[int, _ChoiceUpdate] = {}

    def update(self, choices: dict[int, _ChoiceUpdate], usage: int | None) -> bool:
        """Take one read's updates; True when some sequence got new tokens."""
        self.last = {i: c for i, c in choices.items() if 0 <= i < len(self.text)}
        for i, c in self.last.items():
            self.text[i] += c.text
            self.tokens[i] += c.tokens
            self.finish[i] = c.finish or self.finish[i]
        if usage is not None:
            self.total = usage
        return any(c.tokens for c in self.last.values())

    def abort(self) -> None:
        self.finish = [f or "abort" for f in self.finish]
        self.last = {}

    def output(self, request_id: str, prompt_tokens: int, finished: bool) -> EngineOutput:
        last = self.last if not finished else {}
        if finished and self.total is not None and len(self.tokens) == 1:
            self.tokens[0] = self.total  # vLLM's count: a last event may carry no token
        seqs = tuple(
            SequenceOutput(i, self.text[i], self.tokens[i],
                           (self.finish[i] or "abort") if finished else None,
                           last[i].text if i in last else "",
                           tuple(last[i].logprobs) if i in last else ())
            for i in range(len(self.text)))
        total = self.total if finished and self.total is not None else sum(self.tokens)
        return EngineOutput(request_id, seqs[0].text, prompt_tokens, total, finished,
                            seqs[0].finish_reason, delta_text=seqs[0].delta_text,
                            sequences=seqs)


async def _read_stream(
    resp: aiohttp.ClientResponse, k: int = 0,
) -> AsyncIterator[tuple[dict[int, _ChoiceUpdate], int | None]]:
    """(what each choice added, usage's token count) once per network read; `k`: the
    alternatives per token asked for (logprobs).

    vLLM sends one SSE event per token and choice. Everything already buffered is folded
    into one update, and the loop is given a turn after each read: a consumer that fell
    behind catches up in one step instead of replaying thousands of events without yielding
    to the event loop (which starved every other request and delayed aborts by seconds).
    """
    pending = b""
    async for data in resp.content.iter_any():
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        choices: dict[int, _ChoiceUpdate] = {}
        usage = None
        for raw in lines:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                c = choices.setdefault(int(choice.get("index", 0)), _ChoiceUpdate())
                c.tokens += 1
                c.text += choice.get("text") or ""
                c.finish = choice.get("finish_reason") or c.finish
                c.logprobs.extend(_logprobs(choice.get("logprobs"), k))
            if chunk.get("usage"):
                usage = int(chunk["usage"]["completion_tokens"])
        yield choices, usage
        await asyncio.sleep(0)


def _logprobs(lp: dict | None, k: int) -> list[TokenLogprob]:
    """vLLM's completions logprobs (parallel lists) as TokenLogprobs; its per-token top dict
    also holds the sampled token when that is not among the k most likely, so it is cut to
    the k most likely."""
    if not lp:
        return []
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    return [TokenLogprob(tok, float(v) if v is not None else float("-inf"),
                         tuple(sorted((top or {}).items(), key=lambda kv: -kv[1])[:k]))
            for tok, v, top in zip(tokens, values, tops)]
