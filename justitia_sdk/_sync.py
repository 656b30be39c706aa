"""`Client`: `AsyncClient`'s blocking twin, for scripts without an event loop.

Its methods are made from `AsyncClient`'s, not written again: each runs the async method on
an event loop in a background thread (an anyio blocking portal) and waits for it. A coroutine
method becomes a call that returns its result, an async iterator a plain iterator, an async
context manager a plain one; so every parameter, default and docstring is the async one's.
`tests` check that every public `AsyncClient` method has its twin here.

Ctrl-C (KeyboardInterrupt) in a waiting call cancels the async call on the loop (a batch's
live agents are cancelled on the server) and waits for that before it propagates; a Ctrl-C
that Python dropped on the way still lands (justitia_sdk/_interrupts.py).
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack

import anyio
import anyio.from_thread

from justitia_sdk._api import ClientOptions, parameters_of
from justitia_sdk._batch import Batch
from justitia_sdk._client import AsyncClient
from justitia_sdk._handle import AgentHandle
from justitia_sdk._interrupts import raise_if_interrupted, remembered_interrupts

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
#: After an interrupt, how long the sync client waits for its agents to be cancelled.
_INTERRUPT_CLEANUP_S = 20.0
#: Waits in slices this long, so that Ctrl-C lands at once on any platform.
_WAIT_SLICE_S = 0.2
#: `AsyncClient`'s public methods that have no blocking twin, and why.
ASYNC_ONLY = {
    "as_default": "it sets the client that agents awaited in the caller's task use; "
                  "a script without an event loop awaits none",
}
#: `AsyncClient` names whose twin has another name.
RENAMED = {"aclose": "close"}


def _result(future: concurrent.futures.Future[R]) -> R:
    """`future.result()` in short waits, so that Ctrl-C lands at once on any platform."""
    with remembered_interrupts():
        while True:
            try:
                return future.result(timeout=_WAIT_SLICE_S)
            except TimeoutError:
                if future.done():
                    raise
            raise_if_interrupted()


def _get(items: queue.Queue[Any]) -> Any:
    with remembered_interrupts():
        while True:
            try:
                return items.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                raise_if_interrupted()


def _signature(method: Callable[..., Any]) -> inspect.Signature:
    """The async method's parameters, with no return annotation (the twin returns what the
    awaitable gives)."""
    return inspect.signature(method).replace(return_annotation=inspect.Signature.empty)


def _blocking(method: Callable[Concatenate[AsyncClient, P], Awaitable[R]]
              ) -> Callable[Concatenate[Client, P], R]:
    """The twin of a coroutine method: it returns the result."""

    @functools.wraps(method)
    def twin(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._wait(functools.partial(method, self._async, *args, **kwargs))

    twin.__signature__ = _signature(method)  # type: ignore[attr-defined]
    return twin


def _iterating(method: Callable[Concatenate[AsyncClient, P], AsyncIterator[T]]
               ) -> Callable[Concatenate[Client, P], Iterator[T]]:
    """The twin of an async iterator method: a plain iterator. Leaving the loop early closes
    the async one."""

    @functools.wraps(method)
    def twin(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._iterate(lambda: method(self._async, *args, **kwargs))

    twin.__signature__ = _signature(method)  # type: ignore[attr-defined]
    return twin


def _holding(method: Callable[Concatenate[AsyncClient, P], AbstractAsyncContextManager[T]],
             cancel: Callable[[T], None]) -> Callable[Concatenate[Client, P],
                                                      AbstractContextManager[T]]:
    """The twin of an async context manager method: a plain one. An error (or Ctrl-C) in
    the block calls `cancel` on what it holds before the async one is left."""

    @functools.wraps(method)
    def twin(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> AbstractContextManager[T]:
        return self._hold(lambda: method(self._async, *args, **kwargs), cancel)

    twin.__signature__ = _signature(method)  # type: ignore[attr-defined]
    return twin


def _plain(method: Callable[Concatenate[AsyncClient, P], R]) -> Callable[Concatenate[Client, P], R]:
    """The twin of a plain method: the same call on the async client."""

    @functools.wraps(method)
    def twin(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(self._async, *args, **kwargs)

    return twin


def _delegated(name: str, *, settable: bool = False) -> property:
    def get(self: Client) -> Any:
        return getattr(self._async, name)

    def set_(self: Client, value: Any) -> None:
        setattr(self._async, name, value)

    doc = getattr(AsyncClient, name).__doc__ if isinstance(
        getattr(AsyncClient, name, None), property) else None
    return property(get, set_ if settable else None, doc=doc)


class Client:
    """The blocking face of `AsyncClient`: the same calls and parameters, for scripts
    without an event loop.

    It runs an `AsyncClient` on an event loop in a background thread (an anyio blocking
    portal). Close it (or use `with Client() as c:`) to stop that thread.
    """

    @parameters_of(AsyncClient.__init__)
    def __init__(self, base_url: str | None = None, **options: Unpack[ClientOptions]) -> None:
        self._portal_cm: Any = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._async: AsyncClient = self._portal.call(
                functools.partial(_make, base_url, options))
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    # -- the portal -------------------------------------------------------------------------

    def _start(self, fn: Callable[[], Awaitable[R]]
               ) -> tuple[concurrent.futures.Future[R], threading.Event]:
        """`fn()` started on the loop, and an event set once it has ended."""
        finished = threading.Event()

        async def task() -> R:
            try:
                return await fn()
            finally:
                finished.set()

        return self._portal.start_task_soon(task), finished

    def _wait(self, fn: Callable[[], Awaitable[R]]) -> R:
        """Run `fn()` on the loop and wait for it. On Ctrl-C, cancel it there and wait for
        that before re-raising."""
        future, finished = self._start(fn)
        try:
            return _result(future)
        except KeyboardInterrupt:
            future.cancel()
            finished.wait(_INTERRUPT_CLEANUP_S)
            raise

    def _iterate(self, make: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
        items: queue.Queue[Any] = queue.Queue()
        end = object()

        async def pump() -> None:
            try:
                async for item in make():
                    items.put(item)
            finally:
                items.put(end)

        future, finished = self._start(pump)
        # A Ctrl-C dropped anywhere in the loop, the caller's body included, ends it at the
        # next wait (justitia_sdk/_interrupts.py).
        with remembered_interrupts():
            try:
                while (item := _get(items)) is not end:
                    yield item
                _result(future)  # the async iterator's error, if it raised
            finally:
                if not future.done():
                    future.cancel()
                    finished.wait(_INTERRUPT_CLEANUP_S)

    @contextmanager
    def _hold(self, make: Callable[[], AbstractAsyncContextManager[T]],
              cancel: Callable[[T], None]) -> Iterator[T]:
        entered: queue.Queue[Any] = queue.Queue()

        async def hold() -> None:
            leave = anyio.Event()
            async with make() as value:
                entered.put((value, leave))
                await leave.wait()

        future, finished = self._start(hold)
        value, leave = _get_entered(entered, future)
        try:
            yield value
        except BaseException:
            self._portal.call(cancel, value)
            self._portal.call(leave.set)
            finished.wait(_INTERRUPT_CLEANUP_S)
            raise
        self._portal.call(leave.set)
        try:
            _result(future)
        except KeyboardInterrupt:
            self._portal.call(cancel, value)
            finished.wait(_INTERRUPT_CLEANUP_S)
            raise

    # -- the client -------------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's connections and stop its event loop's thread."""
        if self._portal_cm is None:
            return
        try:
            self._portal.call(self._async.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None

    @property
    def async_client(self) -> AsyncClient:
        """The `AsyncClient` this one runs."""
        return self._async

    def as_completed(self, agent: Any, inputs: Iterable[Any], **kwargs: Any
                     ) -> Iterator[AgentHandle]:
        """Run a batch (as `submit_many`, same keywords) and yield its handles as their runs
        end. Leaving the loop early, or Ctrl-C, cancels the runs still going;
        `client.last_batch` keeps the batch."""

        async def ended() -> AsyncIterator[AgentHandle]:
            async with self._async.batch(agent, inputs, **kwargs) as batch:
                async for handle in batch.as_completed():
                    yield handle

        return self._iterate(ended)

    base_url = _delegated("base_url")
    api_key = _delegated("api_key")
    timeout = _delegated("timeout", settable=True)
    request_timeout = _delegated("request_timeout", settable=True)
    max_retries = _delegated("max_retries", settable=True)
    retry_window_s = _delegated("retry_window_s", settable=True)
    server_gone_s = _delegated("server_gone_s", settable=True)

    @property
    def server_gone(self) -> bool:
        """True once no request has got through to the server for `server_gone_s` seconds
        (until one does again)."""
        return self._async.server_gone

    @property
    def last_batch(self) -> Batch | None:
        """The latest batch started on this client: still here after an interrupt."""
        return self._async.last_batch

    # The agent API.
    register_agent = _blocking(AsyncClient.register_agent)
    get_agent = _blocking(AsyncClient.get_agent)
    list_agents = _blocking(AsyncClient.list_agents)
    finish_agent = _blocking(AsyncClient.finish_agent)
    cancel_agent = _blocking(AsyncClient.cancel_agent)
    pause_agent = _blocking(AsyncClient.pause_agent)
    resume_agent = _blocking(AsyncClient.resume_agent)
    watch_agent = _iterating(AsyncClient.watch_agent)
    watch_agents = _iterating(AsyncClient.watch_agents)
    scheduler = _blocking(AsyncClient.scheduler)
    models = _blocking(AsyncClient.models)
    ready = _blocking(AsyncClient.ready)
    gone_error = _plain(AsyncClient.gone_error)
    # Inference.
    complete = _blocking(AsyncClient.complete)
    chat = _blocking(AsyncClient.chat)
    # Running agents.
    run = _blocking(AsyncClient.run)
    submit_many = _blocking(AsyncClient.submit_many)
    batch = _holding(AsyncClient.batch, Batch.cancel)


async def _make(base_url: str | None, options: ClientOptions) -> AsyncClient:
    return AsyncClient(base_url, **options)


def _get_entered(entered: queue.Queue[Any], future: concurrent.futures.Future[None]) -> Any:
    """What the async context manager entered with, or its error if it failed first."""
    with remembered_interrupts():
        while True:
            try:
                return entered.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                raise_if_interrupted()
                if future.done():
                    future.result()  # raises its error
                    raise RuntimeError("the context ended before it was entered") from None


__all__ = ["ASYNC_ONLY", "RENAMED", "Client"]
