"""Stopping the server (server/runtime/shutdown.py), its health port (server/api/health.py) and the
child processes that must not outlive it, on the fake engine.

A whole `justitia serve` process runs here (`python -m tests.support.fake_serve`), because what is
tested is what only a process does: a signal, its exit, its children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from server.launcher import free_port
from tests.support.clients import local_client
from tests.support.fake_engine import FakeEngine, FakeServer
from tests.support.streams import BackgroundStream
from tests.support.waiting import wait_until

# Each test starts a server process (or a worker process): on a busy 2-core host, importing
# the server alone took up to a minute, more than the fast tier's 60 s per test.
pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
# Seconds the test allows a process beyond its grace period to be gone (the interpreter's
# exit; a busy 2-core machine).
EXIT_SLACK_S = 10.0


class FakeServeProcess:
    """`python -m tests.support.fake_serve ...` in a process (group) of its own."""

    def __init__(self, tmp: Path, *args: str, grace_s: float = 3.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grace_s = grace_s
        self.log = tmp / "server.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.fake_serve", "--port", str(self.port), "--data-dir",
                 str(tmp / "data"), "--shutdown-grace-s", str(grace_s), *args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, process_group=0)

    def wait_ready(self) -> FakeServeProcess:
        wait_until(self._ready, 240.0, 0.1, show=self.tail)
        return self

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"the server exited: {self.tail()}"
        try:
            return httpx.get(self.url + "/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_exit(self) -> int:
        """The exit status; fails the test if the process outlives its grace period."""
        try:
            return self.proc.wait(self.grace_s + EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit within its grace period of {self.grace_s} s; "
                                 f"log:\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture()
def spawn(tmp_path: Path) -> Iterator:
    started: list[FakeServeProcess] = []

    def start(*args: str, grace_s: float = 3.0) -> FakeServeProcess:
        server = FakeServeProcess(tmp_path, *args, grace_s=grace_s)
        started.append(server)  # before it is ready: a server that never gets ready is killed too
        return server.wait_ready()

    yield start
    for server in started:
        server.kill()


def _register(client: httpx.Client) -> str:
    response = client.post("/v1/agents", json={"type": "shutdown", "prompt": "a prompt"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _open(client: httpx.Client, path: str) -> tuple[BackgroundStream, list[str]]:
    """A stream read on a thread, and the raw lines it got (comments included)."""
    lines: list[str] = []

    class Raw(BackgroundStream):
        def _read(self) -> None:
            try:
                with client.stream("GET", path, timeout=httpx.Timeout(10.0, read=None)) as response:
                    self.content_type = response.headers.get("content-type")
                    for line in response.iter_lines():
                        lines.append(line)
            except Exception as exc:
                self.error = exc

    return Raw(lambda: client.stream("GET", path)), lines


def test_one_sigint_ends_the_event_streams_and_the_server_within_its_grace_period(spawn) -> None:
    """A client watching its batch (`GET /v1/agents/events`), an agent's own stream and the
    dashboard's do not hold a Ctrl-C'd server up ("Waiting for connections to close"): one
    SIGINT ends each stream cleanly, and the process exits 0 on its own (not by the
    watchdog, which exits 1) within the grace period."""
    server = spawn(grace_s=4.0)
    with local_client(base_url=server.url, timeout=30.0) as client:
        agent = _register(client)
        streams = [_open(client, path) for path in
                   ("/v1/agents/events", f"/v1/agents/{agent}/events", "/v1/scheduler/events")]
        for _, lines in streams:  # each has sent its first event: it is open
            wait_until(lambda lines=lines: any(line.startswith("data: ") for line in lines), 30.0)
        server.proc.send_signal(signal.SIGINT)
        status = server.wait_exit()
        for stream, lines in streams:
            stream.join(EXIT_SLACK_S)
            assert stream.error is None, f"the stream broke instead of ending: {stream.error!r}"
            assert ": the server is shutting down" in lines[-3:], lines[-3:]
    assert status == 0, server.tail()
    assert "did not end within its grace period" not in server.tail()


def test_answers_longer_than_the_drain_end_with_a_clear_error(spawn) -> None:
    """Requests in flight when the drain time is over are told why they stop (503 in the
    stream, then [DONE]; 503 for a plain request), not cut off: those generating and those
    still queued for admission (5 requests of 1,900 tokens, room for 2 in the KV cache; the
    plain one generating).
    The server still exits 0 within its grace period."""
    server = spawn("--step-s", "0.05", grace_s=2.0)  # 1,900 tokens: 95 s; the drain: 1 s
    streams: list[list[dict]] = [[] for _ in range(4)]
    plain: list[httpx.Response] = []
    body = {"prompt": "a long answer", "max_tokens": 1900, "ignore_eos": True}

    def stream(events: list[dict]) -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                          timeout=httpx.Timeout(10.0, read=None)) as response:
            events.append({"status": response.status_code})
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                elif line == "data: [DONE]":
                    events.append({"done": True})

    def request() -> None:
        plain.append(httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=None)))

    readers = [threading.Thread(target=request, daemon=True)]
    readers[0].start()  # first: it runs (a plain request generating when the drain ends)
    with local_client(base_url=server.url) as client:
        wait_until(lambda: client.get("/v1/scheduler").json()["running_requests"] == 1, 30.0)
    readers += [threading.Thread(target=stream, args=(events,), daemon=True) for events in streams]
    for reader in readers[1:]:
        reader.start()
    def all_in(snapshot: dict) -> bool:  # all five in: some running, the others queued
        return snapshot["pending_requests"] >= 1 and snapshot["pending_requests"] + snapshot["running_requests"] == 5

    with local_client(base_url=server.url) as client:
        wait_until(lambda: all_in(client.get("/v1/scheduler").json()), 30.0,
                   show=lambda: client.get("/v1/scheduler").json())
    server.proc.send_signal(signal.SIGTERM)
    status = server.wait_exit()
    for reader in readers:
        reader.join(EXIT_SLACK_S)
    for events in streams:
        assert events[-1] == {"done": True}, events[-3:]
        error = events[-2].get("error")
        assert error is not None and "shutting down" in error["message"], events[-2:]
    assert len(plain) == 1 and plain[0].status_code == 503, plain
    assert "shutting down" in plain[0].text
    assert status == 0, server.tail()


def test_a_second_signal_ends_the_server_at_once(spawn) -> None:
    """The first signal waits (here for a long answer, within a long grace); the second
    one ends the process at once, with the status of a Ctrl-C'd process (130)."""
    server = spawn("--step-s", "0.05", grace_s=120.0)
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "a long answer", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=httpx.Timeout(10.0, read=None)) as response:
                for _ in response.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass

    threading.Thread(target=stream, daemon=True).start()
    assert started.wait(30.0), server.tail()
    server.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "Shutting down" in server.tail() or server.proc.poll() is not None, 30.0,
               show=server.tail)
    assert server.proc.poll() is None, "the first signal did not wait for the request in flight"
    server.proc.send_signal(signal.SIGINT)
    try:
        status = server.proc.wait(EXIT_SLACK_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a second signal did not end the server; log:\n{server.tail()}") from None
    assert status == 130, server.tail()


# -- the health port ---------------------------------------------------------------------


def test_the_health_port_answers_while_the_event_loop_is_blocked_and_tells_the_truth(tmp_path: Path) -> None:
    """`--health-port` is served outside the event loop: with the loop held (what thousands
    of slow clients do to the main port) it still answers, and it reports what the engine
    does: ready while it runs, 503 once it is dead."""
    engine = FakeEngine()
    health_port = free_port()
    with FakeServer(tmp_path, engine=engine, health_port=health_port) as srv:
        health = f"http://127.0.0.1:{health_port}"
        assert httpx.get(health + "/healthz", timeout=5).json()["status"] == "ok"
        ready = httpx.get(health + "/readyz", timeout=5)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert httpx.get(health + "/nowhere", timeout=5).status_code == 404

        release, held = threading.Event(), threading.Event()

        def hold_the_loop() -> None:
            held.set()
            release.wait(60)  # blocks the event loop: no request of the main port is served

        loop = srv.app.state.shutdown.loop
        assert loop is not None
        loop.call_soon_threadsafe(hold_the_loop)
        try:
            assert held.wait(10)
            with pytest.raises(httpx.TimeoutException):  # the main port cannot answer now
                httpx.get(srv.url + "/healthz", timeout=1.0)
            answer = httpx.get(health + "/healthz", timeout=5)
            assert answer.status_code == 200 and answer.json()["status"] == "ok"
            assert answer.json()["event_loop_lag_s"] >= 0
        finally:
            release.set()

        engine.kill()  # the engine dies (the fake has no supervisor: it stays dead)
        dead = httpx.get(health + "/healthz", timeout=5)
        assert dead.status_code == 503 and dead.json()["status"] == "unhealthy", dead.text
        assert httpx.get(health + "/readyz", timeout=5).status_code == 503
        assert httpx.get(srv.url + "/healthz", timeout=5).status_code == 503  # the same truth


def test_readiness_says_stopping_once_the_shutdown_began(spawn) -> None:
    server = spawn("--health-port", str(health_port := free_port()), grace_s=4.0)
    health = f"http://127.0.0.1:{health_port}"
    assert httpx.get(health + "/readyz", timeout=5).status_code == 200
    with local_client(base_url=server.url, timeout=30.0) as client:
        _register(client)
        stream, lines = _open(client, "/v1/agents/events")
        wait_until(lambda: any(line.startswith("data: ") for line in lines), 30.0)
        server.proc.send_signal(signal.SIGTERM)

        def stopping() -> bool:
            try:
                answer = httpx.get(health + "/readyz", timeout=2)
            except httpx.TransportError:  # the listener closed: the server is gone
                return server.proc.poll() is not None
            return answer.status_code == 503 and answer.json()["status"] == "stopping"

        wait_until(stopping, 30.0)
        assert server.wait_exit() == 0, server.tail()


# -- child processes ---------------------------------------------------------------------

_TRAINER_HOST = textwrap.dedent("""
    import multiprocessing, sys, threading, time
    from predictors.online import OnlineTrainer

    trainer = OnlineTrainer(retrain_every=1)
    box = []
    def start():
        box.append(trainer.warm())
    if sys.argv[1] == "thread":  # started by a thread that ends before the server dies
        t = threading.Thread(target=start); t.start(); t.join()
    else:
        start()
    box[0].result(120)
    print(*(p.pid for p in multiprocessing.active_children()), flush=True)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("started_by", ["main", "thread"])
def test_the_retraining_worker_dies_with_a_killed_server(tmp_path: Path, started_by: str) -> None:
    """The online-retraining worker (139 MB) ends with the server that started it, even a
    server killed with kill -9, whichever of its threads started it (and not when that
    thread ends): a worker waits on a pipe it holds itself, so nothing else would end it."""
    host = subprocess.Popen([sys.executable, "-c", _TRAINER_HOST, started_by], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, process_group=0)
    try:
        assert host.stdout is not None
        line = host.stdout.readline().decode()
        workers = [int(pid) for pid in line.split()]
        assert workers, f"no worker started: {line!r}"
        assert not any(_gone(pid) for pid in workers)  # alive while its server lives
        host.kill()  # SIGKILL: no cleanup of any kind runs in the server
        host.wait(10)
        wait_until(lambda: all(_gone(pid) for pid in workers), 60.0,
                   show=lambda: [(p, _gone(p)) for p in workers])
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(10)


def test_a_supervised_engine_is_restarted_and_the_server_exits_when_restarts_run_out(spawn) -> None:
    """As the in-process vLLM engine (tests/engine/test_faults.py), on the fake: while the
    engine restarts, /healthz stays 200, /readyz is 503 "restarting" and a request waits for
    it, then completes; killed with no restart left, the server exits with status 69."""
    server = spawn("--max-restarts", "1", "--restart-delay-s", "1.5")
    with local_client(base_url=server.url, timeout=30) as c:
        os.kill(server.proc.pid, signal.SIGUSR1)
        wait_until(lambda: c.get("/readyz").status_code == 503, 20, show=server.tail)
        ready = c.get("/readyz").json()
        assert ready["status"] == "restarting", ready
        assert c.get("/healthz").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "during the restart", "max_tokens": 3})
        assert r.status_code == 200, r.text  # it waited for the engine
        assert c.get("/readyz").status_code == 200
        os.kill(server.proc.pid, signal.SIGUSR1)
    assert server.wait_exit() == 69, server.tail()
