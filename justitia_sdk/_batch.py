"""Batch submission: many agent runs at once, each with a handle that tracks its live status.

What a batch promises:
- At most `concurrency` agents run at once (64 by default); the others wait here, unregistered.
- The whole batch is watched over one event stream (only while a progress view is shown),
  so the number of connections is bounded whatever the batch's size.
- One agent's failure, timeout or retry never stops the others.
- Cancelling the batch (Ctrl-C, a cancelled task, `Batch.cancel`) cancels its live agents on
  the server at once (their engine requests are aborted); handles that finished keep their
  results, the others end with `AgentCancelledError`. `client.last_batch` keeps the batch.
- `retries=` runs an input again only after an error that can go differently
  (`is_retryable`): never after a 4xx about the input.
- When the client takes the server for gone (`server_gone_s` without a request getting
  through), the batch decides it once: every input not ended fails with that one
  `ServerGoneError`, at once, instead of each retrying on its own.
- A handle tells the whole story of its input across retries and re-registrations: its JCT
  runs from the first submission, its promise is the first deadline it was given, and
  `attempts`/`registrations` count the runs and the registrations.
- Every registration carries `metadata["batch"] = {"id", "size", "index", "concurrency"}`.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import anyio

from justitia_sdk._context import AgentRun
from justitia_sdk._errors import (
    AgentCancelledError,
    AgentTimeoutError,
    APIError,
    JustitiaError,
    ServerGoneError,
    is_retryable,
)
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



def _deadline(r: AgentRecord | None) -> float | None:
    """A record's deadline: `deadline_s`, else fair finish + delay bound (older servers)."""
    if r is None:
        return None
    if r.deadline_s is not None:
        return r.deadline_s
    if r.fair_finish_s is not None and r.delay_bound_s is not None:
        return r.fair_finish_s + r.delay_bound_s
    return None

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
        #: Runs started for this input (1 + retries used).
        self.attempts = 0
        #: Registrations of this input with the server: one per run, plus one each time a
        #: server that restarted had forgotten the running agent.
        self.registrations = 0
        #: Every id this input was registered under, first first.
        self.ids: list[str] = []
        self.started_at: float | None = None  # time.time() of the first registration
        self.registered_at: float | None = None  # time.time() of the latest registration
        self.ended_at: float | None = None

    def __repr__(self) -> str:
        return f"<AgentHandle #{self.index} {self.agent.name} {self.status}>"

    def _on_start(self, run: AgentRun) -> None:
        # A retry is a new run of the same input: the first record and start stay.
        self.run = run
        self._on_register(run.record)

    def _on_register(self, record: AgentRecord) -> None:
        now = time.time()
        if self.first_record is None:
            self.first_record = record
            self.started_at = now
        self.record = record
        self.registered_at = now
        self.registrations += 1
        self.ids.append(record.id)

    def _update(self, record: AgentRecord) -> None:
        # The event stream may deliver a record older than the finish call's answer.
        if self.record is not None and self.record.terminal and not record.terminal:
            return
        self.record = record

    @property
    def id(self) -> str | None:
        return self.record.id if self.record else None

    @property
    def status(self) -> str:
        """`pending` before registration; `failed` if the function raised, `timed out`,
        `cancelled` if the batch was cancelled first; else the server's state."""
        if isinstance(self.error, AgentTimeoutError):
            return "timed out"
        if isinstance(self.error, AgentCancelledError):
            return "cancelled"
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
        """Job completion time of a finished input, from its *first* submission (across
        retries and re-registrations) to the end of the run that finished: on the server's
        clock (finished_at - the first submitted_at), else measured here. None for inputs
        that failed or were cancelled."""
        return self._jct() if self.status == "finished" else None

    def _jct(self) -> float | None:
        last, first = self.record, self.first_record or self.record
        if (last is not None and first is not None and last.finished_at is not None
                and first.submitted_at is not None):
            return last.finished_at - first.submitted_at
        if last is not None and last.jct_s is not None and (first is None or first.id == last.id):
            return last.jct_s
        return self.elapsed_s if self.done else None

    @property
    def first_eta_s(self) -> float | None:
        """The ETA the server gave at the input's first submission (not a retry's)."""
        first = self.first_record or self.record
        if first is None:
            return None
        if first.first_eta_s is not None:
            return first.first_eta_s
        if self.record is not None and self.record.id == first.id and \
                self.record.first_eta_s is not None:
            return self.record.first_eta_s
        return first.eta_s

    @property
    def eta_error(self) -> float | None:
        """|first ETA - JCT| / JCT of a finished input: how far off the first ETA was."""
        jct, eta = self.jct_s, self.first_eta_s
        if jct is None or eta is None or jct <= 0:
            return None
        return abs(eta - jct) / jct

    @property
    def retried(self) -> bool:
        """True if the input ran more than once or registered more than once."""
        return self.attempts > 1 or self.registrations > 1

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
        """The deadline in the latest record (it moves only later: a late start, an over-run)."""
        return _deadline(self.record)

    @property
    def first_deadline_s(self) -> float | None:
        """The deadline the server gave at submission: the promise the user was shown."""
        return _deadline(self.first_record) if self.first_record is not None else self.deadline_s

    @property
    def kept_promise(self) -> bool | None:
        """Whether the input finished (JCT from its first submission) by the deadline given
        at its first submission: a deadline moved later since, or given to a retry, is not
        the promise made."""
        jct, deadline = self.jct_s, self.first_deadline_s
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


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


