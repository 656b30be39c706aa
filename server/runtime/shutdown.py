"""Stopping the server: one signal, a bounded grace period, never an engine crash.

The first SIGINT or SIGTERM starts a shutdown that ends within `grace_s` seconds
(`justitia serve --shutdown-grace-s`, default 10):

1. at once: the listening socket closes (uvicorn), `/readyz` answers 503 `stopping`, the
   engine's supervisor is told that the engine stops with the server (an engine that dies
   now is not restarted), and every open event stream (`GET /v1/agents/events`,
   `/v1/agents/{id}/events`, the dashboard's `/v1/scheduler/events`) ends with a
   `: the server is shutting down` comment: a watching client holds no connection open;
2. for the first `drain_s` seconds (the grace period less what closing the engine is given,
   at most 5 s) requests in flight run on; after it, requests still waiting for admission
   or generating fail with `503 the server is shutting down` (a streamed answer: that error
   in the stream); uvicorn then cancels what is left;
3. the lifespan's shutdown: the scheduler fails what still waits, saves what it measured of
   the engine, the engine and the retraining worker stop;
4. if all this has not ended when the grace period is over, a watchdog kills the server's
   child processes and exits the process (status 1).

A second signal ends the process at once: its child processes (the engine, the retraining
worker) are killed first (status 130). The engine never sees the terminal's Ctrl-C: it is
started with SIGINT blocked (server/engine/processes.py), so a Ctrl-C in the terminal
reaches only the server, which stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger("justitia.server")

T = TypeVar("T")

#: Default seconds from the first signal to the end of the process.
DEFAULT_GRACE_S = 10.0
#: Of the grace period, at most this much is kept for closing the engine (the rest drains).
CLOSE_RESERVE_S = 5.0
#: Exit status of a shutdown the watchdog had to end, and of one a second signal ended.
EXIT_GRACE_EXPIRED = 1
EXIT_FORCED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
#: What a stream or a failed request is told.
SHUTTING_DOWN = "the server is shutting down"
#: The least time a part of the close is given, even with the grace period spent: a close
#: that is quick (a socket, a thread) still gets to run.
MIN_STEP_S = 0.1
#: The last line of an event stream that the shutdown ended (an SSE comment: every client
#: ignores it, a person reading the stream sees why it ended).
FAREWELL = f": {SHUTTING_DOWN}\n\n"


def kill_children() -> int:
    """SIGKILL every descendant of this process (the engine's processes, the retraining
    worker); how many were signalled."""
    try:
        import psutil
    except ImportError:  # psutil comes with the server's dependencies; be safe anyway
        return 0
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return len(children)


class Shutdown:
    """The server's shutdown: requested once, observed by streams and the engine.

    `begin(reason)` may be called from a signal handler (it only sets flags and hands the
    rest to the event loop); `closing` is set on the loop; `until_closing` wraps an event
    stream so that it ends when the shutdown begins.
    """

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        if not grace_s > 0:
            raise ValueError(f"the shutdown grace period must be > 0 seconds, not {grace_s}")
        self.grace_s = float(grace_s)
        self.reason = ""
        self.started_at: float | None = None  # time.monotonic() of begin()
        self.drain_over = False
        # Set by `justitia serve` only: a server run inside another process (a test's, a
        # notebook's) must never end that process.
        self.hard_exit = False
        self.exit_code: Callable[[], int] = lambda: 0
        self._closing: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_begin: list[Callable[[], None]] = []
        self._on_drain_over: list[Callable[[], None]] = []
        # Requests in flight (not streamed) to stop when the drain time is over
        # (server/api/disconnect.py): each one's stop() fails it with 503.
        self.stoppers: set[Callable[[], None]] = set()
        self._lock = threading.Lock()

    @property
    def requested(self) -> bool:
        return self.started_at is not None

    def remaining_s(self) -> float | None:
        """Seconds left of the grace period (None: no shutdown has begun)."""
        if self.started_at is None:
            return None
        return self.grace_s - (time.monotonic() - self.started_at)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the server runs on (None before it starts)."""
        return self._loop

    @property
    def drain_s(self) -> float:
        """Seconds requests in flight may run on after the shutdown begins."""
        return max(0.0, self.grace_s - min(CLOSE_RESERVE_S, self.grace_s / 2))

    @property
    def closing(self) -> asyncio.Event:
        if self._closing is None:
            self._closing = asyncio.Event()
        return self._closing

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the server runs on (called at its start)."""
        self._loop = loop
        self._closing = asyncio.Event()
        if self.requested:  # a signal came during the start
            loop.call_soon(self._begin_on_loop)

    def on_begin(self, callback: Callable[[], None]) -> None:
        """`callback()` runs at once when the shutdown begins, in the caller of `begin`
        (perhaps a signal handler): it must only set a flag."""
        self._on_begin.append(callback)

    def on_drain_over(self, callback: Callable[[], None]) -> None:
        """`callback()` runs on the event loop when the drain time is over."""
        self._on_drain_over.append(callback)

    def begin(self, reason: str) -> bool:
        """Start the shutdown; False if it had started already."""
        with self._lock:
            if self.started_at is not None:
                return False
            self.started_at = time.monotonic()
            self.reason = reason
        for callback in self._on_begin:
            try:
                callback()
            except Exception:  # one part's bug must not stop the shutdown
                log.exception("shutdown callback failed")
        if self.hard_exit:
            watchdog = threading.Timer(self.grace_s, self._grace_expired)
            watchdog.daemon = True
            watchdog.name = "justitia-shutdown-watchdog"
            watchdog.start()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._begin_on_loop)
        return True

    def _begin_on_loop(self) -> None:
        log.warning("shutting down (%s): event streams end now, requests in flight have %.1f s, "
                    "the process ends within %.1f s", self.reason, self.drain_s, self.grace_s)
        self.closing.set()
        assert self._loop is not None
        self._loop.call_later(self.drain_s, self._end_drain)

    def _end_drain(self) -> None:
        if self.drain_over:
            return
        self.drain_over = True
        log.warning("shutting down: the drain time is over; requests still waiting or streaming "
                    "fail with 503 '%s'", SHUTTING_DOWN)
        for callback in [*self._on_drain_over, *self.stoppers]:
            try:
                callback()
            except Exception:
                log.exception("shutdown callback failed")

    def _grace_expired(self) -> None:
        killed = kill_children()
        # Printed, not logged: logging may hold a lock of the thread that hangs.
        print(f"justitia: the shutdown did not end within its grace period of {self.grace_s:g} s "
              f"({self.reason}); exiting now ({killed} child processes killed)", flush=True)
        os._exit(self.exit_code() or EXIT_GRACE_EXPIRED)

    def force(self) -> None:
        """End the process now (a second signal), its child processes first."""
        killed = kill_children()
        print(f"justitia: second signal; exiting now ({killed} child processes killed)", flush=True)
        os._exit(EXIT_FORCED)

    async def bounded(self, step: Awaitable[None], what: str, reserve_s: float = 1.0) -> None:
        """Await `step` (a part of the server's close); during a shutdown, for at most what
        is left of the grace period less `reserve_s`, after which the server's child
        processes are killed (what a stuck close would wait for) and the close goes on."""
        left = self.remaining_s()
        if left is None:
            await step
            return
        try:
            await asyncio.wait_for(step, max(MIN_STEP_S, left - reserve_s))
        except TimeoutError:
            killed = kill_children()
            log.warning("shutting down: %s did not end within the grace period; %d child "
                        "processes killed", what, killed)

    async def until_closing(self, source: AsyncIterator[T], farewell: T | None = None) -> AsyncIterator[T]:
        """The items of `source` until it ends or the shutdown begins (then `farewell`, if
        given, is the last item). `source` is closed either way."""
        closing = asyncio.ensure_future(self.closing.wait())
        step: asyncio.Future[T] | None = None
        it = aiter(source)
        try:
            while True:
                step = asyncio.ensure_future(anext(it))
                await asyncio.wait((step, closing), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    if farewell is not None:
                        yield farewell
                    return
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            closing.cancel()
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await step
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def shutdown_of(app: Any) -> Shutdown:
    """The app's Shutdown (every app that create_app builds has one)."""
    shutdown: Shutdown = app.state.shutdown
    return shutdown


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
