"""A Ctrl-C on `justitia serve` with the real engine, during a streaming batch: the server
stops within its grace period and the engine is not taken for crashed (server/runtime/shutdown.py)."""

from __future__ import annotations

import os
import signal
import subprocess
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
                for line in response.iter_lines():
                    ends.append(line) if line.startswith(": the server") else None

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(16)]
        threads.append(threading.Thread(target=watch, daemon=True))
        for t in threads:
            t.start()
        assert streamed.wait(120), srv.tail_log()
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
