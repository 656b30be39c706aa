"""`AsyncClient`: the server's API (`APIClient`) and running agents on it, one at a time or
in batches. `Client` (`_sync.py`) is its blocking twin."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar, Unpack

import anyio

from justitia_sdk._agent import Agent
from justitia_sdk._api import APIClient, ClientOptions, current_client, default_url, parameters_of
from justitia_sdk._batch import Batch
from justitia_sdk._runner import make_batch, resolve_agents, run_batch

T = TypeVar("T")


class AsyncClient(APIClient):
    """Talks to a Justitia server.

    ```python
    async with AsyncClient("http://127.0.0.1:8000") as client:
        summary = await client.run(summarize, doc)
        batch = await client.submit_many(summarize, docs)
    ```

    `base_url` defaults to `JUSTITIA_URL` (else http://127.0.0.1:8000), `api_key` to
    `JUSTITIA_API_KEY`. `timeout` bounds control calls; `request_timeout` bounds one
    completion, which may legitimately wait a long time behind agents the scheduler serves
    first. 429 and 503 answers and refused connections are retried with backoff for
    `retry_window_s` seconds (120 by default: longer than a server restart takes), or at most
    `max_retries` times when that is set; a completion whose connection broke (the server
    died under it) is sent again, within a window of its own from the break.
    `server_gone_s` (120 by default) is the client's liveness window: once none of its
    requests has got through to the server (refused or broken connections, 503s) for that
    long, the server is taken for gone and every request fails at once with
    `ServerGoneError` until one gets through again; a batch then fails all its pending inputs.
    `max_connections` bounds the connections it opens (requests past it wait their turn).
    """

    @parameters_of(APIClient.__init__)
    def __init__(self, base_url: str | None = None, **options: Unpack[ClientOptions]) -> None:
        super().__init__(base_url, **options)
        #: The latest batch started on this client: still here after an interrupt.
        self.last_batch: Batch | None = None

    # -- running agents -----------------------------------------------------------------------

    async def run(self, agent: Agent[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Submit one agent run on this client and wait for its result."""
        result: T = await resolve_agents(agent, 1)[0].invoke(args, kwargs, client=self)
        return result

    async def submit_many(
        self,
        agent: Agent[..., Any] | str | Sequence[Agent[..., Any] | str],
        inputs: Iterable[Any],
        *,
        concurrency: int | None = None,
        progress: bool = True,
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retries: int = 0,
    ) -> Batch:
        """Run one agent per input and wait for all of them; returns the batch.

        An input that is a dict is passed as keyword arguments, a tuple as positional
        arguments, anything else as the single argument. `agent` is an `@agent` (or the
        name of one), or a sequence of them, one per input (a mixed batch).
        `concurrency` caps the agents running at once (default 64). `timeout` (seconds)
        cancels a run that takes longer; `retries` runs a failed or timed-out input again,
        up to that many times, when a retry can change the outcome (`is_retryable`: never
        after a 4xx about the input). One agent's failure is recorded on its handle and does
        not stop the others; the handles are in input order. If the client takes the server
        for gone (`server_gone_s`), every input not ended fails at once with one
        `ServerGoneError` (`batch.server_error`). If the batch is interrupted
        (Ctrl-C, cancellation) its live agents are cancelled on the server and the batch,
        with the results that finished, stays in `client.last_batch`.
        """
        async with self.batch(agent, inputs, concurrency=concurrency, progress=progress,
                              title=title, metadata=metadata, timeout=timeout,
                              retries=retries) as batch:
            pass
        return batch

    @contextlib.asynccontextmanager
    async def batch(
        self,
        agent: Agent[..., Any] | str | Sequence[Agent[..., Any] | str],
        inputs: Iterable[Any],
        *,
        concurrency: int | None = None,
        progress: bool = True,
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retries: int = 0,
    ) -> AsyncIterator[Batch]:
        """`submit_many` as a context: the batch runs while the block runs, so results can
        be used as they come; leaving the block waits for the rest, an error in the block
        cancels them.

        ```python
        async with client.batch(summarize, docs) as batch:
            async for handle in batch.as_completed():
                print(handle.index, handle.status, handle.result)
        ```
        """
        batch = make_batch(agent, inputs, title)
        self.last_batch = batch
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(
                run_batch, self, batch, concurrency=concurrency, progress=progress,
                metadata=metadata, timeout=timeout, retries=retries))
            try:
                yield batch
            except BaseException:
                batch.cancel()
                raise

    def as_default(self) -> AbstractContextManager[AsyncClient]:
        """`with client.as_default():` agents called directly (`await my_agent(x)`) use it."""
        return _Default(self)


class _Default(AbstractContextManager["AsyncClient"]):
    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    def __enter__(self) -> AsyncClient:
        self._token = current_client.set(self.client)
        return self.client

    def __exit__(self, *exc: object) -> None:
        current_client.reset(self._token)


__all__ = ["AsyncClient", "default_url"]
