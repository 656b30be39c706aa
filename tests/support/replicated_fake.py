"""Several fake engines as one engine with replicas, on the real placement code.

`ReplicatedFakeEngine` is what the Ray adapter (server/engine/ray_serve.py) is to the
scheduler, without Ray: a `ReplicaPlacement` (server/engine/placement.py) over replicas that
are `FakeEngine`s in this process. The fast tier uses it to test what the server and the
dashboard do with replicas; the real Ray path runs in tests/engine/test_ray.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from server.engine.base import (
    NOT_STARTED,
    ChatMessages,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    SampleListener,
    StepListener,
)
from server.engine.placement import NoReplica, PlacedReplicas, ReplicaPlacement, footprint
from server.shared.step_time import StepSample
from tests.support.fake_engine import FakeEngine


class ReplicatedFakeEngine(PlacedReplicas):
    """`replicas` fake engines of `kv_capacity_tokens` each; M is their sum."""

    def __init__(self, replicas: int = 2, *, kv_capacity_tokens: int = 4096, **fake: Any) -> None:
        self.kv_capacity_tokens = kv_capacity_tokens  # each replica's
        self.engines = {f"fake-{i}": FakeEngine(kv_capacity_tokens=kv_capacity_tokens, **fake)
                        for i in range(replicas)}
        self.model = next(iter(self.engines.values())).model
        self.placement = ReplicaPlacement()
        self._info: EngineInfo | None = None
        self.ran_on: dict[str, str] = {}  # request id -> replica id
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError(NOT_STARTED)
        return dataclasses.replace(self._info, kv_capacity_tokens=self.placement.capacity or
                                   self._info.kv_capacity_tokens)

    @property
    def healthy(self) -> bool:
        return self._info is not None and bool(self.placement.serving)

    async def start(self) -> None:
        for rid, engine in self.engines.items():
            await engine.start()
            self.placement.join(rid, engine.info.kv_capacity_tokens)
        self._info = next(iter(self.engines.values())).info
        self.placement.started()
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.close()

    def tokenize(self, text: str) -> list[int]:
        return next(iter(self.engines.values())).tokenize(text)

    def apply_chat_template(self, messages: ChatMessages, tools: Sequence[dict[str, Any]] | None = None) -> str | None:
        return None

    def add_step_listener(self, listener: StepListener) -> None:
        for engine in self.engines.values():
            engine.add_step_listener(listener)

    def add_sample_listener(self, listener: SampleListener) -> None:
        """Each replica's step samples under its id, each step read as the whole fleet's
        (the Ray adapter's view: the batch times M over the replica's capacity)."""
        kv = self.kv_capacity_tokens
        for rid, engine in self.engines.items():
            def forward(_name: str, sample: StepSample, rid: str = rid) -> None:
                listener(rid, sample.scaled((self.placement.capacity or kv) / kv))

            engine.add_sample_listener(forward)

    def stats(self) -> EngineStats:
        self._refresh()
        return self.placement.stats()

    def _refresh(self) -> None:
        for rid, slot in self.placement.replicas.items():
            slot.stats = self.engines[rid].stats()

    # -- replicas (the rest is PlacedReplicas') ---------------------------------------------
    def describe_replicas(self) -> list[dict[str, Any]]:
        self._refresh()
        return super().describe_replicas()

    def set_replica(self, replica_id: str, serving: bool) -> None:
        """A replica goes down or comes back (as Ray's reports would say); M follows. Called
        from a test's thread: it happens on the server's event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._set_replica, replica_id, serving)

    def _set_replica(self, replica_id: str, serving: bool) -> None:
        slot = self.placement.replicas.get(replica_id)
        if slot is None and serving:
            slot = self.placement.join(replica_id, self.engines[replica_id].info.kv_capacity_tokens)
        if slot is not None:
            self.placement.set_serving(slot, serving, "the test took it down")
        self.placement.announce()

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        try:
            slot, held = self.placement.claim(request.request_id, footprint(request))
        except NoReplica as exc:
            raise EngineError(str(exc)) from exc
        self.ran_on[request.request_id] = slot.id
        try:
            async for out in self.engines[slot.id].generate(request):
                yield out
        finally:
            self.placement.unclaim(slot, held)

    async def abort(self, request_id: str) -> None:
        rid = self.ran_on.get(request_id)
        if rid is not None:
            await self.engines[rid].abort(request_id)
