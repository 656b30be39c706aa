"""Ctrl-C that reaches a blocking wait even when Python drops it.

Python runs a SIGINT's handler in the main thread between two bytecodes, wherever that thread
is. When that is inside a finalizer or a garbage-collector callback, the KeyboardInterrupt
the handler raises is dropped ("Exception ignored in ...") and the program goes on as if
Ctrl-C had never come: a script iterating a 400-agent batch would then run it to its end.
While the blocking client waits, SIGINT's handler also remembers the interrupt, and the wait
raises it at its next slice if it was dropped on the way.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_pending = threading.Event()


def _remembering_handler(signum: int, frame: FrameType | None) -> None:
    _pending.set()
    signal.default_int_handler(signum, frame)


def _ours_to_install() -> bool:
    """Only the main thread may set handlers, and a handler the program set is its own."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


@contextmanager
def remembered_interrupts() -> Iterator[None]:
    """While inside: Ctrl-C raises KeyboardInterrupt as always and is remembered, so that
    `raise_if_interrupted` raises one that was dropped."""
    if not _ours_to_install():
        yield
        return
    _pending.clear()
    signal.signal(signal.SIGINT, _remembering_handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _remembering_handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _pending.clear()


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that came during the wait and was dropped."""
    if _pending.is_set():
        _pending.clear()
        raise KeyboardInterrupt
