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
