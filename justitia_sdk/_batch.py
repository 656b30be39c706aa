"""Batch submission: many agent runs at once, each with a handle that tracks its live status."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, overload

import anyio

from justitia_sdk._context import AgentRun
from justitia_sdk._errors import JustitiaError
from justitia_sdk._models import AgentRecord

if TYPE_CHECKING:
    from rich.table import Table

    from justitia_sdk._agent import Agent
    from justitia_sdk._client import AsyncClient


def split_input(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A dict is keyword arguments, a tuple positional arguments, anything else one argument."""
    if isinstance(value, Mapping):
        return (), dict(value)
    if isinstance(value, tuple):
        return value, {}
    return (value,), {}


class AgentHandle:
    """One run of a batch: its live server record, and its result or error once done."""

    def __init__(self, index: int, agent: Agent[..., Any], value: Any) -> None:
        self.index = index
        self.agent = agent
        self.input = value
        self.args, self.kwargs = split_input(value)
        self.run: AgentRun | None = None
        #: The record at registration: its `eta_s` is the first ETA the server promised.
        self.first_record: AgentRecord | None = None
        #: The latest record seen (event stream, then the finish call's answer).
        self.record: AgentRecord | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.started_at: float | None = None  # time.time() when registered
        self.ended_at: float | None = None

    def __repr__(self) -> str:
        return f"<AgentHandle #{self.index} {self.agent.name} {self.status}>"

    def _on_start(self, run: AgentRun) -> None:
        self.run = run
        self.first_record = self.record = run.record
        self.started_at = time.time()

    def _update(self, record: AgentRecord) -> None:
        self.record = record

    @property
    def id(self) -> str | None:
        return self.record.id if self.record else None

    @property
    def status(self) -> str:
        """`pending` before registration, `failed` if the function raised, else the state."""
        if self.error is not None:
            return "failed"
        if self.record is None:
            return "pending"
        return self.record.state

    @property
    def ok(self) -> bool:
        return self.done and self.error is None

    @property
    def progress(self) -> tuple[int, int]:
        """(requests done, requests submitted so far)."""
        r = self.record
        return (r.requests_done, r.requests_total) if r else (0, 0)

    @property
    def elapsed_s(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at or time.time()) - self.started_at

    @property
    def jct_s(self) -> float | None:
        """Job completion time: the server's (finished_at - submitted_at), else measured here."""
        if self.record is not None and self.record.jct_s is not None:
            return self.record.jct_s
        return self.elapsed_s if self.done else None

    @property
    def first_eta_s(self) -> float | None:
        """The ETA the server gave at submission."""
        for r in (self.record, self.first_record):
            if r is not None and r.first_eta_s is not None:
                return r.first_eta_s
        return self.first_record.eta_s if self.first_record else None

    @property
    def eta_s(self) -> float | None:
        return self.record.eta_s if self.record else None

    @property
    def fair_finish_s(self) -> float | None:
        return self.record.fair_finish_s if self.record else None

    @property
    def delay_bound_s(self) -> float | None:
        return self.record.delay_bound_s if self.record else None

    @property
    def deadline_s(self) -> float | None:
        r = self.record
        if r is None:
            return None
        if r.deadline_s is not None:
            return r.deadline_s
        if r.fair_finish_s is not None and r.delay_bound_s is not None:
            return r.fair_finish_s + r.delay_bound_s
        return None

    @property
    def kept_promise(self) -> bool | None:
        """Whether the agent finished by its deadline (fair finish + delay bound)."""
        jct, deadline = self.jct_s, self.deadline_s
        if jct is None or deadline is None or not self.done or self.status != "finished":
            return None
        return jct <= deadline + 1e-6

    def value(self) -> Any:
        """The agent's result; raises its error if it failed."""
        if not self.done:
            raise JustitiaError(f"agent #{self.index} has not finished")
        if self.error is not None:
            raise self.error
        return self.result


