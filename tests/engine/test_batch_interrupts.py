"""A 400-agent batch on the real engine, interrupted from either end.

- The client's Ctrl-C (SIGINT to a script iterating `Client.as_completed`): the script gets
  its KeyboardInterrupt at once, the batch keeps every result that finished, the inputs not
  ended are cancelled, and the server is left with no live agent of the batch.
- The server's Ctrl-C (SIGINT to `justitia serve`'s process group) during the batch: the
  server stops within its shutdown grace, with no engine restart, and the batch fails its
  pending inputs with one `ServerGoneError` once the client's `server_gone_s` has passed,
  without hanging.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from server.launcher import EmbeddedServer
from server.runtime.shutdown import EXIT_GRACE_EXPIRED
from tests.support.servers import ENGINE_KV_TOKENS, ENGINE_MAX_MODEL_LEN
from tests.support.waiting import wait_until

pytestmark = pytest.mark.engine

INPUTS = 400
GRACE_S = 10.0
GONE_S = 15.0  # the client's server_gone_s: short, so that the test does not wait 120 s
SLACK_S = 30.0  # a busy machine's process start-up and exit
BEFORE_INTERRUPT = 20  # inputs finished before the Ctrl-C
SUMMARY_START = '{"outcome"'  # the client's last line, a JSON summary

_CLIENT = """
import json, signal, sys
from justitia_sdk import Client, agent, llm

# Ctrl-C as a script started from a terminal has it: a test runner (or a shell's background
# job) may start this process with SIGINT ignored or blocked, and its children inherit that.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

@agent("interrupted_batch")
async def work(i: int) -> int:
    await llm(f"item {i} first", max_tokens=16, ignore_eos=True)
    await llm(f"item {i} second", max_tokens=16, ignore_eos=True)
    return i

if __name__ == "__main__":
    client = Client(sys.argv[1], server_gone_s=float(sys.argv[2]))
    outcome = "completed"
    try:
        for handle in client.as_completed(work, list(range(int(sys.argv[3]))), progress=False):
            print("ended", handle.index, handle.status, flush=True)
    except KeyboardInterrupt:
        outcome = "interrupted"
    batch = client.last_batch
    print(json.dumps({
        "outcome": outcome,
        "finished": [h.index for h in batch if h.ok],
        "results_right": all(h.result == h.index for h in batch if h.ok),
        "ids": [i for h in batch for i in h.ids],
        "errors": sorted({type(h.error).__name__ for h in batch if h.error is not None}),
        "not_ended": sum(not h.done for h in batch),
        "server_error": None if batch.server_error is None else str(batch.server_error),
    }), flush=True)
    client.close()
"""


@pytest.fixture(scope="module")
def own_server(justitia_home: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A server of this module's own: the second test stops it."""
    home = str(tmp_path_factory.mktemp("interrupts"))
    srv = EmbeddedServer(["--kv-tokens", str(ENGINE_KV_TOKENS), "--max-model-len", str(ENGINE_MAX_MODEL_LEN),
                          "--shutdown-grace-s", str(GRACE_S)],
                         env={"JUSTITIA_HOME": home}, startup_timeout=900.0)
    srv.start()
    try:
        yield srv
    finally:
        if srv.process is not None and srv.process.poll() is None:
            os.killpg(srv.process.pid, signal.SIGKILL)
            srv.process.wait(10)


