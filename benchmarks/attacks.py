"""What the attack benchmarks share (hostile_tenant.py, request_limits.py, dashboard_load.py):
a `/healthz` prober, another tenant's short completions, clients as a tenant, and sending a
batch of raw bodies."""

from __future__ import annotations

import abc
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def tenant_client(url: str, key: str, timeout: float = 300) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout, headers={"Authorization": f"Bearer {key}"})


class _Loop(abc.ABC):
    """A background thread running `_run` (a loop until `_stop` is set) while the context lasts."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @abc.abstractmethod
    def _run(self) -> None:
        """The thread's loop: runs until `self._stop` is set."""

    def __enter__(self):  # noqa: ANN204 - the subclass
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Prober(_Loop):
    """`/healthz` latencies every `every_s` while it runs (of `url`: the main port or the
    health port)."""

    def __init__(self, url: str, every_s: float = 0.02, timeout_s: float = 30) -> None:
        super().__init__()
        self.url, self.every_s, self.timeout_s = url, every_s, timeout_s
        self.latencies: list[float] = []
        self.failures = 0

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as c:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    ok = c.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.monotonic() - started)
                self.failures += not ok
                time.sleep(self.every_s)

    def summary(self, prefix: str = "healthz") -> dict:
        lat = sorted(self.latencies) or [0.0]
        p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]  # nearest rank
        return {f"{prefix}_probes": len(self.latencies), f"{prefix}_failures": self.failures,
                f"{prefix}_p50_ms": round(1000 * statistics.median(lat), 1),
                f"{prefix}_p99_ms": round(1000 * p99, 1),
                f"{prefix}_max_ms": round(1000 * lat[-1], 1)}


class OtherTenant(_Loop):
    """Another tenant's short completions, back to back, while it runs: their latencies."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__()
        self.url, self.key = url, key
        self.latencies: list[float] = []

    def _run(self) -> None:
        with tenant_client(self.url, self.key) as c:
            while not self._stop.is_set():
                started = time.monotonic()
                c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
                self.latencies.append(time.monotonic() - started)
                time.sleep(0.05)

    def summary(self) -> dict:
        lat = self.latencies or [0.0]
        return {"other_tenant_requests": len(self.latencies),
                "other_tenant_p50_s": round(statistics.median(lat), 3),
                "other_tenant_max_s": round(max(lat), 3)}


def send_bodies(url: str, key: str, path: str, bodies: list[bytes], parallel: int = 1) -> dict:
    """POST each raw JSON body to `path`, `parallel` at a time: the statuses (and how many
    were 5xx) and the slowest answer."""
    statuses: dict[int, int] = {}
    slowest = 0.0

    def one(raw: bytes) -> None:
        nonlocal slowest
        with tenant_client(url, key) as c:
            started = time.monotonic()
            s = c.post(path, content=raw, headers={"content-type": "application/json"}).status_code
            slowest = max(slowest, time.monotonic() - started)
            statuses[s] = statuses.get(s, 0) + 1

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, bodies))
    return {"statuses": statuses, "5xx": sum(v for k, v in statuses.items() if k >= 500),
            "slowest_answer_s": round(slowest, 3)}
