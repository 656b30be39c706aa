"""The HTTP server's connection handling: uvicorn, with limits against slow clients.

uvicorn closes idle keep-alive connections, but a connection that never completes its first
request's headers (a slow or hostile client) is held forever: 20,000 of them made health
checks fail for tens of seconds. Here a connection must finish its first request's headers
within `header_timeout_s`, and the process may hold as many sockets as its hard limit allows.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

log = logging.getLogger("justitia.http")

#: Seconds a new connection has to complete its first request's headers.
HEADER_TIMEOUT_S = 10.0
#: Seconds an idle keep-alive connection stays open. Longer than uvicorn's 5 s: agents pause
#: between stages, and a client that reuses a connection the server just closed sees a
#: spurious disconnect.
KEEP_ALIVE_S = 30


def with_header_timeout(protocol: type, timeout_s: float) -> type:
    """`protocol` (one of uvicorn's HTTP protocol classes) that closes a connection whose
    first request has not started (headers incomplete) `timeout_s` after it was made."""

    class HeaderTimeout(protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeout.__name__ = f"HeaderTimeout{protocol.__name__}"
    return HeaderTimeout


def http_protocol(timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's fastest available HTTP protocol, with the header timeout."""
    base: type
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    except ImportError:  # httptools is optional for uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    return with_header_timeout(base, timeout_s)


def raise_open_files_limit() -> int:
    """Raise the soft limit of open files to the hard one (each connection is a file); the
    new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d: %s", soft, exc)
    return soft


def concurrency_limit(open_files: int) -> int | None:
    """uvicorn's `limit_concurrency` for a process that may hold `open_files` files: what is
    left after the engine's, the history's and the health port's files. Over it, a new
    connection is answered 503 at once instead of the process failing to accept (EMFILE)
    and every client, health checks included, waiting. None: no limit (an unlimited or
    very high open-files limit)."""
    if open_files <= 0 or open_files >= UNLIMITED_FILES:
        return None
    return max(MIN_CONCURRENCY, open_files - min(FILES_RESERVED, open_files // RESERVED_SHARE))


#: Open files kept for what is not a client connection (the engine's sockets and pipes, the
#: history database, the health port, log files); at most a quarter of the limit.
FILES_RESERVED = 512
RESERVED_SHARE = 4  # that quarter: 1 / RESERVED_SHARE of the open-files limit
#: The fewest client connections served at once, however low the open-files limit.
MIN_CONCURRENCY = 64
#: An open-files limit this high is no limit (RLIM_INFINITY reads as a huge number).
UNLIMITED_FILES = 1 << 30
#: The largest request head (request line and headers) h11 buffers; larger ones are refused.
MAX_HEAD_BYTES = 64 * 1024


def uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "info",
                   header_timeout_s: float = HEADER_TIMEOUT_S, **kwargs: Any) -> Any:
    """The uvicorn configuration every Justitia server runs with."""
    import uvicorn

    kwargs.setdefault("h11_max_incomplete_event_size", MAX_HEAD_BYTES)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_keep_alive=KEEP_ALIVE_S, http=http_protocol(header_timeout_s),
                          **kwargs)


def graceful_server(config: Any, shutdown: Any) -> Any:
    """A uvicorn server whose signals go through the app's `Shutdown` (server/runtime/shutdown.py):
    the first SIGINT/SIGTERM begins it, a second one ends the process at once."""
    import uvicorn

    from server.runtime.shutdown import signal_name

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not uvicorn's own: it re-raises the signal once the server stops (a traceback
            # from `justitia serve`), and its second Ctrl-C still waits for the engine.
            if shutdown.begin(f"{signal_name(sig)} received"):
                self.should_exit = True
            else:
                shutdown.force()

    return GracefulServer(config)
