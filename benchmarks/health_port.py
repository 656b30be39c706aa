"""Health probes under a flood of half-open connections: the main port against `--health-port`.

Starts `justitia serve` (vLLM CPU engine, tiny model) with `--health-port`, then attackers
hold `--connections` connections to the main port that never finish their request's
headers (reopening each one the server closes after its 10 s header timeout), while two
probers each open a *fresh* connection every `--every-ms` and ask `GET /healthz`: one on
the main port, one on the health port (what an orchestrator's probe does). Prints and
writes (JSON) each port's latency p50 / p99 / max and its failed probes (no answer
within `--probe-timeout-s`, or not 200).

    .venv/bin/python benchmarks/health_port.py [--connections 8000] [--seconds 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import math
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.launcher import EmbeddedServer, free_port  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402


def _raise_files_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _closed(s: socket.socket | None) -> bool:
    """Whether the server closed this (non-blocking) connection (None: never opened)."""
    if s is None:
        return True
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class HalfOpen:
    """`n` connections to `port` that send part of a request's headers and never the rest;
    each one the server closes is opened again."""

    def __init__(self, port: int, n: int, threads: int = 4) -> None:
        self.port, self.n = port, n
        self.opened = 0
        self.reopened = 0
        self.connect_failures = 0
        self._stop = threading.Event()
        per = -(-n // threads)
        self._threads = [threading.Thread(target=self._hold, args=(min(per, n - i * per),), daemon=True)
                         for i in range(threads) if n - i * per > 0]

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            s.setblocking(False)
            return s
        except OSError:
            self.connect_failures += 1
            return None

    def _hold(self, n: int) -> None:
        socks: list[socket.socket | None] = []
        for _ in range(n):
            if self._stop.is_set():
                break
            socks.append(self._open())
            self.opened += 1
        while not self._stop.is_set():
            for i, s in enumerate(socks):
                if self._stop.is_set():
                    break
                if _closed(s):
                    if s is not None:
                        s.close()
                    socks[i] = self._open()
                    self.reopened += 1
            self._stop.wait(0.5)
        for s in socks:
            if s is not None:
                s.close()

    def __enter__(self) -> HalfOpen:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


class Prober:
    """`GET /healthz` on a fresh connection every `every_s` (no keep-alive: an orchestrator's
    probe), each allowed `timeout_s`."""

    def __init__(self, url: str, every_s: float, timeout_s: float) -> None:
        self.url, self.every_s, self.timeout_s = url, every_s, timeout_s
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                ok = httpx.get(self.url + "/healthz", timeout=self.timeout_s).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.latencies.append(time.monotonic() - started)
            self.failures += not ok
            self._stop.wait(self.every_s)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)
        lat = sorted(self.latencies) or [0.0]
        p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]  # nearest rank
        return {"probes": len(self.latencies), "failures": self.failures,
                "p50_ms": round(1000 * statistics.median(lat), 1), "p99_ms": round(1000 * p99, 1),
                "max_ms": round(1000 * lat[-1], 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=8000, help="half-open connections held")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the probes run under the flood")
    ap.add_argument("--every-ms", type=float, default=100.0, help="pause between two probes of a port")
    ap.add_argument("--probe-timeout-s", type=float, default=5.0)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/health_port.json")
    args = ap.parse_args()
    limit = _raise_files_limit()
    if args.connections > limit - 200:
        ap.error(f"--connections {args.connections} needs more open files than this process may have ({limit})")
    health_port = free_port()
    home = tempfile.mkdtemp(prefix="justitia-health-port-")
    srv = EmbeddedServer(["--kv-tokens", "4096", "--max-model-len", "2048", "--health-port", str(health_port)],
                         env={"JUSTITIA_HOME": home})
    results: dict = {}
    with srv:
        main_url, health_url = srv.url, f"http://127.0.0.1:{health_port}"
        every, timeout = args.every_ms / 1000, args.probe_timeout_s
        # quiet first: what each port answers with nothing else going on
        quiet = [Prober(url, every, timeout).start() for url in (main_url, health_url)]
        time.sleep(5)
        results["quiet"] = dict(zip(("main_port", "health_port"), (p.stop() for p in quiet), strict=True))
        with HalfOpen(srv.port, args.connections) as flood:
            while flood.opened < args.connections:
                time.sleep(0.2)
            probers = [Prober(url, every, timeout).start() for url in (main_url, health_url)]
            time.sleep(args.seconds)
            results["flood"] = dict(zip(("main_port", "health_port"), (p.stop() for p in probers), strict=True))
            results["flood"]["connections"] = {"held": args.connections, "reopened": flood.reopened,
                                               "connect_failures": flood.connect_failures}
    for phase in ("quiet", "flood"):
        for port in ("main_port", "health_port"):
            r = results[phase][port]
            print(f"{phase:5} {port:11}: {r['probes']:4} probes, {r['failures']:4} failed, "
                  f"p50 {r['p50_ms']:7.1f} ms, p99 {r['p99_ms']:7.1f} ms, max {r['max_ms']:7.1f} ms")
    write_result(args.json, {"config": vars(args) | {"json": str(args.json)}, "results": results}, indent=2)
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
