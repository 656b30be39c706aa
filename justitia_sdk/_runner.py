"""Running a batch: its inputs' agents, at most `concurrency` at once, watched over one
event stream (what a batch promises: `_batch.py`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio

from justitia_sdk._agent import Agent, registered_agents
from justitia_sdk._api import APIClient
from justitia_sdk._batch import DEFAULT_CONCURRENCY, Batch
from justitia_sdk._errors import (
    AgentCancelledError,
    AgentTimeoutError,
    APIError,
    ServerGoneError,
    is_retryable,
)
from justitia_sdk._handle import AgentHandle
from justitia_sdk._progress import LiveView

_WATCH_RETRY_S = 1.0


async def _watch(client: APIClient, batch: Batch) -> None:
    """Follow every agent of the batch over one event stream (reconnecting when it drops);
    poll the list of agents on a server that has no such stream."""
    while True:
        try:
            async for record in client.watch_agents():
                handle = batch._by_id.get(record.id)
                if handle is not None:
                    handle._update(record)
        except APIError as exc:
            if exc.status_code in (404, 405):  # a server older than the multiplexed stream
                await _poll(client, batch)
                return
        except Exception:  # noqa: BLE001 - a dropped view must not stop the batch
            pass
        await anyio.sleep(_WATCH_RETRY_S)


async def _poll(client: APIClient, batch: Batch) -> None:
    while True:
        await anyio.sleep(1.0)
        with contextlib.suppress(Exception):
            for record in await client.list_agents():
                handle = batch._by_id.get(record.id)
                if handle is not None:
                    handle._update(record)


def _gone_error(client: APIClient, batch: Batch, cause: BaseException) -> ServerGoneError:
    left = sum(not h.done for h in batch.handles)
    gone = cause if isinstance(cause, ServerGoneError) else client.gone_error(repr(cause))
    error = ServerGoneError(f"{gone}; the batch failed its {left} inputs not ended at once")
    error.__cause__ = cause
    return error


async def _run_one(client: APIClient, batch: Batch, handle: AgentHandle,
                   limiter: anyio.CapacityLimiter, metadata: Mapping[str, Any] | None,
                   timeout: float | None, retries: int) -> None:
    meta = {**(metadata or {}), "batch": {"id": batch.id, "size": len(batch),
                                          "index": handle.index,
                                          "concurrency": batch.concurrency}}
    try:
        async with limiter:
            for attempt in range(retries + 1):
                if batch.server_error is not None:
                    handle.error = batch.server_error
                    return
                handle.attempts = attempt + 1
                handle.error = None
                try:
                    with anyio.fail_after(timeout) if timeout else contextlib.nullcontext():
                        handle.result = await handle.agent.invoke(
                            handle.args, handle.kwargs, client=client, metadata=meta,
                            on_start=lambda run: batch._started(handle, run))
                    return
                except TimeoutError:
                    # fail_after cancelled the run: the agent was cancelled on the server.
                    handle.error = AgentTimeoutError(
                        f"agent #{handle.index} ({handle.agent.name}) did not finish within "
                        f"{timeout:g} s (attempt {attempt + 1} of {retries + 1})")
                except Exception as exc:  # one agent's failure must not lose the others
                    handle.error = exc
                if isinstance(handle.error, ServerGoneError) or client.server_gone:
                    batch._server_gone(_gone_error(client, batch, handle.error))
                    handle.error = batch.server_error
                    return
                if not is_retryable(handle.error):
                    return
    except BaseException:
        if batch.server_error is not None and not batch._cancel_requested:
            # The batch decided the server is gone and ended the runs still going.
            handle.error = batch.server_error
        else:
            # The batch was cancelled (Ctrl-C, a cancelled task, Batch.cancel): this run's
            # agent, if it had started, was cancelled on the server by the SDK on its way out.
            handle.error = AgentCancelledError(
                f"agent #{handle.index} ({handle.agent.name}) was cancelled with its batch")
        raise
    finally:
        handle.ended_at = time.time()
        if handle.run is not None:
            handle._update(handle.run.record)
        batch._ended(handle)


def resolve_agents(agent: Any, n_inputs: int) -> list[Agent[..., Any]]:
    """One agent per input from what `submit_many` was given: an @agent, a registered agent
    type's name, or a sequence of those (one per input)."""
    def one(a: Any) -> Agent[..., Any]:
        if isinstance(a, Agent):
            return a
        if isinstance(a, str):
            found = registered_agents().get(a)
            if found is None:
                known = ", ".join(sorted(registered_agents())) or "none in this process"
                raise ValueError(f"no @agent named {a!r} (defined: {known})")
            return found
        raise TypeError(f"{a!r} is not an agent: decorate the async function with @agent "
                        f"(from justitia_sdk import agent)")

    if isinstance(agent, (str, Agent)) or not isinstance(agent, Sequence):
        return [one(agent)] * n_inputs
    agents = [one(a) for a in agent]
    if len(agents) != n_inputs:
        raise ValueError(f"{len(agents)} agents for {n_inputs} inputs: give one agent, or "
                         f"one per input")
    return agents


def check_inputs(inputs: Any) -> list[Any]:
    if isinstance(inputs, (str, bytes)):
        raise TypeError(f"inputs must be a list of inputs (one agent run each), not a "
                        f"{type(inputs).__name__}: wrap a single input as [value]")
    if isinstance(inputs, Mapping):
        raise TypeError("inputs must be a list of inputs, not a dict: for one run with "
                        "keyword arguments pass [{...}]")
    try:
        return list(inputs)
    except TypeError:
        raise TypeError(f"inputs must be an iterable of inputs, not "
                        f"{type(inputs).__name__}") from None


def make_batch(agent: Any, inputs: Iterable[Any], title: str | None = None) -> Batch:
    values = check_inputs(inputs)
    agents = resolve_agents(agent, len(values))
    handles = [AgentHandle(i, a, v) for i, (a, v) in enumerate(zip(agents, values, strict=True))]
    names = sorted({a.name for a in agents})
    return Batch(handles, title or f"{len(handles)} agents ({', '.join(names)})")


async def run_batch(
    client: APIClient,
    batch: Batch,
    *,
    concurrency: int | None = None,
    progress: bool = True,
    metadata: Mapping[str, Any] | None = None,
    watch: bool | None = None,
    timeout: float | None = None,
    retries: int = 0,
) -> Batch:
    """Run every handle of `batch` (see the module's docstring for what it promises)."""
    if retries < 0:
        raise ValueError("retries must be >= 0")
    if timeout is not None and timeout <= 0:
        raise ValueError("timeout must be > 0 seconds")
    limit = DEFAULT_CONCURRENCY if concurrency is None else concurrency
    if limit < 1:
        raise ValueError("concurrency must be >= 1")
    limiter = anyio.CapacityLimiter(limit)
    batch.concurrency = limit
    batch.started_at = time.time()
    watch = progress if watch is None else watch

    batch._scope = anyio.CancelScope()
    if batch._cancel_requested:
        batch._scope.cancel()
    with batch._scope:
        async with AsyncExitStack() as stack:
            if progress:
                await stack.enter_async_context(LiveView(batch))
            async with anyio.create_task_group() as outer:
                if watch:
                    outer.start_soon(_watch, client, batch)
                try:
                    async with anyio.create_task_group() as runs:
                        batch._runs_scope = runs.cancel_scope
                        for h in batch.handles:
                            runs.start_soon(_run_one, client, batch, h, limiter, metadata,
                                            timeout, retries)
                finally:
                    batch.ended_at = time.time()
                    batch._runs_scope = None
                outer.cancel_scope.cancel()  # every run ended: stop watching
    return batch
