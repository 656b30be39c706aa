"""`Batch`: the handles of many agent runs submitted at once, where the batch stands
(`stats`, `eta_s`, `summary`) and its table. `_runner.py` runs it.

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
- Every registration carries `metadata["batch"] = {"id", "size", "index", "concurrency"}`:
  the server's ETAs expect the inputs still held back.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import anyio
from rich.table import Table

from justitia_sdk._context import AgentRun
from justitia_sdk._errors import ServerGoneError
from justitia_sdk._handle import AgentHandle
from justitia_sdk._render import batch_table, to_html

#: Agents of one batch running at once unless `concurrency` says otherwise. Each running
#: agent fans out over its own connections; a bound keeps what the batch sends within the
#: client's pool, so that every running agent's requests reach the scheduler (an agent whose
#: requests wait in the client's pool looks idle to the server).
DEFAULT_CONCURRENCY = 64


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
        return batch_table(self, live=live, max_rows=max_rows)

    def __rich__(self) -> Table:
        return self.table()

    def _repr_html_(self) -> str:
        return to_html(self.table())
