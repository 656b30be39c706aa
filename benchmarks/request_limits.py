"""What one hostile request or stream costs everyone else, on a real `justitia serve` (vLLM CPU
engine): each attack runs while a prober times `/healthz` every 20 ms and another tenant
(alice) sends short completions back to back; per attack, health p50/p99/max, alice's
median and max latency, and the attacker's answers (status counts, the slowest answer).

Attacks (docs/reliability.md, Request limits):

- `stop250k`: 3 completions with 250,000 stop strings and n=16;
- `stoplong`: 3 completions with 16 stop strings of 30,000 characters;
- `chat110k`: 3 chats of 110,000 messages;
- `enum50k`: 3 chats whose JSON schema is a 50,000-entry enum;
- `pattern`: 5 chats whose schema is a counted pattern `^(ab|cd){5000}$`, and 5 with a
  20,000-property schema;
- `props`: 5 chats with a 600-property schema (under every structural limit: only the
  grammar compiler's time budget refuses it);
- `dashboard`: 500 dashboard streams opened by one tenant (the cap lets 8 through);
- `events`: 20 `GET /v1/agents/events` streams without ids over 3,000 live agents;
- `body4mb`: 40 ~4 MB agent registrations from a tenant (eve) with a rate limit of 2/s.

    .venv/bin/python benchmarks/request_limits.py [--attacks stop250k,...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hostile_tenant import Prober  # noqa: E402
from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

KEYS = {"mallory": "key-mallory", "alice": "key-alice", "eve": "key-eve"}
ATTACKS = ("stop250k", "stoplong", "chat110k", "enum50k", "pattern", "props", "dashboard",
           "events", "body4mb")


def _client(url: str, tenant: str, timeout: float = 300) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout,
                        headers={"Authorization": f"Bearer {KEYS[tenant]}"})


class OtherTenant:
    """alice's short completions, back to back, while it runs: their latencies."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with _client(self.url, "alice") as c:
            while not self._stop.is_set():
                started = time.monotonic()
                c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4})
                self.latencies.append(time.monotonic() - started)
                time.sleep(0.05)

    def __enter__(self) -> OtherTenant:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        lat = self.latencies or [0.0]
        return {"other_tenant_requests": len(self.latencies),
                "other_tenant_p50_s": round(statistics.median(lat), 3),
                "other_tenant_max_s": round(max(lat), 3)}


def _send(url: str, path: str, bodies: list[bytes], tenant: str = "mallory",
          parallel: int = 1) -> dict:
    statuses: dict[int, int] = {}
    slowest = 0.0

    def one(raw: bytes) -> None:
        nonlocal slowest
        with _client(url, tenant) as c:
            started = time.monotonic()
            s = c.post(path, content=raw, headers={"content-type": "application/json"}).status_code
            slowest = max(slowest, time.monotonic() - started)
            statuses[s] = statuses.get(s, 0) + 1

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, bodies))
    return {"statuses": statuses, "slowest_answer_s": round(slowest, 3)}


def _chat(schema: dict | None = None, **extra: object) -> dict:
    body: dict = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "s", "schema": schema}}
    return body


def attack_stop250k(url: str) -> dict:
    body = json.dumps({"prompt": "hello", "max_tokens": 64, "n": 16,
                       "stop": [f"s{i}" for i in range(250_000)]}).encode()
    return _send(url, "/v1/completions", [body] * 3)


def attack_stoplong(url: str) -> dict:
    body = json.dumps({"prompt": "hello", "max_tokens": 64, "n": 16,
                       "stop": [f"{i}" + "x" * 30_000 for i in range(16)]}).encode()
    return _send(url, "/v1/completions", [body] * 3)


def attack_chat110k(url: str) -> dict:
    body = json.dumps(_chat(**{"messages": [{"role": "user", "content": "a"}] * 110_000})).encode()
    return _send(url, "/v1/chat/completions", [body] * 3)


def attack_enum50k(url: str) -> dict:
    body = json.dumps(_chat({"enum": [f"v{i}" for i in range(50_000)]})).encode()
    return _send(url, "/v1/chat/completions", [body] * 3)