def _start_client(url: str, tmp_path) -> tuple[subprocess.Popen[str], list[str]]:
    script = tmp_path / "client.py"
    script.write_text(_CLIENT)
    proc = subprocess.Popen([sys.executable, str(script), url, str(GONE_S), str(INPUTS)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, []


def _read_until(proc: subprocess.Popen[str], lines: list[str], ended: int, limit_s: float) -> None:
    """Read the client's lines until `ended` inputs have ended (or it exited)."""
    deadline = time.monotonic() + limit_s
    assert proc.stdout is not None
    while sum(line.startswith("ended") for line in lines) < ended:
        assert time.monotonic() < deadline, "\n".join(lines[-20:])
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the client exited early:\n" + "\n".join(lines[-30:]))
        lines.append(line.rstrip("\n"))


def _summary(proc: subprocess.Popen[str], lines: list[str], limit_s: float) -> dict:
    try:
        rest, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rest, _ = proc.communicate()
        raise AssertionError("the client hung:\n" + "\n".join((lines + rest.splitlines())[-30:])) from None
    lines += rest.splitlines()
    # The Ctrl-C may land inside a print of an ended input, which then ends mid-line
    # ("ended{...}"): the summary is found where it starts, not only at a line's start.
    found = [line[line.index(SUMMARY_START):] for line in lines if SUMMARY_START in line]
    assert found, "\n".join(lines[-30:])
    return json.loads(found[-1])


@pytest.mark.timeout(1500)
def test_a_client_ctrl_c_keeps_the_finished_results_and_leaves_nothing_live(own_server, tmp_path) -> None:
    proc, lines = _start_client(own_server.url, tmp_path)
    try:
        _read_until(proc, lines, BEFORE_INTERRUPT, 900.0)
        finished_before = {int(line.split()[1]) for line in lines
                           if line.startswith("ended") and line.endswith("finished")}
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        summary = _summary(proc, lines, 20.0 + SLACK_S)  # the SDK's cleanup waits 20 s at most
        took = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
    assert summary["outcome"] == "interrupted", (
        [line for line in lines if not line.startswith("ended")][-30:] + lines[-10:])
    assert finished_before <= set(summary["finished"])  # nothing that finished is lost
    assert len(summary["finished"]) < INPUTS and summary["results_right"]
    assert summary["not_ended"] == 0 and summary["errors"] == ["AgentCancelledError"]
    assert took < 20.0 + SLACK_S
    # Nothing of the batch is left live on the server: every registered agent ended.
    with httpx.Client(base_url=own_server.url, timeout=60.0) as http:
        def live() -> list[str]:
            states = [http.get(f"/v1/agents/{aid}").json()["state"] for aid in summary["ids"]]
            return [s for s in states if s not in ("finished", "cancelled", "failed", "expired")]

        wait_until(lambda: not live(), 30.0, show=live)
        assert http.get("/readyz").status_code == 200


@pytest.mark.timeout(1500)
def test_a_server_ctrl_c_stops_it_within_its_grace_and_fails_the_batch_cleanly(own_server, tmp_path) -> None:
    assert own_server.process is not None
    proc, lines = _start_client(own_server.url, tmp_path)
    try:
        _read_until(proc, lines, BEFORE_INTERRUPT, 900.0)
        os.killpg(own_server.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        stopped = time.monotonic()
        try:
            status = own_server.process.wait(GRACE_S + SLACK_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not stop within {GRACE_S} s:\n"
                                 f"{own_server.tail_log()}") from None
        log = own_server.log_path.read_text(errors="replace")
        assert "ENGINE DIED" not in log and "restarting the engine" not in log, own_server.tail_log(80)
        # Stopped within the grace period: cleanly (0) or, when closing a busy engine took
        # longer than the grace left it, by the watchdog that ends the process on time (1).
        # Either way the process is gone in time and the engine was never restarted.
        assert status in (0, EXIT_GRACE_EXPIRED), own_server.tail_log(80)
        # The batch takes the server for gone once GONE_S has passed, and ends at once.
        summary = _summary(proc, lines, GONE_S + 60.0 + SLACK_S)
        failed_after = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert summary["outcome"] == "completed"  # as_completed ended: every input ended
    assert summary["not_ended"] == 0 and len(summary["finished"]) >= BEFORE_INTERRUPT
    # One decision for the batch: what had not ended when the server was taken for gone
    # failed with it; a call that found the server going a moment before (a registration
    # whose connection closed under it) may have failed with its own ServerUnavailableError.
    assert "ServerGoneError" in summary["errors"]
    assert set(summary["errors"]) <= {"ServerGoneError", "ServerUnavailableError"}
    assert summary["server_error"] and "gone" in summary["server_error"]
    assert failed_after < GONE_S + 60.0 + SLACK_S
