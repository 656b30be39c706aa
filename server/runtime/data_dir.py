"""The data dir, where the history of finished agents is kept: checked before the server
starts anything (a data dir that cannot be written is one clear error, not an engine
started and stopped), and the error for a history that cannot be written.

Light on purpose: `justitia serve` checks the data dir before it imports the server.
"""

from __future__ import annotations

import os
from pathlib import Path


class HistoryUnwritable(Exception):
    """The history cannot be written (disk full, read-only, I/O error): an agent's end that
    cannot be made durable is not acknowledged (503)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"history cannot be written: {reason}")
        self.reason = reason


def check_writable(directory: str | Path) -> None:
    """Raise HistoryUnwritable, saying why, unless the history can be kept in `directory`:
    it exists or can be made, a file in it can be written and synced, and the history file,
    if there is one, can be opened for writing."""
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".justitia-write-check-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"justitia")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
        for name in ("history.sqlite3", "history.sqlite3-wal", "history.sqlite3-shm"):
            if (path / name).exists():
                os.close(os.open(path / name, os.O_RDWR))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = exc.filename or path
        raise HistoryUnwritable(f"the data dir {path} cannot be written ({where}: {reason})") from None