@dataclass(frozen=True)
class BatchStats:
    """Where a batch stands (`Batch.stats()`). Counts are of inputs; `running` ones are
    registered with the server and not ended, `pending` ones wait in the client for a slot
    (or for a retry). Promises and ETA errors are of finished inputs, judged against the
    first deadline and the first ETA each input was given (JCT from its first submission)."""

    size: int
    finished: int
    failed: int  # its code raised, or the server failed it (timeouts and a gone server included)
    timed_out: int
    cancelled: int
    running: int
    pending: int
    retried: int  # inputs that ran, or registered, more than once
    judged: int  # finished inputs whose first deadline is known
    kept: int  # of those, finished by it
    eta_error_median: float | None  # |first ETA - JCT| / JCT
    eta_error_p90: float | None
    mean_jct_s: float | None
    elapsed_s: float | None  # since the batch started
    eta_s: float | None  # seconds until every input has ended (estimate); 0 when done

    @property
    def ended(self) -> int:
        return self.finished + self.failed + self.cancelled


class Batch(Sequence[AgentHandle]):
    """The handles of a `submit_many` call, in input order; `as_completed()` in the order
    they end."""

    def __init__(self, handles: list[AgentHandle], title: str = "agents") -> None:
        self.handles = handles
        self.title = title
        #: Sent with every registration (`metadata["batch"]["id"]`).
        self.id = uuid.uuid4().hex[:12]
        #: Agents running at once (set when the batch runs).
        self.concurrency: int | None = None
        self.started_at: float | None = None  # time.time()
        self.ended_at: float | None = None
        #: Set once the client took the server for gone: every input not ended failed with it.
        self.server_error: ServerGoneError | None = None
        self._runs_scope: anyio.CancelScope | None = None
        self._by_id: dict[str, AgentHandle] = {}
        self._completed: list[AgentHandle] = []
        # Made on first use, inside the event loop (a Batch may be built outside one).
        self._progress: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self._on_done: Callable[[AgentHandle], None] | None = None

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

    def _started(self, handle: AgentHandle, run: AgentRun) -> None:
        handle._on_start(run)
        self._by_id[run.id] = handle
        run.on_reregister = lambda r: self._reregistered(handle, r)

    def _reregistered(self, handle: AgentHandle, run: AgentRun) -> None:
        handle._on_register(run.record)
        self._by_id[run.id] = handle

    def _server_gone(self, error: ServerGoneError) -> None:
        """Decide once: the server is gone; every input not ended fails with `error`."""
        if self.server_error is not None:
            return
        self.server_error = error
        if self._runs_scope is not None:
            self._runs_scope.cancel()

    def _ended(self, handle: AgentHandle) -> None:
        handle.done = True
        self._completed.append(handle)
        if self._progress is not None:
            self._progress.set()
            self._progress = None
        if self._on_done is not None:
            self._on_done(handle)

    async def as_completed(self) -> AsyncIterator[AgentHandle]:
        """The handles in the order their runs end (finished, failed, timed out or
        cancelled), as they end; ends when every handle has."""
        seen = 0
        while True:
            while seen < len(self._completed):
                seen += 1
                yield self._completed[seen - 1]
            if seen >= len(self.handles):
                return
            if self._progress is None:
                self._progress = anyio.Event()
            await self._progress.wait()

    def cancel(self) -> None:
        """Cancel the runs still going (their agents are cancelled on the server)."""
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

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

    def eta_s(self) -> float | None:
        """Seconds until every input of the batch has ended, estimated: the running agents
        end at their latest ETAs; the pending inputs take the free slots (`concurrency` at
        once) as they open, each taking the mean JCT of the finished inputs (before any
        finished: the mean ETA of the running ones). 0 once done; None before anything is
        known."""
        return self._eta_s(self.mean_jct_s())

    def _eta_s(self, mean_jct: float | None) -> float | None:
        now = time.time()
        running: list[float | None] = []
        etas: list[float] = []
        pending = 0
        for h in self.handles:
            if h.done:
                continue
            if h.record is None or h.registered_at is None or h.error is not None:
                pending += 1
            elif h.record.eta_s is None:
                running.append(None)
            else:
                etas.append(h.record.eta_s)
                running.append(max(0.0, h.registered_at + h.record.eta_s - now))
        if not pending and not running:
            return 0.0
        each = mean_jct if mean_jct is not None else statistics.fmean(etas) if etas else None
        if each is None and (pending or None in running):
            return None
        each = each or 0.0
        slots = [each if r is None else r for r in running]
        slots += [0.0] * max(0, (self.concurrency or DEFAULT_CONCURRENCY) - len(slots))
        heapq.heapify(slots)
        for _ in range(pending):
            heapq.heapreplace(slots, slots[0] + each)
        return max(slots) if slots else 0.0

    def stats(self) -> BatchStats:
        """Counts, promises kept and ETA errors so far, and the batch's ETA (one pass over
        the handles: the live view calls it on every refresh)."""
        count = dict.fromkeys(("finished", "failed", "timed_out", "cancelled", "running",
                               "pending"), 0)
        jcts: list[float] = []
        errors: list[float] = []
        judged = kept = retried = 0
        for h in self.handles:
            retried += h.retried
            if not h.done:
                count["pending" if h.record is None or h.error is not None else "running"] += 1
                continue
            status = h.status
            if status == "cancelled":
                count["cancelled"] += 1
            elif status != "finished":
                count["failed"] += 1
                count["timed_out"] += status == "timed out"
            else:
                count["finished"] += 1
                jct = h._jct()
                if jct is None:
                    continue
                jcts.append(jct)
                eta, deadline = h.first_eta_s, h.first_deadline_s
                if eta is not None and jct > 0:
                    errors.append(abs(eta - jct) / jct)
                if deadline is not None:
                    judged += 1
                    kept += jct <= deadline + 1e-6
        elapsed = None
        if self.started_at is not None:
            elapsed = (self.ended_at or time.time()) - self.started_at
        mean = statistics.fmean(jcts) if jcts else None
        return BatchStats(
            size=len(self.handles), **count, retried=retried, judged=judged, kept=kept,
            eta_error_median=statistics.median(errors) if errors else None,
            eta_error_p90=_p90(errors) if errors else None,
            mean_jct_s=mean, elapsed_s=elapsed,
            eta_s=0.0 if count["running"] + count["pending"] == 0 else self._eta_s(mean))

    def summary(self) -> str:
        """One line: the counts, the promises kept, the ETA error, the mean JCT, and the
        batch's ETA while it runs."""
        st = self.stats()
        parts = [f"{n} {name.replace('_', ' ')}" for name, n in (
            ("finished", st.finished), ("failed", st.failed), ("cancelled", st.cancelled),
            ("running", st.running), ("pending", st.pending)) if n]
        if st.timed_out:
            parts[parts.index(f"{st.failed} failed")] += f" ({st.timed_out} timed out)"
        if st.retried:
            parts.append(f"{st.retried} retried")
        if st.judged:
            parts.append(f"promises kept {st.kept}/{st.judged}")
        if st.eta_error_median is not None and st.eta_error_p90 is not None:
            parts.append(f"ETA error median {st.eta_error_median:.0%} "
                         f"p90 {st.eta_error_p90:.0%}")
        if st.mean_jct_s is not None:
            parts.append(f"mean JCT {st.mean_jct_s:.2f} s")
        done = st.running + st.pending == 0
        if not done and st.eta_s is not None:
            parts.append(f"batch done in ~{st.eta_s:.0f} s")
        elif done and st.elapsed_s is not None:
            parts.append(f"took {st.elapsed_s:.1f} s")
        if self.server_error is not None:
            parts.append("the server is gone")
        return ", ".join(parts) or "empty"

    def table(self, *, live: bool = False, max_rows: int | None = None) -> Table:
        """A rich table of the runs (live columns while running, outcome columns after)."""
        from justitia_sdk._progress import batch_table

        return batch_table(self, live=live, max_rows=max_rows)

    def __rich__(self) -> Table:
        return self.table()

    def _repr_html_(self) -> str:
        from justitia_sdk._progress import to_html

        return to_html(self.table())


