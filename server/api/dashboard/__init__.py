"""The live dashboard (`GET /dashboard`) and the stream that feeds it (`GET /v1/scheduler/events`).

`DashboardHub` is built once per server, next to the live scheduler. It keeps what the
scheduler itself does not: the live agents in a set of their own (the scheduler's table also
holds ended agents for an hour), one sample a second of the KV cache and the throughput for
the last five minutes, and the last finished agents with their first ETA and deadline. It
learns of agents as a listener of the scheduler (server/runtime/agent_listeners.py), so it costs
nothing on the request path.

`DashboardFeed` builds the frames of one view (a tenant's, or the admin's): what changed
since its last frame (server/api/dashboard/frames.py). One of them per view serves all of that
view's streams, once per tick (server/api/dashboard/shared.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.runtime.agent_listeners import AgentListener

if TYPE_CHECKING:
    from server.engine.base import EngineOutput
    from server.runtime.agents import AgentEntry
    from server.runtime.live import LiveScheduler

log = logging.getLogger("justitia.dashboard")

# Five minutes of one sample a second: the KV and throughput charts.
SAMPLES_KEPT = 300
SAMPLE_EVERY_S = 1.0
# The finished agents the scatter plot and the JCT distribution draw.
FINISHED_KEPT = 2000
# The global order of the live agents is shared by every stream for this long.
ORDER_CACHE_S = 0.2


@dataclass(frozen=True)
class Finished:
    """A finished agent as the plots need it (times in seconds from its submission)."""

    seq: int
    tenant: str
    id: str
    type: str
    jct_s: float
    first_eta_s: float | None
    deadline_s: float | None

    def row(self) -> list[Any]:
        return [self.id, self.type, _r(self.jct_s), _r(self.first_eta_s), _r(self.deadline_s)]


def _r(x: float | None, digits: int = 2) -> float | None:
    """Rounded for the wire: the page shows two decimals at most, and rounded values change
    less often, so fewer rows are re-sent."""
    return None if x is None else round(x, digits)


class DashboardHub(AgentListener):
    def __init__(self, scheduler: LiveScheduler, clock: Any = time.monotonic) -> None:
        self.scheduler = scheduler
        self._clock = clock
        self.live: dict[str, AgentEntry] = {}
        self.samples: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=SAMPLES_KEPT)
        self.finished: collections.deque[Finished] = collections.deque(maxlen=FINISHED_KEPT)
        self.finished_total: collections.Counter[str] = collections.Counter()
        self._sample_seq = 0
        self._finished_seq = 0
        self._output_tokens = 0  # of finished requests, since the server started
        self._last_tokens: tuple[float, int] | None = None
        self._replica_tokens: dict[str, tuple[float, float]] = {}
        self._order: tuple[float, list[str], dict[str, int]] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- listener of the scheduler -----------------------------------------------------------
    def on_agent_registered(self, entry: AgentEntry) -> None:
        self.live[entry.id] = entry
        self._order = None  # the cached order is of other agents: a new stream must see this one

    def on_agent_ended(self, entry: AgentEntry) -> None:
        self.live.pop(entry.id, None)
        self._order = None
        if entry.state != "finished" or entry.finished_at is None:
            return
        self._finished_seq += 1
        self.finished_total[entry.tenant] += 1
        self.finished.append(Finished(
            seq=self._finished_seq, tenant=entry.tenant, id=entry.id, type=entry.type,
            jct_s=entry.finished_at - entry.submitted_at, first_eta_s=entry.first_eta_s,
            deadline_s=entry.final_view.deadline_s if entry.final_view is not None else None))

    def on_request_finished(self, entry: AgentEntry, out: EngineOutput) -> None:
        self._output_tokens += out.output_tokens

    # -- sampling ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.sample()
        self._task = asyncio.create_task(self._sampler(), name="justitia-dashboard-sampler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sampler(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            try:
                self.sample()
            except Exception:  # a failed sample must not end the dashboard's history
                log.exception("dashboard sample failed")

    def sample(self) -> None:
        """One point of the KV and throughput charts."""
        s = self.scheduler
        now = self._clock()
        capacity = s.dispatcher.kv_capacity
        stats = s.engine.stats()
        point: dict[str, Any] = {
            "t": round(s.now(), 1),
            "reserved": int(s.dispatcher.ledger.reserved_kv),
            "used": int(stats.kv_usage * capacity),
            "capacity": int(capacity),
            "tokens_per_s": self._rate(now),
        }
        replicas = self._replicas(now)
        if replicas:
            point["replicas"] = replicas
        self._sample_seq += 1
        self.samples.append((self._sample_seq, point))

    def _rate(self, now: float) -> float:
        last, self._last_tokens = self._last_tokens, (now, self._output_tokens)
        if last is None or now <= last[0]:
            return 0.0
        return round((self._output_tokens - last[1]) / (now - last[0]), 1)

    def _replicas(self, now: float) -> list[dict[str, Any]]:
        """Per engine replica (--ray, --engine-url): its id, state, KV capacity, reserved
        tokens, requests in flight, KV use, and output tokens per second where the replica
        counts them."""
        engine = self.scheduler.capabilities.replicas
        if engine is None:
            return []
        out = []
        for r in engine.describe_replicas():
            rid = str(r["id"])
            capacity = int(r["kv_capacity_tokens"])
            point: dict[str, Any] = {
                "id": rid, "state": r.get("state", "serving"), "capacity": capacity,
                "reserved": int(r.get("reserved_tokens", 0)), "in_flight": int(r.get("requests_in_flight", 0)),
                "used": int(r.get("kv_usage", 0.0) * capacity), "healthy": bool(r.get("healthy", True)),
            }
            if "generation_tokens" in r:  # a counter: the throughput is its rate
                tokens = float(r["generation_tokens"])
                last = self._replica_tokens.get(rid)
                self._replica_tokens[rid] = (now, tokens)
                rate = (tokens - last[1]) / (now - last[0]) if last is not None and now > last[0] else 0.0
                point["tokens_per_s"] = round(max(rate, 0.0), 1)
            out.append(point)
        return out

    def samples_after(self, seq: int) -> list[tuple[int, dict[str, Any]]]:
        if not self.samples or self.samples[-1][0] <= seq:
            return []
        return [item for item in self.samples if item[0] > seq]

    def finished_after(self, seq: int, tenant: str | None) -> list[Finished]:
        """Finished agents after `seq` (of `tenant`; None: everyone's)."""
        if not self.finished or self.finished[-1].seq <= seq:
            return []
        return [f for f in self.finished if f.seq > seq and (tenant is None or f.tenant == tenant)]

    # -- the queue -----------------------------------------------------------------------------
    def order(self) -> tuple[list[str], dict[str, int]]:
        """The live agents in the policy's order (the order its ETAs are projected in) and
        each one's position (1 = next), shared by every stream for ORDER_CACHE_S."""
        now = self._clock()
        if self._order is not None and now - self._order[0] < ORDER_CACHE_S:
            return self._order[1], self._order[2]
        # An agent that ended by a path the listeners did not hear of must not stay "live".
        for agent_id in [i for i, e in self.live.items() if e.terminal]:
            del self.live[agent_id]
        disp = self.scheduler.dispatcher
        key = disp.policy.static_key
        known = [(key(a), i) for i in self.live if (a := disp.agents.get(i)) is not None]
        known.sort(key=lambda pair: pair[0])
        ids = [i for _, i in known]
        # Agents the dispatcher no longer holds (ending right now) go last.
        ids.extend(i for i in self.live if i not in disp.agents)
        positions = {i: n for n, i in enumerate(ids, 1)}
        self._order = (now, ids, positions)
        return ids, positions
