"""Health and readiness, on the main port and on a listener of their own (`--health-port`).

`GET /healthz` (liveness) and `GET /readyz` (readiness) say what the engine is doing: the
same answers on the main port and on the health port. The health port is served by a small
threaded HTTP server outside the event loop, so that clients of the main port (slow ones,
tens of thousands of half-open connections, a full accept queue) cannot make an
orchestrator's probe fail and restart a server that is serving. It still tells the truth:
it reads the engine's state as the main port does (a dead engine is reported dead), and a
heartbeat task on the event loop lets it report the loop's lag; a loop that has not run
for `LOOP_STALLED_S` seconds makes liveness fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import logging
import socket
import threading
import time
from typing import Any

from server.engine.base import NOT_RUNNING

log = logging.getLogger("justitia.server")

#: Seconds without a heartbeat of the event loop after which liveness fails (on the health
#: port): a loop stalled this long serves nobody.
LOOP_STALLED_S = 30.0
#: How often the event loop's heartbeat beats.
BEAT_S = 0.5
#: Seconds a health-port connection may take to send its request (a slow client there
#: holds one thread, not the server).
PROBE_TIMEOUT_S = 5.0
#: How often the health listener's thread looks whether it is asked to stop (its stop
#: waits at most this long).
STOP_POLL_S = 0.2


def engine_status(app: Any) -> tuple[str, str]:
    """(state, detail) of the engine: running, starting, down (it died a moment ago; the
    supervisor has not acted yet), restarting, failed or stopped."""
    service = getattr(app.state, "service", None)
    if service is None:
        return "starting", "the engine is starting"
    if service.engine.healthy:
        return "running", ""
    supervised = service.scheduler.capabilities.supervision
    if supervised is None:  # nobody restarts it
        return "failed", NOT_RUNNING
    state, detail = supervised.state, supervised.state_detail or NOT_RUNNING
    if state == "running":
        return "down", "the engine died"
    return state, detail


def liveness(app: Any) -> tuple[int, dict[str, Any]]:
    """200 while the engine runs or is being restarted (the server heals itself; restarting
    the process would not help), 503 once it will not run again."""
    state, detail = engine_status(app)
    if state == "running":
        return 200, {"status": "ok"}
    if state in ("down", "restarting"):
        return 200, {"status": state, "detail": detail}
    return 503, {"status": "unhealthy", "detail": detail}


def readiness(app: Any) -> tuple[int, dict[str, Any]]:
    """200 only while the engine runs and the server takes work; otherwise 503 with the
    state and why."""
    state, detail = engine_status(app)
    shutdown = getattr(app.state, "shutdown", None)
    if shutdown is not None and shutdown.requested and state != "failed":
        return 503, {"status": "stopping", "detail": f"the server is shutting down ({shutdown.reason})"}
    history = getattr(app.state, "history", None)
    if state == "running" and history is not None and history.unwritten:
        # Finished agents are not being recorded (disk full?): drain this server.
        return 503, {"status": "degraded", "detail": (
            f"history cannot be written: {history.unwritten} ended agents could not be "
            f"written to the history ({history.last_error}); retrying, and finish and "
            "cancel calls are refused (503) until they are written")}
    if app.state.ready and state == "running":
        return 200, {"status": "ready", "model": app.state.service.model_name}
    if state == "running":
        state, detail = "starting", "the engine is starting"
    return 503, {"status": state, "detail": detail}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HealthHTTPServer
    timeout = PROBE_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        listener = self.server.listener
        path = self.path.split("?", 1)[0]
        if path in ("/healthz", "/health", "/livez"):
            code, body = liveness(listener.app)
            lag = listener.loop_lag_s()
            if lag is not None:
                body["event_loop_lag_s"] = round(lag, 3)
                if lag > LOOP_STALLED_S:
                    code, body = 503, {"status": "unhealthy", "event_loop_lag_s": round(lag, 3),
                                       "detail": f"the server's event loop has not run for {lag:.0f} s"}
        elif path == "/readyz":
            code, body = readiness(listener.app)
        else:
            code, body = 404, {"detail": "the health port serves GET /healthz and GET /readyz"}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        pass  # probes every few seconds would flood the log


class _HealthHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], listener: HealthListener) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.listener = listener
        super().__init__(address, _Handler)


class HealthListener:
    """`GET /healthz` and `GET /readyz` of `app` on `host:port`, served by threads of their
    own. `start()` on the event loop's thread (it starts the loop's heartbeat there)."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        self.app = app
        self._server = _HealthHTTPServer((host, port), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": STOP_POLL_S},
                                        name="justitia-health", daemon=True)
        self._beat_at: float | None = None
        self._beat_task: asyncio.Task[None] | None = None

    def start(self) -> HealthListener:
        self._thread.start()
        with contextlib.suppress(RuntimeError):  # no running loop: no heartbeat to report
            self._beat_task = asyncio.get_running_loop().create_task(self._beat(), name="justitia-health-beat")
        log.info("health and readiness also served on port %d", self.port)
        return self

    async def _beat(self) -> None:
        while True:
            self._beat_at = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def loop_lag_s(self) -> float | None:
        """Seconds since the event loop last beat, less the beat's period (None: no beat)."""
        if self._beat_at is None:
            return None
        return max(0.0, time.monotonic() - self._beat_at - BEAT_S)

    def close(self) -> None:
        if self._beat_task is not None:
            self._beat_task.cancel()
        self._server.shutdown()
        self._server.server_close()