#: Agents of one batch running at once unless `concurrency` says otherwise. Each running
#: agent fans out over its own connections; a bound keeps what the batch sends within the
#: client's pool, so that every running agent's requests reach the scheduler (an agent whose
#: requests wait in the client's pool looks idle to the server).
DEFAULT_CONCURRENCY = 64
_WATCH_RETRY_S = 1.0


async def _watch(client: AsyncClient, batch: Batch) -> None:
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


async def _poll(client: AsyncClient, batch: Batch) -> None:
    while True:
        await anyio.sleep(1.0)
        with contextlib.suppress(Exception):
            for record in await client.list_agents():
                handle = batch._by_id.get(record.id)
                if handle is not None:
                    handle._update(record)


def _gone_error(client: AsyncClient, batch: Batch, cause: BaseException) -> ServerGoneError:
    left = sum(not h.done for h in batch.handles)
    gone = cause if isinstance(cause, ServerGoneError) else client._gone(repr(cause))
    error = ServerGoneError(f"{gone}; the batch failed its {left} inputs not ended at once")
    error.__cause__ = cause
    return error


async def _run_one(client: AsyncClient, batch: Batch, handle: AgentHandle,
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
    from justitia_sdk._agent import Agent, registered_agents

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
    client: AsyncClient,
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
    client.last_batch = batch
    batch.concurrency = limit
    batch.started_at = time.time()
    watch = progress if watch is None else watch

    batch._scope = anyio.CancelScope()
    if batch._cancel_requested:
        batch._scope.cancel()
    with batch._scope:
        async with AsyncExitStack() as stack:
            if progress:
                from justitia_sdk._progress import LiveView

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
