"""What a restarted server learns again from its history.

A server that has served traffic knows more than a fresh one: its types' shapes
(server/runtime/type_shapes.py), the episodes of arrivals its ETAs forecast from (`WorkArrivals`)
and its engine's speed (the time model fitted to its steps). Live, a server taught by one
burst gave the next burst first ETAs off by 0.26 of their JCTs at the median, a fresh one
0.35 (docs/benchmarks.md). All lived in
memory only, so a restart (a deploy, a crash) made the server fresh again. The history
keeps every ended agent with its requests, so the first two are learned again from it when
the server starts: the shapes of the last agents of each tenant's types, and the
registrations of the last agents replayed into the arrivals at their times on the
scheduler's clock (before its start: negative), as if the server had been up all along.
What the server measured of its engine is saved in the history too (every minute, and at
shutdown), keyed by what identifies the engine (model, dtype, KV capacity, block size,
context length): the fitted time model, which a restarted server on the same engine starts
from as from a calibration of that engine (`serve --profile`, which wins where given), and
the evidence its tau is made of (R = M / tau, the rate ETAs divide by), which it continues
from instead of its 10 ms guess. Restarted with the shapes and the arrivals but not the
rate, a server tells the last third of a burst about twice its JCTs (live, the contended
48-agent workload: R starts from the guess, 0.41M units a second, where the taught server
measured 0.6M).

Untagged requests' one-request agents (type `default`) shape no type, as before the
restart; they are arrivals like any agent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from server.engine.base import EngineInfo
from server.runtime.agents import DEFAULT_AGENT_TYPE, RequestLog
from server.scheduler.time_model import TimeModel

if TYPE_CHECKING:
    from server.runtime.history import History
    from server.runtime.type_shapes import TypeShapes
    from server.scheduler import Dispatcher


@dataclass(frozen=True)
class Recalled:
    """What the history gave back: finished agents, the (tenant, type)s they shape, and
    the registrations replayed into the arrivals."""

    agents: int = 0
    types: int = 0
    registrations: int = 0
    time_model_steps: int = 0  # the steps the saved time model was fitted to (0: none)
    # the tau the last run on this engine measured, continued here (None: none, or this run
    # had measured its own first)
    tau_s: float | None = None


@dataclass(frozen=True)
class HistoryReading:
    """The rows a restart reads (blocking: read them off the event loop)."""

    finished: list[tuple[str, str, list[RequestLog]]]  # (tenant, type, requests)
    registrations: list[tuple[float, float]]
    saved_model: TimeModel | None = None  # the time model the last run on this engine fitted
    saved_tau: tuple[float, float] | None = None  # its tau's evidence (TauEstimator.state)

    @classmethod
    def read(cls, history: History, per_type: int, registrations: int, engine: EngineInfo) -> HistoryReading:
        state = history.engine_state(engine_key(engine)) or {}
        return cls(history.recent_finished(per_type), history.recent_registrations(registrations),
                   saved_time_model(state.get("time_model")), saved_tau(state.get("tau")))

    @property
    def prior(self) -> TimeModel | None:
        """The saved model as the time model's prior (a prior has learned from no step here)."""
        if self.saved_model is None:
            return None
        m = self.saved_model
        return replace(m, samples=0, error_p50=None, error_p90=None, total_error=None,
                       source=f"prior: saved by the last run on this engine (fitted to {m.samples} steps)")


def engine_key(info: EngineInfo) -> str:
    """What identifies an engine's speed, as the key of its saved time model."""
    return json.dumps({"model": info.model, "dtype": info.dtype, "kv_capacity_tokens": info.kv_capacity_tokens,
                       "block_size": info.block_size, "max_model_len": info.max_model_len}, sort_keys=True)


def saved_time_model(saved: Any) -> TimeModel | None:
    """A saved model (None: none saved, or not a model)."""
    if not isinstance(saved, dict):
        return None
    try:
        return TimeModel.from_dict(saved)
    except (TypeError, ValueError):
        return None


def saved_tau(saved: Any) -> tuple[float, float] | None:
    """A saved tau's evidence, (busy seconds, full-cache iterations) (None: none, or not that)."""
    if not (isinstance(saved, list) and len(saved) == 2 and all(isinstance(x, (int, float)) for x in saved)):
        return None
    return float(saved[0]), float(saved[1])


def engine_state(model: TimeModel | None, tau: tuple[float, float] | None) -> dict[str, Any]:
    """What is saved of the engine: the fitted model and the tau evidence, where known."""
    state: dict[str, Any] = {}
    if model is not None:
        state["time_model"] = model.as_dict()
    if tau is not None:
        state["tau"] = list(tau)
    return state


def recall(reading: HistoryReading, shapes: TypeShapes, dispatcher: Dispatcher, now: float,
           wall_now: float) -> Recalled:
    """Learn the types' shapes and replay the registrations (unix seconds, mapped onto the
    scheduler's clock, whose `now` is `wall_now`)."""
    agents, types = 0, set()
    for tenant, agent_type, requests in reading.finished:
        if agent_type != DEFAULT_AGENT_TYPE and shapes.learn(tenant, agent_type, requests):
            agents += 1
            types.add((tenant, agent_type))
    replayed = dispatcher.recall_registrations(
        [(min(now, now - (wall_now - submitted_at)), cost) for submitted_at, cost in reading.registrations], now)
    steps = reading.saved_model.samples if reading.saved_model is not None else 0
    return Recalled(agents, len(types), replayed, steps)
