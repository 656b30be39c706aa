"""Cancel a handler's work when its client goes away.

Starlette cancels a *streaming* response's iterator when the client disconnects, but a plain
handler runs to the end and keeps its engine request (and its KV cache) alive. Racing the
work against the ASGI `http.disconnect` message fixes that: whichever finishes first cancels
the other, and cancellation reaches the engine, which aborts the request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    result: list[T] = []

    try:
        async with anyio.create_task_group() as tg:

            async def run_work() -> None:
                result.append(await work())
                tg.cancel_scope.cancel()

            async def watch() -> None:
                await _wait_for_disconnect(request)
                tg.cancel_scope.cancel()

            tg.start_soon(run_work)
            tg.start_soon(watch)
    except BaseExceptionGroup as group:
        # Only the work can fail; surface its error as itself so that the app's handlers
        # turn it into the right status code.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    if not result:
        raise ClientDisconnected()
    return result[0]
