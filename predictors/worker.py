"""The helper process a server spawns for background work (the predictors' retraining, the
grammar compiler): tied to the server's life and set up before it loads anything.

This module imports only the standard library: a spawned process unpickles its
initializer's module before the initializer runs, so whatever this module imported would
load at the server's own CPU priority, before the helper could lower its own.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

#: How often a helper looks whether the server that started it is still there.
PARENT_POLL_S = 0.5
#: A helper's niceness when its server gives no setup of its own: the lowest there is.
HELPER_NICE = 19


def exit_with_parent(parent: int, kernel: bool, poll_s: float = PARENT_POLL_S) -> None:
    """End this process soon after process `parent` ends, however it ends (kill -9
    included). A pool worker waits on a pipe whose other end it holds itself, so it never
    sees its server die: without this, each kill of the server would leave one behind for ever.

    A thread polls the parent's pid. With `kernel` (the worker was started by the parent's
    main thread: the kernel ties the signal to the thread that forked, not the process), on
    Linux the kernel is also asked to SIGKILL it the moment the parent dies
    (PR_SET_PDEATHSIG)."""
    if kernel and sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="justitia-parent-watch", daemon=True).start()


def lowest_priority(parent: int) -> None:
    """The default setup: the lowest CPU priority (the helper's work is never urgent)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, HELPER_NICE)
    except OSError:
        pass


def init_helper(parent: int, kernel: bool = False,
                setup: Callable[[int], None] | None = None) -> None:
    """A helper pool's initializer: die with the server (`parent`), then `setup(parent)`
    (where and how hard the helper may run; `lowest_priority` if None). A module-level
    `setup` pickles by name: its module should be as light as this one."""
    exit_with_parent(parent, kernel)
    (setup or lowest_priority)(parent)
