"""`parallel_map`: one stage of a task-parallel agent; `run_sync`: a blocking tool in it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")
P = ParamSpec("P")


async def run_sync(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` in a worker thread, awaited: how an async agent calls a blocking
    (sync) tool, such as `requests.get` or `time.sleep`, without stopping the event loop, and
    so every other agent and request of the process, while it runs.

    Equivalent to `await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))`;
    anyio's default limit of 40 threads at once applies. Cancelling the caller does not stop
    the thread: the call runs to its end and its result is dropped.
    """
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def _first_failure(group: BaseExceptionGroup) -> BaseException:
    """The first real error in a task group's exception group (cancellations are noise)."""
    cancelled = anyio.get_cancelled_exc_class()
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_failure(exc)
        if not isinstance(exc, cancelled):
            return exc
    return group


async def parallel_map(
    fn: Callable[..., Awaitable[T] | T],
    *iterables: Iterable[Any],
    concurrency: int | None = None,
) -> list[T]:
    """Call `fn` on every item at once and return the results in input order.

    Like `map`, several iterables are zipped (`parallel_map(f, xs, ys)` calls `f(x, y)`).
    `fn` may be an async function or a function returning an awaitable (a lambda around
    `llm(...)`). `concurrency` caps how many calls run at once (by default all do: the
    server, not the client, decides what runs). The first failure cancels the other calls,
    which aborts their engine requests, and is raised as itself, not as an exception group.
    Calls inherit the caller's context, so requests made in them carry the agent's id.
    """
    if not iterables:
        raise TypeError("parallel_map() needs at least one iterable")
    items = list(zip(*iterables, strict=True)) if len(iterables) > 1 else [
        (x,) for x in iterables[0]]
    results: list[Any] = [None] * len(items)
    limiter = anyio.CapacityLimiter(concurrency) if concurrency else None

    async def one(i: int, args: tuple[Any, ...]) -> None:
        if limiter is None:
            results[i] = await _call(fn, args)
        else:
            async with limiter:
                results[i] = await _call(fn, args)

    try:
        async with anyio.create_task_group() as tg:
            for i, args in enumerate(items):
                tg.start_soon(one, i, args)
    except BaseExceptionGroup as group:
        failure = _first_failure(group)
        if failure is group:
            raise
        raise failure from None
    return results


async def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    value = fn(*args)
    if inspect.isawaitable(value):
        value = await value
    return value
