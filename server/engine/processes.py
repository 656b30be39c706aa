"""Where the in-process engine's processes and threads run on a CPU machine, and how they
are spawned: the engine core deprioritised, the server's threads kept off the cores the
workers compute on, children started with SIGINT blocked (the server stops them itself)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

log = logging.getLogger("justitia.engine")


def deprioritise_engine_core(nice: int) -> None:
    """Lower the scheduling priority of vLLM's EngineCore process.

    On the CPU build the model worker is pinned to its own cores and the EngineCore shares
    the remaining core with this (API) process. While the worker computes a step, the
    EngineCore spins on the shared-memory queue (sched_yield), taking ~75% of that core
    (measured here on 2 cores); the API process then answers HTTP in seconds instead of
    milliseconds, and admission, which runs in this process, lags behind the engine. At
    nice 10 the spinning only uses what this process leaves idle.
    """
    if nice <= 0:
        return
    try:
        for child in _vllm_processes("EngineCore"):
            child.nice(nice)
            log.info("EngineCore process %d set to nice %d", child.pid, nice)
    except Exception as exc:  # best effort: only speed depends on it
        log.warning("could not lower the EngineCore's priority: %s", exc)


def _vllm_processes(kind: str, root: int | None = None) -> list[Any]:
    """vLLM's processes of one kind (`EngineCore`, `Worker`: it names them VLLM::<kind>)
    among the descendants of process `root` (default this one)."""
    import psutil

    return [child for child in psutil.Process(root).children(recursive=True)
            if kind in child.name() or kind in " ".join(child.cmdline()[:1])]


#: Whether this platform sets CPU affinities per thread (Linux; vLLM's CPU build also runs on
#: macOS, which has no such call).
PINNING = hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def worker_cores(root: int | None = None) -> set[int]:
    """The cores vLLM's CPU model workers (descendants of process `root`, default this one)
    are pinned to: empty where there is no pinned worker."""
    import psutil

    if not PINNING:
        return set()
    try:
        return {core for child in _vllm_processes("Worker", root) for core in child.cpu_affinity() or []}
    except (psutil.Error, OSError):
        return set()


def pin_threads(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` to `cores` (a process's affinity is per thread on Linux:
    setting the process's only moves its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def keep_off_worker_cores() -> set[int]:
    """Move this (API) process and vLLM's EngineCore off the cores the CPU model worker is
    pinned to; returns the cores they now use (empty: left as they were).

    vLLM pins its CPU worker's threads to its own cores but leaves every other process free
    to run there, so the scheduler of the OS now and then put this process or the bench
    client on the worker's core, and every engine step waited for them: on 2 cores the same
    schedule ran 12-23% slower from one server start to the next (live contended48p: the
    agents finished in the same order, rank correlation 0.998, each one slower by a common
    factor).
    """
    import psutil

    if not PINNING:
        return set()
    pinned = worker_cores()
    try:
        others = set(os.sched_getaffinity(0)) - pinned
    except OSError:
        return set()
    if not pinned or not others:
        return set()
    try:
        pin_threads(os.getpid(), others)
        for child in _vllm_processes("EngineCore"):
            pin_threads(child.pid, others)
    except (psutil.Error, OSError) as exc:  # best effort: only speed depends on it
        log.warning("could not keep off the engine worker's cores: %s", exc)
        return set()
    log.info("API process and EngineCore kept off the engine worker's cores %s", sorted(pinned))
    return others


def without_sigint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with SIGINT blocked in this thread, so that the processes it
    starts (vLLM's EngineCore and workers) inherit the block: a Ctrl-C in the terminal goes
    to the whole foreground process group, and an engine that took it would die under the
    server, which must stop it in order instead (server/runtime/shutdown.py). SIGTERM is left as
    it is: vLLM stops its processes with it."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        return fn(*args, **kwargs)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return fn(*args, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


#: Thread-pool settings of the libraries a helper loads (xgrammar imports torch, NumPy and
#: scikit-learn bring OpenMP and BLAS pools, each of which would start a thread per core).
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "NUMEXPR_NUM_THREADS": "1", "TORCH_NUM_THREADS": "1"}


def _lowest_priority(parent: int) -> None:
    """The lowest CPU priority (`predictors.worker.HELPER_NICE`, below the EngineCore's 10
    and the server's 0), its libraries on one thread."""
    from predictors.worker import lowest_priority

    os.environ.update(_ONE_THREAD)
    lowest_priority(parent)


def _pin(cores: set[int]) -> None:
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError:  # best effort: only speed depends on it
            pass


def keep_to_spare_cpu(parent: int) -> None:
    """In a helper process the server (`parent`) spawned, before it loads its libraries:
    the lowest CPU priority, one thread, and off the cores vLLM's CPU model worker is pinned
    to (every engine step waits for that worker, so a helper sharing its core would slow every
    tenant's tokens). For work a request waits on (the grammar compiler: it has a budget of
    seconds even while the engine is busy)."""
    _lowest_priority(parent)
    if PINNING:
        try:
            _pin(set(os.sched_getaffinity(0)) - worker_cores(parent))
        except OSError:
            pass


def run_when_engine_idle(parent: int) -> None:
    """In a helper process whose work nobody waits on (the predictors' retraining), before it
    loads its libraries: one thread, the idle scheduling class (it runs only on CPU time no
    other process wants, and gives way the moment one wakes), on the model worker's cores,
    which sit idle between the engine's steps.

    Measured on 2 cores with one-request agents of three new types, 60 each (the worker's
    start and imports with the first type, a retraining at 20 and 40 agents of each), twice
    beside the alternatives: with the worker here, the first type's median latency was 28-29
    ms and the 12 agents around its retraining at 40 took 28 ms each; with the worker at
    nice 10 on the spare core, which the API process and the EngineCore share, 44-51 ms and
    56-64 ms. At nice 19 or in the idle class on that core it did no better (the EngineCore
    waits for the model worker by yielding its core, which hands it to whatever else may run
    there), nor at nice 19 on the worker's core (42-47 ms median for every type: a niced
    process still takes its share of the worker's core; the idle class takes none)."""
    _lowest_priority(parent)
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    if PINNING:
        _pin(worker_cores(parent))  # empty (left as it is) when it cannot be read
