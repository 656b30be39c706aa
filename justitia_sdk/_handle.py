"""`AgentHandle`: one input of a batch, the whole story of its runs.

A handle tells the whole story of its input across retries and re-registrations: its JCT
runs from the first submission, its promise is the first deadline it was given, and
`attempts`/`registrations` count the runs and the registrations.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from justitia_sdk._agent import Agent
from justitia_sdk._context import AgentRun
from justitia_sdk._errors import AgentCancelledError, AgentTimeoutError, JustitiaError
from justitia_sdk._models import AgentRecord


def split_input(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A dict is keyword arguments, a tuple positional arguments, anything else one argument."""
    if isinstance(value, Mapping):
        return (), dict(value)
    if isinstance(value, tuple):
        return value, {}
    return (value,), {}


def deadline_of(r: AgentRecord | None) -> float | None:
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
        return deadline_of(self.record)

    @property
    def first_deadline_s(self) -> float | None:
        """The deadline the server gave at submission: the promise the user was shown."""
        return deadline_of(self.first_record) if self.first_record is not None else self.deadline_s

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
