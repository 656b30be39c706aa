"""Streams of agent records: one agent's changes, or a tenant's agents multiplexed.

A multiplexed feed keeps the ids of its agents that changed since its last flush, so a
client watching 10,000 agents holds one connection, and the records it is sent are bounded
by the number of agents that change, not by the number of changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from server.runtime.agents import AgentEntry, AgentRecord

#: Records of a feed's first snapshot built and sent per turn of the event loop.
SNAPSHOT_CHUNK = 100


@dataclass(eq=False)
class _Feed:
    """One multiplexed event stream: the ids of its tenant's agents that changed since its
    last flush. Many changes of one agent between two flushes are sent as one record."""

    tenant: str
    ids: frozenset[str] | None  # None: every agent of the tenant
    dirty: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Feeds:
    """The open multiplexed feeds, by tenant; `changed` marks an agent in those that show it."""

    def __init__(self, agents: Mapping[str, AgentEntry], record: Callable[[AgentEntry], AgentRecord]) -> None:
        self._agents = agents
        self._record = record
        self._by_tenant: dict[str, set[_Feed]] = {}

    def changed(self, entry: AgentEntry) -> None:
        for feed in self._by_tenant.get(entry.tenant, ()):
            if feed.ids is None or entry.id in feed.ids:
                feed.dirty.add(entry.id)
                feed.wake.set()

    async def watch(self, tenant: str, ids: frozenset[str] | None, initial: Callable[[], Iterable[AgentEntry]],
                    *, interval_s: float, heartbeat_s: float) -> AsyncIterator[list[AgentRecord] | None]:
        """The records of the agents `initial()` gives once the feed is open, then at most one
        batch per `interval_s` of those that changed (None: heartbeat)."""
        feed = _Feed(tenant, ids)
        self._by_tenant.setdefault(tenant, set()).add(feed)
        try:
            first = list(initial())
            for start in range(0, max(len(first), 1), SNAPSHOT_CHUNK):
                if start:
                    # A turn of the event loop between chunks: a snapshot of 1,000 records
                    # costs the loop ~0.1 s, and twenty streams opened at once would hold
                    # health checks and every other request for seconds. Records are built
                    # when sent, and a change meanwhile is sent again after the snapshot.
                    await asyncio.sleep(0)
                yield [self._record(e) for e in first[start:start + SNAPSHOT_CHUNK]]
            while True:
                try:
                    await asyncio.wait_for(feed.wake.wait(), heartbeat_s)
                except TimeoutError:
                    yield None
                    continue
                await asyncio.sleep(interval_s)
                feed.wake.clear()
                dirty, feed.dirty = feed.dirty, set()
                records = [self._record(e) for i in dirty if (e := self._agents.get(i)) is not None]
                if records:
                    yield records
        finally:
            feeds = self._by_tenant.get(tenant)
            if feeds is not None:
                feeds.discard(feed)
                if not feeds:
                    del self._by_tenant[tenant]


async def agent_events(entry: AgentEntry, record: Callable[[AgentEntry], AgentRecord],
                       heartbeat_s: float) -> AsyncIterator[AgentRecord | None]:
    """The record now and after every change, until the agent ends (None: heartbeat)."""
    while True:
        changed = entry.next_change()
        # Whether it was terminal is read with the record sent: the agent may end while the
        # caller sends it, and that end is then sent next, not skipped.
        ended = entry.terminal
        yield record(entry)
        if ended:
            return
        try:
            await asyncio.wait_for(changed.wait(), heartbeat_s)
        except TimeoutError:
            yield None
