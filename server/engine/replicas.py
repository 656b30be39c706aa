"""The replica pool of the remote engine: membership, health, capacity, placement, affinity.

A replica is one vLLM OpenAI server. The pool knows what each one holds (its KV capacity,
the tokens reserved by our requests routed to it, its health from `/metrics`) and answers
the scheduler's questions about them:

- capacity: M is the sum over serving replicas of (num_gpu_blocks - 1) x block_size, from
  the `vllm:cache_config_info` metric (one block per replica is vLLM's reserve); a replica
  that stops answering leaves M until it answers again, and capacity listeners hear every
  change of M;
- placement: a request is admitted only once `place` found a replica with room for its
  whole footprint (the sum of free memory is not enough: a request cannot span replicas),
  preferring the replica that served the agent before, which holds its prompt prefix in
  vLLM's prefix cache;
- membership: replicas are added and removed while serving; one being removed drains (takes
  no new requests) and leaves once its requests have finished;
- the iteration time: between two polls a replica that keeps `r` requests running for `dt`
  seconds and generates `g` tokens took about `dt * r / g` seconds per step.

Streaming requests and their wire format live in `server/engine/remote.py` and
`server/engine/openai_wire.py`; the pool does no request I/O besides describing and polling.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from server.engine.base import (
    CapacityListener,
    EngineError,
    EngineStats,
    InvalidRequestError,
    StepListener,
)

log = logging.getLogger("justitia.engine.remote")

AFFINITY_ENTRIES = 10_000  # agents remembered for prefix affinity (least recently used go)


@dataclass
class Replica:
    url: str
    model: str = ""
    served_name: str = ""  # the model's id in the replica's /v1/models
    kv_capacity_tokens: int = 0
    block_size: int = 16
    max_model_len: int = 0
    reserved: int = 0  # tokens of our in-flight requests routed here (p + max_tokens)
    in_flight: int = 0
    healthy: bool = False
    draining: bool = False  # being removed: takes no new requests, leaves when empty
    metrics: dict[str, float] = field(default_factory=dict)
    last_poll: float | None = None

    @property
    def serving(self) -> bool:
        return self.healthy and not self.draining

    @property
    def room(self) -> int:
        return self.kv_capacity_tokens - self.reserved

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url, "model": self.model, "kv_capacity_tokens": self.kv_capacity_tokens,
            "block_size": self.block_size, "reserved_tokens": self.reserved,
            "requests_in_flight": self.in_flight, "healthy": self.healthy,
            "draining": self.draining,
            "kv_usage": self.metrics.get("vllm:kv_cache_usage_perc", 0.0),
            # a counter: the dashboard's per-replica throughput is its rate
            "generation_tokens": self.metrics.get("vllm:generation_tokens_total", 0.0),
        }


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
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


class ReplicaPool:
    """The replicas acting as one engine (see the module docstring)."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one replica URL is needed")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self._session: aiohttp.ClientSession | None = None
        # The capacity the scheduler was last told (None: before `started`).
        self._announced: int | None = None
        self._step_listeners: list[StepListener] = []
        self._capacity_listeners: list[CapacityListener] = []
        self._placed: dict[str, tuple[Replica, int]] = {}
        self._affinity: collections.OrderedDict[str, Replica] = collections.OrderedDict()

    # -- membership and health ----------------------------------------------------------
    async def describe_all(self, session: aiohttp.ClientSession) -> None:
        """Read every replica's model and KV cache (EngineError if one does not answer as
        a vLLM OpenAI server, or they serve different models)."""
        self._session = session
        for r in self.replicas:
            await self._describe(r)
        models = {r.model for r in self.replicas}
        if len(models) != 1:
            raise EngineError(f"the replicas serve different models: {sorted(models)}")

    def started(self, kv_capacity_tokens: int) -> None:
        """The engine told the scheduler this M; later changes are announced."""
        self._announced = kv_capacity_tokens

    async def _describe(self, r: Replica) -> None:
        assert self._session is not None
        try:
            async with self._session.get(r.url + "/v1/models") as resp:
                models = (await resp.json())["data"]
            async with self._session.get(r.url + "/metrics") as resp:
                values, cache = parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError) as exc:
            raise EngineError(f"replica {r.url} did not answer as a vLLM OpenAI server: {exc}") from exc
        if not models or "num_gpu_blocks" not in cache:
            raise EngineError(f"replica {r.url} reports no model or no KV cache configuration (is it "
                              "running with --disable-log-stats? Justitia reads its /metrics)")
        r.model = models[0].get("root") or models[0]["id"]
        r.served_name = models[0]["id"]
        r.max_model_len = int(models[0].get("max_model_len") or 0)
        r.block_size = int(cache.get("block_size", 16))
        r.kv_capacity_tokens = (int(cache["num_gpu_blocks"]) - 1) * r.block_size
        r.metrics = values
        r.healthy = True
        r.last_poll = time.monotonic()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, r: Replica) -> None:
        assert self._session is not None
        now = time.monotonic()
        try:
            async with self._session.get(r.url + "/metrics",
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                values, _ = parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.set_health(r, False)
            return
        before, then = r.metrics, r.last_poll
        r.metrics, r.last_poll = values, now
        self.set_health(r, True)
        if then is None:
            return
        running = (before.get("vllm:num_requests_running", 0) + values.get("vllm:num_requests_running", 0)) / 2
        generated = values.get("vllm:generation_tokens_total", 0) - before.get("vllm:generation_tokens_total", 0)
        if running >= 1 and generated > 0:
            step_s = (now - then) * running / generated
            # Reported against the whole M, as if every replica were as full as this one:
            # the estimator's tau is per full cache, and replicas share the load evenly.
            kv_in_use = values.get("vllm:kv_cache_usage_perc", 0.0) * self.capacity
            for listener in self._step_listeners:
                listener(step_s, kv_in_use)

    def add_step_listener(self, listener: StepListener) -> None:
        self._step_listeners.append(listener)

    def set_health(self, r: Replica, healthy: bool) -> None:
        if r.healthy == healthy:
            return
        r.healthy = healthy
        if healthy:
            log.info("replica %s answers again", r.url)
        else:
            log.warning("replica %s stopped answering; its capacity leaves M", r.url)
        self._capacity_changed()

    @property
    def any_serving(self) -> bool:
        return any(r.serving for r in self.replicas)

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

    # -- capacity -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """M: the KV tokens of the replicas taking requests now."""
        return sum(r.kv_capacity_tokens for r in self.replicas if r.serving)

    def add_capacity_listener(self, listener: CapacityListener) -> None:
        """`listener(M)` after every change of M (replica added, removed, failed, back)."""
        self._capacity_listeners.append(listener)

    def _capacity_changed(self) -> None:
        m = self.capacity
        if self._announced is None or m <= 0 or m == self._announced:
            return  # with no replica left M keeps its last value: nothing is admitted anyway
        self._announced = m
        log.info("KV capacity is now %d tokens over %d replicas", m,
                 sum(r.serving for r in self.replicas))
        for listener in self._capacity_listeners:
            listener(m)

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

    # -- placement and affinity ---------------------------------------------------------
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

    def claim(self, request_id: str, footprint: int, exclude: list[Replica]) -> tuple[Replica, int]:
        """The replica a request runs on and the tokens held there for it: its placement
        (made by `place`) on the first try, else the serving replica with the most room
        outside `exclude` (those that failed it). Give it back with `unclaim`."""
        placed = self._placed.pop(request_id, None)  # gone after the first try
        if placed is not None:
            replica, held = placed
        else:
            live = [r for r in self.replicas if r.serving and r not in exclude]
            if not live:
                raise EngineError("no replica is answering")
            replica, held = max(live, key=lambda r: r.room), footprint
            replica.reserved += held
        replica.in_flight += 1
        return replica, held

    def unclaim(self, replica: Replica, held: int) -> None:
        replica.reserved -= held
        replica.in_flight -= 1
        self._retire_if_drained(replica)

    def others_serving(self, exclude: list[Replica]) -> bool:
        return any(r.serving and r not in exclude for r in self.replicas)
