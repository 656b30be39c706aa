"""Side effects of agents' lives, as listeners of the live scheduler.

The scheduler decides; what follows from its decisions elsewhere (a history row, a
predictor's training sample, metrics) is done by listeners registered once when it is
built. It calls each listener's `on_agent_registered`, `on_agent_ended` and
`on_request_finished`, in registration order; a listener that fails is logged and the
others still run: a side effect must never undo or block the scheduler's own decision.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from server.runtime.data_dir import HistoryUnwritable

if TYPE_CHECKING:
    from predictors.base import Predictor
    from server.engine.base import EngineOutput
    from server.runtime.agents import AgentEntry
    from server.runtime.metrics import Metrics

log = logging.getLogger("justitia.live")


class AgentListener:
    """What a listener may hear; each method does nothing unless overridden."""

    def on_agent_registered(self, entry: AgentEntry) -> None:
        """A new agent (state queued)."""

    def on_agent_ended(self, entry: AgentEntry) -> None:
        """The agent reached an end state (finished, failed, cancelled or expired)."""

    def on_request_finished(self, entry: AgentEntry, out: EngineOutput) -> None:
        """One of the agent's requests ended; `out` is its last output."""


class AgentListeners(AgentListener):
    """All the listeners, called in order; one listener's failure stops none of the rest."""

    def __init__(self, listeners: list[AgentListener] | None = None) -> None:
        self.listeners = list(listeners or [])

    def add(self, listener: AgentListener) -> None:
        self.listeners.append(listener)

    def _each(self, hook: str, entry: AgentEntry, *args: Any) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, hook)(entry, *args)
            except Exception:
                log.exception("%s.%s failed on agent %s", type(listener).__name__, hook, entry.id)

    def on_agent_registered(self, entry: AgentEntry) -> None:
        self._each("on_agent_registered", entry)

    def on_agent_ended(self, entry: AgentEntry) -> None:
        self._each("on_agent_ended", entry)

    def on_request_finished(self, entry: AgentEntry, out: EngineOutput) -> None:
        self._each("on_request_finished", entry, out)


#: Refused ends remembered for their retry (the oldest forgotten first).
MAX_REFUSED = 100_000


class HistoryStore(Protocol):
    """server/runtime/history.py's `History`, as far as the scheduler uses it."""

    def record(self, entry: AgentEntry, *, urgent: bool = ...) -> concurrent.futures.Future[None]:
        ...

    @property
    def failing(self) -> str | None: ...

    def unwritten_agent(self, agent_id: str) -> bool: ...


class HistoryWriter(AgentListener):
    """Writes each ended agent to the history. `durable(entry)` returns once its row is
    committed, so that an agent the API reported ended survives a kill right after."""

    def __init__(self, history: HistoryStore) -> None:
        self.history = history
        # Writes the API has not yet waited for (finish and cancel wait for theirs).
        self._writes: dict[str, concurrent.futures.Future[None]] = {}
        # Agents whose end was refused (503) because their row could not be written.
        self._refused: dict[str, None] = {}

    def on_agent_ended(self, entry: AgentEntry) -> None:
        # An untagged request's agent is nobody's to wait for.
        write = self.history.record(entry, urgent=not entry.auto)
        if not entry.auto:
            self._writes[entry.id] = write
            agent_id = entry.id

            def forget(_: object) -> None:
                self._writes.pop(agent_id, None)

            write.add_done_callback(forget)

    def check_writable(self) -> None:
        """Raise HistoryUnwritable while the history's writes fail: an end that could not be
        made durable is refused before anything changes."""
        reason = self.history.failing
        if reason is not None:
            raise HistoryUnwritable(reason)

    async def durable(self, entry: AgentEntry) -> None:
        """Return once the agent's row is committed; HistoryUnwritable if it could not be
        (the agent has ended in memory and its row is retried, but its end is not
        acknowledged: a call to end it again answers once the row is written)."""
        write = self._writes.pop(entry.id, None)
        if write is None:
            return
        try:
            await asyncio.wrap_future(write)
        except Exception as exc:  # logged by the writer
            if not self.history.unwritten_agent(entry.id):
                return  # written since, by a retry
            self._refused[entry.id] = None
            while len(self._refused) > MAX_REFUSED:
                del self._refused[next(iter(self._refused))]
            raise HistoryUnwritable(self.history.failing or str(exc)) from None

    def refused(self, entry: AgentEntry) -> bool:
        """Whether ending the agent was refused for want of a durable row: True once the row
        is written (the end is acknowledged now); HistoryUnwritable while it waits."""
        if entry.id not in self._refused:
            return False
        if self.history.unwritten_agent(entry.id):
            raise HistoryUnwritable(self.history.failing or "the agent's row waits for a retry")
        del self._refused[entry.id]
        return True


class Predictors(Protocol):
    """predictors' `PredictorRegistry`, as far as the scheduler uses it."""

    def get(self, agent_type: str, tenant: str | None = ...) -> Predictor: ...

    def observe(self, agent_type: str, prompt: str, cost: float,
                features: Mapping[str, Any] | None = ..., tenant: str | None = ...) -> None:
        ...

    def learn(self, agent_type: str, prompt: str, cost: float, served: float,
              features: Mapping[str, Any] | None = ..., tenant: str | None = ...) -> None:
        ...


#: Where a cost came from when it was the server's own prediction: the agents whose served
#: prediction online learning can compare a retrained model with (a declared cost is not).
_PREDICTED: frozenset[str] = frozenset({"model", "cold_start", "fallback"})


class PredictorFeedback(AgentListener):
    """Gives each finished agent's real cost to its type's predictor: the cold start's
    running fit, and the online retraining (with the prediction the agent was served). Only
    a complete run is a training sample: a failed or cancelled agent's cost is that of the
    part it ran."""

    def __init__(self, predictors: Predictors) -> None:
        self.predictors = predictors

    def on_agent_ended(self, entry: AgentEntry) -> None:
        # An untagged request is one request, not an agent of a type: its output length
        # (the demo's warm-up: 8 tokens) would become the cold start's output per request
        # for every type never seen, making their first predictions 40-200x too small.
        if entry.state != "finished" or not entry.requests or entry.auto:
            return
        features = {
            "n_requests": len(entry.requests),
            "output_tokens": sum(r.output_tokens for r in entry.requests),
            "prompt_tokens": sum(r.prompt_tokens for r in entry.requests),
        }
        self.predictors.observe(entry.type, entry.prompt, entry.consumed_kv_cost, features,
                                tenant=entry.tenant)
        if entry.cost_source in _PREDICTED:
            from predictors.features import submission_features

            self.predictors.learn(entry.type, entry.prompt, entry.consumed_kv_cost, entry.predicted_cost,
                                  submission_features(entry.meta()), tenant=entry.tenant)


class MetricsRecorder(AgentListener):
    """Counts agents and requests in the Prometheus metrics (server/runtime/metrics.py)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def on_agent_registered(self, entry: AgentEntry) -> None:
        self.metrics.agent_registered(entry)

    def on_agent_ended(self, entry: AgentEntry) -> None:
        self.metrics.agent_closed(entry)

    def on_request_finished(self, entry: AgentEntry, out: EngineOutput) -> None:
        self.metrics.request_finished(out)
