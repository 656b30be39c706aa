"""Dashboard streams that cost what they show: one frame per tick per tenant, shared.

Building a frame reads the queue's order, the tenant's live agents and the top rows. Built
per stream, 500 streams of a tenant with 20,000 live agents scanned those agents 1,000 times
a second. Here every (tenant, admin) pair has one `SharedFeed`: while it has streams, one
task builds the tick's frame (what changed, as server/api/dashboard/frames.py computes it) once,
serializes it once and hands the same text to each of its streams; a stream that joins gets
the whole state (a `reset` frame) built at the same tick, shared by everyone joining then.
A stream too slow to take its frames is sent the whole state again once it catches up.

Streams are counted per tenant (`--max-dashboard-streams`, default 8): one more gets a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from server.api.dashboard.frames import HEARTBEAT_S, INTERVAL_S, DashboardFeed

if TYPE_CHECKING:
    from server.api.dashboard import DashboardHub

log = logging.getLogger("justitia.dashboard")

#: Frames a stream may have waiting before it is sent the whole state instead.
QUEUED_FRAMES = 8
KEEP_ALIVE = ": keep-alive\n\n"


class StreamLimitExceeded(Exception):
    """A tenant has its --max-dashboard-streams open (answered 429)."""

    retry_after = 5

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant {tenant!r} has {limit} dashboard streams open, the most "
                         "allowed (the server's --max-dashboard-streams): close one first")


def _event(frame: dict) -> str:
    return f"event: frame\ndata: {json.dumps(frame, separators=(',', ':'))}\n\n"


class _Subscriber:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue(QUEUED_FRAMES)
        self.needs_reset = True


class SharedFeed:
    """The frames of one (tenant, admin) view, built once per tick for all its streams."""

    def __init__(self, hub: DashboardHub, tenant: str, admin: bool, interval_s: float,
                 heartbeat_s: float, on_empty: Callable[[SharedFeed], None]) -> None:
        self.hub, self.tenant, self.admin = hub, tenant, admin
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self._on_empty = on_empty
        self._delta = DashboardFeed(hub, tenant, admin)
        self._subscribers: set[_Subscriber] = set()
        self._task: asyncio.Task[None] | None = None
        self.frames_built = 0  # ticks with a frame built (for tests and benchmarks)

    def subscribe(self) -> _Subscriber:
        sub = _Subscriber()
        self._subscribers.add(sub)
        if self._task is None or self._task.done():  # done: a frame failed; start again
            self._task = asyncio.create_task(self._run(), name=f"justitia-dashboard-{self.tenant}")
        # else: its first frame, the whole state, comes with the next tick (within interval_s)
        return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)
        if not self._subscribers:
            if self._task is not None:
                self._task.cancel()
                self._task = None
            self._on_empty(self)

    async def _run(self) -> None:
        quiet = 0.0
        try:
            while True:
                sent = self._tick()
                quiet = 0.0 if sent else quiet + self.interval_s
                if quiet >= self.heartbeat_s:
                    quiet = 0.0
                    self._send_all(KEEP_ALIVE)
                await asyncio.sleep(self.interval_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # a failed frame must not leave the streams hanging silently
            log.exception("dashboard frame failed")
            for sub in list(self._subscribers):
                with contextlib.suppress(asyncio.QueueFull):
                    sub.queue.put_nowait("")  # ends that stream: the page reconnects

    def _tick(self) -> bool:
        """One tick: the shared delta to streams that are up to date, the whole state to
        those joining or catching up. True if anything was sent."""
        if not self._subscribers:
            return False
        self.frames_built += 1
        delta = self._delta.frame()  # advances the shared state to now
        fresh = [s for s in self._subscribers if s.needs_reset]
        sent = False
        if fresh:
            # The whole state at the same instant the shared delta brought the others to.
            whole = DashboardFeed(self.hub, self.tenant, self.admin).frame()
            text = _event(whole) if whole is not None else None
            for sub in fresh:
                if text is not None and self._put(sub, text):
                    sub.needs_reset = False
                    sent = True
        if delta is not None:
            text = _event(delta)
            for sub in self._subscribers:
                if not sub.needs_reset and sub not in fresh:
                    sent = self._put(sub, text) or sent
        return sent

    def _send_all(self, text: str) -> None:
        for sub in self._subscribers:
            if not sub.needs_reset:
                self._put(sub, text)

    @staticmethod
    def _put(sub: _Subscriber, text: str) -> bool:
        try:
            sub.queue.put_nowait(text)
            return True
        except asyncio.QueueFull:
            # Too slow for the deltas: once it has caught up, it gets the whole state.
            sub.needs_reset = True
            return False


class DashboardStreams:
    """The open dashboard streams of every tenant, and their shared feeds."""

    def __init__(self, hub: DashboardHub, max_per_tenant: int, interval_s: float = INTERVAL_S,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.hub = hub
        self.max_per_tenant = max_per_tenant
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.open: dict[str, int] = {}
        self.feeds: dict[tuple[str, bool], SharedFeed] = {}

    def reserve(self, tenant: str) -> Callable[[], None]:
        """Count a new stream of `tenant` (raise StreamLimitExceeded over the limit); the
        function returned releases it."""
        n = self.open.get(tenant, 0)
        if n >= self.max_per_tenant:
            raise StreamLimitExceeded(tenant, self.max_per_tenant)
        self.open[tenant] = n + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self.open[tenant] - 1
            if left:
                self.open[tenant] = left
            else:
                del self.open[tenant]

        return release

    def _feed(self, tenant: str, admin: bool) -> SharedFeed:
        key = (tenant, admin)
        feed = self.feeds.get(key)
        if feed is None:
            def forget(f: SharedFeed) -> None:
                if self.feeds.get(key) is f:
                    del self.feeds[key]

            feed = self.feeds[key] = SharedFeed(
                self.hub, tenant, admin, self.interval_s, self.heartbeat_s, forget)
        return feed

    async def stream(self, tenant: str, admin: bool) -> AsyncIterator[str]:
        """One stream's server-sent events."""
        feed = self._feed(tenant, admin)
        sub = feed.subscribe()
        try:
            while True:
                text = await sub.queue.get()
                if not text:
                    return
                yield text
        finally:
            feed.unsubscribe(sub)

    async def close(self) -> None:
        for feed in list(self.feeds.values()):
            if feed._task is not None:
                feed._task.cancel()
