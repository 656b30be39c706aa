"""A Ctrl-C on `justitia serve` with the real engine, during a streaming batch: the server
stops within its grace period and the engine is not taken for crashed (server/runtime/shutdown.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from server.launcher import EmbeddedServer
from tests.support.servers import ENGINE_KV_TOKENS, ENGINE_MAX_MODEL_LEN
from tests.support.waiting import wait_until

GRACE_S = 10.0
EXIT_SLACK_S = 10.0  # the interpreter's exit on a busy machine


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_ctrl_c_during_a_streaming_batch_stops_the_server_without_an_engine_restart(justitia_home: str) -> None:
    """The terminal's Ctrl-C reaches the whole foreground process group, the engine's
    processes included. The engine does not take the signal (taking it, it would die and
    be restarted: `THE vLLM ENGINE DIED ... restart 1 of 3`), the streams end, and the
    server exits 0 within its grace period, leaving no process behind."""
    srv = EmbeddedServer(["--kv-tokens", str(ENGINE_KV_TOKENS), "--max-model-len", str(ENGINE_MAX_MODEL_LEN),
                          "--shutdown-grace-s", str(GRACE_S), "--retrain-every", "1"],
                         env={"JUSTITIA_HOME": justitia_home}, startup_timeout=600.0)
    srv.start()
    assert srv.process is not None
    group = psutil.Process(srv.process.pid)
    try:
        client = httpx.Client(base_url=srv.url, timeout=60.0)
        streamed = threading.Event()
        ends: list[str] = []
        watching = threading.Event()

        def stream(i: int) -> None:
            agent = client.post("/v1/agents", json={"type": "batch", "prompt": f"item {i}"}).json()["id"]
            body = {"prompt": f"item {i} of the batch", "max_tokens": 1500, "ignore_eos": True,
                    "stream": True, "agent_id": agent}
            try:
                with client.stream("POST", "/v1/completions", json=body,
                                   timeout=httpx.Timeout(60.0, read=None)) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            streamed.set()
                        if line.startswith("data: "):
                            last = line
                    ends.append(last)
            except httpx.HTTPError as exc:
                ends.append(repr(exc))

        def watch() -> None:
            with client.stream("GET", "/v1/agents/events", timeout=httpx.Timeout(60.0, read=None)) as response:
                watching.set()
                for line in response.iter_lines():
                    ends.append(line) if line.startswith(": the server") else None

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(16)]
        threads.append(threading.Thread(target=watch, daemon=True))
        for t in threads:
            t.start()
        assert streamed.wait(120), srv.tail_log()
        # the events stream open before the Ctrl-C: on a loaded host its response can lag
        # the completions', and a stream not yet open has nothing to be ended
        assert watching.wait(120), srv.tail_log()
        children = group.children(recursive=True)
        assert children, "the engine runs in child processes"
        os.killpg(srv.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        try:
            status = srv.process.wait(GRACE_S + EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not stop within {GRACE_S} s; log:\n{srv.tail_log()}") from None
        log = srv.log_path.read_text(errors="replace")
        assert "ENGINE DIED" not in log and "restarting the engine" not in log, srv.tail_log(80)
        assert status == 0, srv.tail_log(80)
        for t in threads:
            t.join(EXIT_SLACK_S)
        assert ": the server is shutting down" in ends  # the events stream was ended
        wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
                   30.0, show=lambda: [(c.pid, c.is_running()) for c in children])
    finally:
        if srv.process.poll() is None:
            os.killpg(srv.process.pid, signal.SIGKILL)
            srv.process.wait(10)


# A program that starts the server, prints the server's pid and waits: in a `with` block
# (as the bench commands) or started without one (as a notebook does).
STARTER = """
import sys, time
from server.launcher import EmbeddedServer
srv = EmbeddedServer(["--kv-tokens", "{kv}", "--max-model-len", "{len}"], env={{"JUSTITIA_HOME": {home!r}}},
                     startup_timeout=600.0)
if {with_block}:
    with srv:
        print(srv.process.pid, flush=True)
        time.sleep(900)
else:
    srv.start()
    print(srv.process.pid, flush=True)
    time.sleep(900)
"""


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("with_block", [True, False], ids=["with-block", "started"])
def test_a_sigterm_to_the_program_that_started_the_server_stops_the_server_and_its_engine(
        justitia_home: str, with_block: bool) -> None:
    """The server runs in a process group of its own, so a SIGTERM to the program that
    started it (`kill`, a job scheduler, a CI timeout) does not reach it: the program has
    to stop it. It does, with its engine, and exits with 143 (128 + SIGTERM), whether the
    server was started in a `with` block or not; nothing is left running."""
    code = STARTER.format(kv=ENGINE_KV_TOKENS, len=ENGINE_MAX_MODEL_LEN, home=justitia_home,
                          with_block=with_block)
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        assert starter.stdout is not None
        server_pid = int(starter.stdout.readline())
        assert server_pid in _group(server_pid)
        engine = psutil.Process(server_pid).children(recursive=True)
        assert engine, "the engine runs in child processes of the server"
        starter.send_signal(signal.SIGTERM)
        assert starter.wait(60) == 128 + signal.SIGTERM
        wait_until(lambda: not _group(server_pid), 30.0, show=lambda: _group(server_pid))
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in engine)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait(10)
        if server_pid is not None and _group(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
