"""The server's helper processes (predictors/worker.py): the retraining worker drops to the
lowest CPU priority before it loads NumPy or scikit-learn, whose imports at the server's own
priority took half of its core for about 1.5 s.

This module imports only the standard library and `predictors.worker` at its top: the
worker unpickles `_note_setup` by importing this module, and anything imported here would
load in the worker before the setup runs."""

from __future__ import annotations

import os
import sys
from typing import Any

from predictors.worker import HELPER_NICE, lowest_priority

_SEEN: dict[str, Any] = {}


def _note_setup(parent: int) -> None:
    """A worker setup that records what the worker had loaded when it ran."""
    _SEEN.update(numpy="numpy" in sys.modules, sklearn="sklearn" in sys.modules, parent=parent)
    lowest_priority(parent)


def _report() -> dict[str, Any]:
    import numpy  # noqa: F401 -- loaded by then (the warm-up imports training)

    return dict(_SEEN, nice=os.getpriority(os.PRIO_PROCESS, 0), sklearn_now="sklearn" in sys.modules)


def test_the_retraining_worker_lowers_its_priority_before_it_loads_machine_learning() -> None:
    from predictors.online import OnlineTrainer

    trainer = OnlineTrainer(retrain_every=20, worker_setup=_note_setup)
    try:
        trainer.warm().result(timeout=120)
        facts = trainer._pool().submit(_report).result(timeout=60)
    finally:
        trainer.close()
    assert facts == {"numpy": False, "sklearn": False, "parent": os.getpid(),
                     "nice": HELPER_NICE, "sklearn_now": True}


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def test_a_trainer_without_a_setup_runs_its_worker_at_the_lowest_priority() -> None:
    from predictors.online import OnlineTrainer

    trainer = OnlineTrainer(retrain_every=20)
    try:
        assert trainer._pool().submit(_nice).result(timeout=120) == HELPER_NICE == 19
    finally:
        trainer.close()