class Batch(Sequence[AgentHandle]):
    """The handles of a `submit_many` call, in input order."""

    def __init__(self, handles: list[AgentHandle], title: str = "agents") -> None:
        self.handles = handles
        self.title = title

    @overload
    def __getitem__(self, i: int) -> AgentHandle: ...
    @overload
    def __getitem__(self, i: slice) -> list[AgentHandle]: ...
    def __getitem__(self, i: Any) -> Any:
        return self.handles[i]

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self) -> Iterator[AgentHandle]:
        return iter(self.handles)

    def __repr__(self) -> str:
        return f"<Batch of {len(self)}: {self.summary()}>"

    def results(self, *, return_exceptions: bool = False) -> list[Any]:
        """The results in input order. A failed run raises its error, or with
        `return_exceptions=True` stands in the list as its exception."""
        out = []
        for h in self.handles:
            if h.error is not None and not return_exceptions:
                raise h.error
            out.append(h.error if h.error is not None else h.result)
        return out

    @property
    def errors(self) -> list[tuple[int, BaseException]]:
        return [(h.index, h.error) for h in self.handles if h.error is not None]

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)

    def mean_jct_s(self) -> float | None:
        """Mean JCT of the runs that finished (failed and cancelled runs excluded)."""
        jcts = [h.jct_s for h in self.handles if h.status == "finished" and h.jct_s is not None]
        return sum(jcts) / len(jcts) if jcts else None

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for h in self.handles:
            counts[h.status] = counts.get(h.status, 0) + 1
        parts = [f"{n} {s}" for s, n in sorted(counts.items())]
        mean = self.mean_jct_s()
        if mean is not None:
            parts.append(f"mean JCT {mean:.2f} s")
        return ", ".join(parts)

    def table(self, *, live: bool = False, max_rows: int | None = None) -> Table:
        """A rich table of the runs (live columns while running, outcome columns after)."""
        from justitia_sdk._progress import batch_table

        return batch_table(self, live=live, max_rows=max_rows)

    def __rich__(self) -> Table:
        return self.table()

    def _repr_html_(self) -> str:
        from justitia_sdk._progress import to_html

        return to_html(self.table())


async def _watch(client: AsyncClient, handle: AgentHandle, started: anyio.Event) -> None:
    """Follow the agent's record; SSE first, polling if the stream is unavailable."""
    await started.wait()
    assert handle.run is not None
    agent_id = handle.run.id
    try:
        async for record in client.watch_agent(agent_id):
            handle._update(record)
        return
    except (JustitiaError, OSError, ValueError, Exception):  # noqa: BLE001 - best effort view
        pass
    while True:
        await anyio.sleep(1.0)
        try:
            record = await client.get_agent(agent_id)
        except Exception:  # noqa: BLE001
            continue
        handle._update(record)
        if record.terminal:
            return


async def _run_one(client: AsyncClient, handle: AgentHandle, limiter: anyio.CapacityLimiter | None,
                   metadata: Mapping[str, Any] | None, watch: bool) -> None:
    async with AsyncExitStack() as stack:
        if limiter is not None:
            await stack.enter_async_context(limiter)
        started = anyio.Event()

        def on_start(run: AgentRun) -> None:
            handle._on_start(run)
            started.set()

        async with anyio.create_task_group() as tg:
            if watch:
                tg.start_soon(_watch, client, handle, started)
            try:
                handle.result = await handle.agent.invoke(
                    handle.args, handle.kwargs, client=client, metadata=metadata,
                    on_start=on_start)
            except Exception as exc:  # one agent's failure must not lose the others
                handle.error = exc
            finally:
                handle.ended_at = time.time()
                if handle.run is not None:
                    handle._update(handle.run.record)
                handle.done = True
                tg.cancel_scope.cancel()


async def run_batch(
    client: AsyncClient,
    agent: Agent[..., Any] | Sequence[Agent[..., Any]],
    inputs: Iterable[Any],
    *,
    concurrency: int | None = None,
    progress: bool = True,
    title: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    watch: bool = True,
) -> Batch:
    values = list(inputs)
    if isinstance(agent, Sequence):
        agents = list(agent)
        if len(agents) != len(values):
            raise ValueError(f"{len(agents)} agents for {len(values)} inputs")
    else:
        agents = [agent] * len(values)
    handles = [AgentHandle(i, a, v) for i, (a, v) in enumerate(zip(agents, values))]
    names = sorted({a.name for a in agents})
    batch = Batch(handles, title or f"{len(handles)} agents ({', '.join(names)})")
    limiter = anyio.CapacityLimiter(concurrency) if concurrency else None

    async with AsyncExitStack() as stack:
        if progress:
            from justitia_sdk._progress import LiveView

            await stack.enter_async_context(LiveView(batch))
        async with anyio.create_task_group() as tg:
            for h in handles:
                tg.start_soon(_run_one, client, h, limiter, metadata, watch)
    return batch
