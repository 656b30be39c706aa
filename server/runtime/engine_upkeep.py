"""What the live server keeps measuring of its engine, and what it tells the scheduler of it.

- tau, the engine's iteration time as the GPS rate needs it (server/scheduler/rate.py),
  from the engine's per-step statistics;
- the step-time model of each engine, fitted to its step samples (server/scheduler/
  time_model.py), which times the ETAs' critical paths once it can be trusted;
- the KV capacity, which follows the replicas that serve;
- what a restarted server learns again from its history, and what it saves there for the
  next run on the same engine (server/runtime/relearn.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from server.engine.base import Capabilities, Engine
from server.runtime.prior_check import TOLERANCE, PriorCheck, check_prior
from server.runtime.relearn import HistoryReading, Recalled, engine_key, engine_state, recall
from server.runtime.type_shapes import TypeShapes
from server.scheduler import Dispatcher
from server.scheduler.policies import FOOTPRINT
from server.scheduler.rate import TauEstimator
from server.scheduler.time_model import TimeModel, TimeModelBank
from server.shared.step_time import StepSample

if TYPE_CHECKING:
    from server.runtime.history import History

log = logging.getLogger("justitia.live")

# A fit to this many engine steps describes the engine whatever its prior: only then does a
# model started from a prior measured elsewhere set the rate ETAs divide by.
TRUSTED_STEPS = 1024
ENGINE_SAVE_S = 60.0  # how often what was measured of the engine is saved in the history (and at shutdown)


class EngineUpkeep:
    def __init__(self, engine: Engine, capabilities: Capabilities, dispatcher: Dispatcher, *,
                 initial_tau_s: float, prior: TimeModel, prior_measured: bool,
                 now: Callable[[], float], warm_up_steps: Sequence[StepSample] = (),
                 prior_tolerance: float = TOLERANCE) -> None:
        self.engine = engine
        self.capabilities = capabilities
        self.dispatcher = dispatcher
        self.now = now
        # R = M / tau must be the rate the engine really serves with the memory it fills,
        # not M over the raw step time (see server/scheduler/rate.py).
        self.tau = TauEstimator(engine.info.kv_capacity_tokens, initial_tau_s)
        # until the engine's rate is measured, promises are widened and say so
        dispatcher.set_iteration_time(initial_tau_s, 0.0, **self.tau.promise_times())
        # A measured prior is checked against the warm-up's steps: the host's speed of the
        # minute (server/runtime/prior_check.py).
        self.warm_up_steps = tuple(warm_up_steps)
        self.prior_tolerance = prior_tolerance
        self.prior_check: PriorCheck | None = None
        if prior_measured:
            prior = self._checked(prior)
        self.time_models = TimeModelBank(prior)
        self.recalled = Recalled()  # what `recall` learned again from the history
        # the prior was measured on this engine: a calibration, or the last run's saved fit
        self.prior_measured = prior_measured
        self.saved_at = 0.0
        if prior_measured:
            dispatcher.set_time_model(prior)

    def listen(self, *, on_state: Callable[[str, str], None], pump: Callable[[], None]) -> None:
        """Subscribe to what the engine offers: its steps, its step samples, its capacity
        changes (`pump` admits what the new capacity allows) and its supervision state."""
        caps = self.capabilities
        if caps.step_statistics is not None:
            caps.step_statistics.add_step_listener(self._on_step)
        # The engine's step time as a function of its batch, learned from its own steps
        # (one model per engine; engines that report no step shapes keep none).
        if caps.step_samples is not None:
            caps.step_samples.add_sample_listener(self.time_models.observe)
        # Engines of several replicas: M follows the replicas that serve (added, removed,
        # failed, back).
        if caps.capacity_changes is not None:
            def on_capacity(kv_capacity_tokens: int) -> None:
                self.dispatcher.set_kv_capacity(kv_capacity_tokens, self.now())
                self.tau.set_kv_capacity(kv_capacity_tokens)
                pump()

            caps.capacity_changes.add_capacity_listener(on_capacity)
        # Engines that scale their replicas on demand read it from the ledger: tokens of
        # admitted requests plus the footprints of queued ones.
        if caps.autoscaled is not None:
            ledger = self.dispatcher.ledger
            caps.autoscaled.set_demand_source(lambda: ledger.reserved_kv + ledger.pending_kv)
        if caps.supervision is not None:
            caps.supervision.add_state_listener(on_state)

    def _checked(self, prior: TimeModel) -> TimeModel:
        checked, self.prior_check = check_prior(prior, self.warm_up_steps, self.prior_tolerance)
        if self.prior_check.scaled:
            log.warning("the engine's warm-up ran %.2fx the time the time model's prior (%s) predicts: "
                        "the prior is scaled to it (a profile of another host, or of this one at "
                        "another speed)", self.prior_check.ratio, prior.source)
        return checked

    def describe(self) -> dict[str, Any]:
        """The time models (GET /v1/scheduler's `time_model`), with the prior's check."""
        described = self.time_models.describe()
        described["prior_check"] = self.prior_check.as_dict() if self.prior_check is not None else None
        return described

    def recovering(self) -> bool:
        """The engine is down but being restarted: queued requests wait for it."""
        supervised = self.capabilities.supervision
        return supervised is not None and supervised.recovering

    def _on_step(self, duration_s: float, kv_in_use: float) -> None:
        footprint = self.dispatcher.policy.admission == FOOTPRINT
        reserved = self.dispatcher.ledger.reserved_kv if footprint else None
        self.tau.observe_step(duration_s, kv_in_use, reserved)

    def update(self) -> None:
        """Tell the dispatcher tau and, once it can be trusted, the fitted step-time model."""
        self.dispatcher.set_iteration_time(self.tau.tau_s, self.now(), **self.tau.promise_times())
        # ETAs time critical paths with the engine's fitted step time (one engine here; with
        # replicas, whichever has learned from the most steps).
        models = self.time_models.models()
        if not models:
            return
        model = max(models.values(), key=lambda m: m.samples)
        # A prior measured on this engine (a calibration, the last run's fit) keeps timing
        # ETAs until the fit has seen TRUSTED_STEPS: a fit to a burst's first few hundred
        # steps, mostly prefills, underestimates the rate ETAs divide by (by half on the CPU
        # engine), where a calibration is within a few percent of the fit to a whole run. A
        # prior measured elsewhere is worse than an early fit, for critical paths at least,
        # and is no fit: until the first refit, tau times paths, as it does before any step.
        if model.samples >= TRUSTED_STEPS:
            self.dispatcher.set_time_model(model)
        elif not self.prior_measured and model.samples > 0:
            self.dispatcher.set_time_model(model, sustains=False)

    async def recall(self, history: History, type_shapes: TypeShapes, wall: float) -> None:
        """Learn again what the last run learned and the history kept (server/runtime/relearn.py):
        the types' shapes, the episodes of arrivals, the engine's time model and tau."""
        try:
            reading = await asyncio.to_thread(HistoryReading.read, history, type_shapes.window,
                                              self.dispatcher.arrivals.max_samples, self.engine.info)
        except Exception as exc:  # a history that cannot be read leaves the server fresh, not down
            log.warning("could not read the history to learn from it again: %s", exc)
            return
        self.recalled = recall(reading, type_shapes, self.dispatcher, self.now(), wall)
        if reading.saved_tau is not None and not self.tau.measured and self.tau.resume(*reading.saved_tau):
            self.recalled = replace(self.recalled, tau_s=self.tau.tau_s)
            self.dispatcher.set_iteration_time(self.tau.tau_s, self.now(), **self.tau.promise_times())
        prior = reading.prior
        # a calibration given to this run wins; a bank that has seen steps keeps its fit
        if prior is not None and not self.prior_measured and not self.time_models.fitters:
            prior = self._checked(prior)
            self.time_models.prior = prior  # its fitters start from it (none has yet)
            self.prior_measured = True
            self.dispatcher.set_time_model(prior)
        if self.recalled.agents or self.recalled.registrations:
            log.info("learned again from the history: the shapes of %d agents of %d types, %d "
                     "registrations (%d episodes of arrivals)", self.recalled.agents, self.recalled.types,
                     self.recalled.registrations, self.dispatcher.arrivals.episodes)

    async def save_every(self, history: History | None) -> None:
        """Save at most every ENGINE_SAVE_S (called by the housekeeping)."""
        if self.now() - self.saved_at >= ENGINE_SAVE_S:
            self.saved_at = self.now()
            await self.save(history)

    async def save(self, history: History | None) -> None:
        """Keep what this run measured of the engine in the history for the next run on it
        (server/runtime/relearn.py): the best-fitted time model once it has learned from
        TRUSTED_STEPS steps, and tau's evidence once a step has measured it."""
        if history is None:
            return
        models = self.time_models.models()
        model = max(models.values(), key=lambda m: m.samples) if models else None
        state = engine_state(model if model is not None and model.samples >= TRUSTED_STEPS else None,
                             self.tau.state() if self.tau.measured else None)
        if not state:
            return
        try:
            await asyncio.to_thread(history.save_engine_state, engine_key(self.engine.info), state)
        except Exception as exc:  # the next run starts from its priors: worse ETAs, nothing lost
            log.warning("could not save the engine's measurements in the history: %s", exc)
