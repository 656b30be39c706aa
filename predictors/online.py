"""Online learning: the server retrains an agent type's predictor from the agents it served.

Every finished agent whose cost the server predicted becomes a sample of its (tenant, type):
its prompt, the numbers its metadata declared, its real cost, and the prediction it was
served. Once ``retrain_every`` new samples of a (tenant, type) have arrived (and at least
:data:`~predictors.training.MIN_SAMPLES` in all), a retraining job is queued:

* it runs in one worker *process* (spawned, at the lowest CPU priority, set up before it
  imports anything: :mod:`predictors.worker`): training never holds the event loop or the
  GIL the server serves with, and never more than one job runs at a time (bounded CPU);
* the newest 20% of the samples (at least :data:`MIN_RECENT`) are held out; the model is
  chosen by cross-validation and fitted on the others (:func:`predictors.training.fit_predictor`);
* it is swapped in only if its mean relative error on those recent held-out samples is at
  most that of the predictions the server really served them (cold start, an operator's
  model or an earlier online model, all of which predicted them before they ran): a swap
  never makes recent predictions worse. The swap is one dict assignment under a lock.

One (tenant, type) never learns from another tenant's agents, as the cold start does not.
The models live in memory: after a restart the server learns again from new agents;
``justitia train-predictor T --from-history DATA_DIR/history.sqlite3`` makes a lasting one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime as _dt
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .worker import init_helper

if TYPE_CHECKING:
    from .model import CostPredictor

log = logging.getLogger("justitia.predictors")

#: Default number of new samples of a (tenant, type) that triggers its retraining.
DEFAULT_RETRAIN_EVERY = 20
#: Fewest recent samples held out to decide a swap.
MIN_RECENT = 5
RECENT_FRACTION = 0.2
#: Samples kept per (tenant, type): the newest; older ones leave the training set. A prompt
#: is kept up to 64 KB (server/runtime/live.py), so this bounds a type's memory to about 32 MB.
MAX_SAMPLES = 500
#: (tenant, type) pairs followed at most: agent types are the callers' strings, and a caller
#: inventing a new one per agent must not grow the server's memory without end.
MAX_KEYS = 1000
#: The "recent error" of GET /v1/predictors: over this many latest served predictions.
RECENT_WINDOW = 20

Key = tuple[str, str]  # (tenant, agent type)


@dataclass
class _Served:
    """One finished agent: the sample and the prediction it was served."""

    sample: dict[str, Any]
    served: float


@dataclass
class TypeState:
    """What the trainer knows of one (tenant, type)."""

    samples: collections.deque[_Served] = field(default_factory=lambda: collections.deque(maxlen=MAX_SAMPLES))
    new: int = 0  # samples since the last job was queued
    job: concurrent.futures.Future[dict[str, Any]] | None = None
    model: CostPredictor | None = None  # the online model serving this (tenant, type), if any
    last_trained: str | None = None
    last_decision: str | None = None
    retrains: int = 0
    swaps: int = 0
    last_job_samples: int = 0  # samples the last finished job learned from (recent ones included)

    def recent_error(self) -> dict[str, float] | None:
        recent = list(self.samples)[-RECENT_WINDOW:]
        if not recent:
            return None
        errors = np.array([abs(r.served - r.sample["cost"]) / r.sample["cost"] for r in recent])
        return {"n": int(errors.size), "mean_relative_error": float(errors.mean()),
                "median_relative_error": float(np.median(errors))}


def warm_up() -> None:
    """A job that only imports what training needs (NumPy, scikit-learn: seconds on a busy
    machine): submitting it starts the worker, so that the first retraining does not wait."""
    from . import training  # noqa: F401


def train_job(agent_type: str, samples: list[dict[str, Any]], served: list[float], seed: int = 0) -> dict[str, Any]:
    """The retraining of one (tenant, type), in the worker process: fit on the older samples,
    compare with the served predictions on the newest ones. Returns the fitted model and its
    metadata (a `CostPredictor` is rebuilt by the server: its fast path does not pickle)."""
    from .evaluation import relative_errors
    from .samples import parse_samples
    from .training import fit_predictor

    rows = parse_samples(samples, source=f"history of {agent_type}")
    n_recent = max(MIN_RECENT, int(round(RECENT_FRACTION * len(rows))))
    train, recent = rows[:-n_recent], rows[-n_recent:]
    t0 = time.perf_counter()
    predictor = fit_predictor(train, agent_type, seed=seed)
    costs = [s.cost for s in recent]
    candidate = relative_errors([predictor.predict(s.prompt, s.features) for s in recent], costs)
    current = relative_errors(served[-n_recent:], costs)
    meta = predictor.metadata
    meta.update(source="online", sample_count=len(rows), train_count=len(train), validation_count=len(recent),
                validation={"count": len(recent), "mean_relative_error": float(candidate.mean()),
                            "median_relative_error": float(np.median(candidate))},
                replaced_error={"mean_relative_error": float(current.mean()),
                                "median_relative_error": float(np.median(current))},
                job_seconds=time.perf_counter() - t0)
    return {"model": predictor.model, "metadata": meta,
            "swap": bool(candidate.mean() <= current.mean())}


class OnlineTrainer:
    """Collects served agents per (tenant, type) and retrains their predictors in the
    background (see the module docstring). ``observe`` is called on the event loop and
    only appends; ``get`` is what the registry asks first."""

    def __init__(self, retrain_every: int = DEFAULT_RETRAIN_EVERY,
                 executor: concurrent.futures.Executor | None = None,
                 on_swap: Callable[[str, str], None] | None = None,
                 worker_setup: Callable[[int], None] | None = None) -> None:
        from .training import MIN_SAMPLES

        self.retrain_every = int(retrain_every)
        self.min_samples = MIN_SAMPLES
        self._executor = executor
        self._own_executor = executor is None
        self._types: dict[Key, TypeState] = {}
        self._warm = False
        # Re-entrant: a job that ends before its callback is attached (a fast failure) runs
        # `_finished` at once, inside `observe`'s hold of the lock.
        self._lock = threading.RLock()
        self._on_swap = on_swap
        # Runs first in the worker (see `predictors.worker.init_helper`): the server passes
        # one that also keeps it off the engine's cores.
        self._worker_setup = worker_setup

    @property
    def enabled(self) -> bool:
        return self.retrain_every > 0

    def _pool(self) -> concurrent.futures.Executor:
        if self._executor is None:
            # spawn, not fork: the server's process holds threads (the engine's, SQLite's).
            self._executor = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=init_helper,
                initargs=(os.getpid(), threading.current_thread() is threading.main_thread(), self._worker_setup))
        return self._executor

    def warm(self) -> concurrent.futures.Future[None]:
        """Start the retraining worker now (its imports take seconds on a busy machine): the
        future of a job that does nothing, done once the worker runs."""
        self._warm = True
        return self._pool().submit(warm_up)

    def close(self) -> None:
        if self._executor is not None and self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def get(self, agent_type: str, tenant: str | None) -> CostPredictor | None:
        """The online model serving (tenant, type), or None."""
        state = self._types.get((tenant or "", agent_type))
        return state.model if state is not None else None

    def observe(self, agent_type: str, tenant: str | None, prompt: str, cost: float, served: float,
                features: Mapping[str, Any] | None = None) -> None:
        """A finished agent of (tenant, type) whose cost the server predicted as ``served``."""
        if not self.enabled or not (cost > 0 and served > 0 and prompt.strip()):
            return
        key = (tenant or "", agent_type)
        with self._lock:
            if key not in self._types and len(self._types) >= MAX_KEYS:
                return  # followed types are full: this one stays on the cold start
            state = self._types.setdefault(key, TypeState())
            state.samples.append(_Served({"agent_type": agent_type, "prompt": prompt, "cost": float(cost),
                                          "features": dict(features or {})}, float(served)))
            state.new += 1
            if not self._warm and state.new * 2 >= self.retrain_every:
                # Halfway to the first job: start the worker, whose imports (NumPy,
                # scikit-learn: seconds on a busy machine) the job would otherwise wait for. A
                # server that never gets that far never starts it.
                self.warm()
            if state.new < self.retrain_every or len(state.samples) < self.min_samples:
                return
            if state.job is not None and state.job.cancel():
                state.job = None  # still queued: one job on every sample replaces it
            if state.job is None:
                state.new = 0
                self._submit(key, state)

    def _submit(self, key: Key, state: TypeState) -> None:
        """Queue the retraining of (tenant, type) as ``state.job`` (the lock is held)."""
        rows = list(state.samples)
        try:
            job = self._pool().submit(train_job, key[1], [r.sample for r in rows], [r.served for r in rows])
        except Exception as exc:  # a broken pool: start a new one with the next job
            self._drop_broken_pool(exc)
            state.last_decision = f"failed: {type(exc).__name__}: {exc}"
            return
        state.job = job  # before the callback, which may run at once and clear it
        job.add_done_callback(lambda f: self._finished(key, f))

    def _drop_broken_pool(self, exc: BaseException) -> None:
        """A worker that died (killed, out of memory) breaks its pool for good: forget it,
        so that the next job starts a fresh worker instead of failing forever."""
        from concurrent.futures.process import BrokenProcessPool

        if isinstance(exc, BrokenProcessPool) and self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _finished(self, key: Key, job: concurrent.futures.Future[dict[str, Any]]) -> None:
        from .model import CostPredictor

        if job.cancelled():  # replaced by a job on more samples (observe holds the lock)
            return
        state = self._types[key]
        stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        try:
            result = job.result()
            predictor = CostPredictor(result["model"], result["metadata"]) if result["swap"] else None
        except Exception as exc:  # a failed job leaves the served model in place
            log.warning("retraining the predictor of %r failed: %s", key[1], exc)
            self._drop_broken_pool(exc)
            with self._lock:
                state.last_decision = f"failed: {type(exc).__name__}: {exc}"
                if state.job is job:
                    state.job = None
            return
        meta = result["metadata"]
        new, old = meta["validation"]["mean_relative_error"], meta["replaced_error"]["mean_relative_error"]
        with self._lock:
            state.last_trained, state.retrains = stamp, state.retrains + 1
            state.last_job_samples = int(meta["sample_count"])
            if state.job is job:
                state.job = None
            if predictor is not None:
                state.model, state.swaps = predictor, state.swaps + 1
                state.last_decision = f"swapped in ({meta['model']}: {new:.3f} vs {old:.3f} served)"
            else:
                state.last_decision = f"kept the served model ({meta['model']}: {new:.3f} vs {old:.3f} served)"
            if state.new >= self.retrain_every and state.job is None:  # arrived during the job
                state.new = 0
                self._submit(key, state)
        log.info("predictor of %r for tenant %r: %s", key[1], key[0], state.last_decision)
        if predictor is not None and self._on_swap is not None:
            self._on_swap(key[0], key[1])

    def wait(self, timeout: float | None = None) -> None:
        """Block until no job is queued or running (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            jobs = [s.job for s in self._types.values() if s.job is not None]
            if not jobs:
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            concurrent.futures.wait(jobs, timeout=left)
            if deadline is not None and time.monotonic() >= deadline:
                return

    def describe(self) -> list[dict[str, Any]]:
        """Per (tenant, type): samples, the serving model's kind, recent error, last trained."""
        out = []
        with self._lock:
            items = sorted(self._types.items())
        for (tenant, agent_type), state in items:
            meta = state.model.metadata if state.model is not None else {}
            out.append({
                "agent_type": agent_type, "tenant": tenant, "samples": len(state.samples),
                "kind": meta.get("kind"), "model": meta.get("model"),
                "trained_on": meta.get("train_count"),
                "recent_error": state.recent_error(), "last_trained": state.last_trained,
                "last_decision": state.last_decision, "last_job_samples": state.last_job_samples,
                "retrains": state.retrains, "swaps": state.swaps,
                "training": state.job is not None,
            })
        return out