def attack_pattern(url: str) -> dict:
    counted = json.dumps(_chat({"type": "string", "pattern": "^(ab|cd){5000}$"})).encode()
    wide = json.dumps(_chat({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(20_000)}})).encode()
    return {"counted": _send(url, "/v1/chat/completions", [counted] * 5),
            "wide": _send(url, "/v1/chat/completions", [wide] * 5)}


def attack_props(url: str) -> dict:
    # distinct schemas (a cached refusal costs nothing): each is compiled until the budget
    bodies = [json.dumps(_chat({"type": "object", "properties": {
        f"p{i}_{n}": {"type": "integer"} for i in range(600)}})).encode() for n in range(5)]
    return _send(url, "/v1/chat/completions", bodies)


def attack_dashboard(url: str) -> dict:
    statuses: dict[int, int] = {}
    open_streams = []
    c = _client(url, "mallory", timeout=30)
    for _ in range(500):
        r = c.send(c.build_request("GET", "/v1/scheduler/events"), stream=True)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code == 200:
            open_streams.append(r)
        else:
            r.close()
    time.sleep(5)  # the open streams run their frames meanwhile
    for r in open_streams:
        r.close()
    c.close()
    return {"statuses": statuses}


def attack_events(url: str) -> dict:
    with _client(url, "mallory") as c:
        for i in range(3000):
            c.post("/v1/agents", json={"type": "idle", "prompt": f"p{i}"})

    def one(_: int) -> int:
        got = 0
        with _client(url, "mallory") as c, c.stream("GET", "/v1/agents/events") as r:
            for line in r.iter_lines():
                if line.startswith("event: agent"):
                    got += 1
                elif line.startswith("event: more"):
                    return got
        return got

    with ThreadPoolExecutor(20) as pool:
        counts = list(pool.map(one, range(20)))
    return {"records_per_stream": max(counts)}


def attack_body4mb(url: str) -> dict:
    body = json.dumps({"type": "big", "prompt": "x", "metadata": {"k": "y" * (4_000_000)}}).encode()
    return _send(url, "/v1/agents", [body] * 40, tenant="eve", parallel=4)


RUNNERS: dict[str, Callable[[str], dict]] = {
    "stop250k": attack_stop250k, "stoplong": attack_stoplong, "chat110k": attack_chat110k,
    "enum50k": attack_enum50k, "pattern": attack_pattern, "props": attack_props,
    "dashboard": attack_dashboard, "events": attack_events, "body4mb": attack_body4mb,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"comma-separated, from {', '.join(ATTACKS)}")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/request_limits.json")
    args = ap.parse_args()
    home = tempfile.mkdtemp(prefix="justitia-request-limits-")
    server_args = ["--kv-tokens", "4096", "--max-model-len", "2048",
                   "--rate-limit", "eve=2:2"]
    for tenant, key in KEYS.items():
        server_args += ["--api-key", f"{tenant}={key}"]
    results = {}
    with EmbeddedServer(server_args, env={"JUSTITIA_HOME": home}, startup_timeout=1200) as srv:
        time.sleep(30)  # the grammar worker loads its compiler in the background
        with Prober(srv.url) as prober, OtherTenant(srv.url) as alice:
            time.sleep(3)
        results["baseline"] = {**prober.summary(), **alice.summary()}
        print("baseline", json.dumps(results["baseline"]), flush=True)
        for name in args.attacks.split(","):
            if name not in RUNNERS:
                ap.error(f"unknown attack {name!r}")
            with Prober(srv.url) as prober, OtherTenant(srv.url) as alice:
                started = time.monotonic()
                result = RUNNERS[name](srv.url)
                wall = time.monotonic() - started
            results[name] = {**result, **prober.summary(), **alice.summary(),
                             "wall_s": round(wall, 1)}
            print(name, json.dumps(results[name]), flush=True)
    write_result(args.json, {"config": {"attacks": args.attacks, "server": server_args},
                             "results": results}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
