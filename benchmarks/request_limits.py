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
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.attacks import OtherTenant, Prober, send_bodies, tenant_client  # noqa: E402
from server.launcher import EmbeddedServer, free_port  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

KEYS = {"mallory": "key-mallory", "alice": "key-alice", "eve": "key-eve"}
ATTACKS = ("stop250k", "stoplong", "chat110k", "enum50k", "pattern", "props", "dashboard",
           "events", "body4mb")


def _client(url: str, tenant: str, timeout: float = 300) -> httpx.Client:
    return tenant_client(url, KEYS[tenant], timeout)


def _send(url: str, path: str, bodies: list[bytes], tenant: str = "mallory",
          parallel: int = 1) -> dict:
    return send_bodies(url, KEYS[tenant], path, bodies, parallel)


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


def run_all(attacks: list[str], src: Path | None) -> dict:
    """Every attack against one server (from `src`, another source tree, when given): each
    row with `/healthz` on the main port and, where the server has one, on its health port."""
    home = tempfile.mkdtemp(prefix="justitia-request-limits-")
    # the health listener's module, in a tree of flat modules or of layer packages
    has_health = src is None or any((src / m).exists() for m in ("server/health.py", "server/api/health.py"))
    health_port = free_port() if has_health else None
    server_args = ["--kv-tokens", "4096", "--max-model-len", "2048", "--rate-limit", "eve=2:2"]
    if health_port is not None:
        server_args += ["--health-port", str(health_port)]
    for tenant, key in KEYS.items():
        server_args += ["--api-key", f"{tenant}={key}"]
    env = {"JUSTITIA_HOME": home, **({"PYTHONPATH": str(src)} if src is not None else {})}
    health_url = f"http://127.0.0.1:{health_port}" if health_port is not None else None
    results: dict = {"server": server_args, "source": str(src) if src is not None else "this tree"}

    def measured(run: Callable[[str], dict], url: str) -> dict:
        with Prober(url) as prober, OtherTenant(url, KEYS["alice"]) as alice:
            side = Prober(health_url) if health_url is not None else None
            if side is not None:
                side.__enter__()
            try:
                started = time.monotonic()
                result = run(url)
                wall = time.monotonic() - started
            finally:
                if side is not None:
                    side.__exit__()
        row = {**result, **prober.summary(), **alice.summary(), "wall_s": round(wall, 1)}
        if side is not None:
            row.update(side.summary("health_port"))
        return row

    with EmbeddedServer(server_args, env=env, startup_timeout=1200) as srv:
        time.sleep(30)  # the grammar worker loads its compiler in the background
        results["baseline"] = measured(lambda url: (time.sleep(3), {})[1], srv.url)
        print("baseline", json.dumps(results["baseline"]), flush=True)
        for name in attacks:
            results[name] = measured(RUNNERS[name], srv.url)
            print(name, json.dumps(results[name]), flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"comma-separated, from {', '.join(ATTACKS)}")
    ap.add_argument("--before-src", type=Path, default=None,
                    help="first run the same attacks against a server from this source tree (an "
                         "older commit, `git archive REV | tar -x -C DIR`): before and after in one run")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/request_limits.json")
    args = ap.parse_args()
    attacks = args.attacks.split(",")
    for name in attacks:
        if name not in RUNNERS:
            ap.error(f"unknown attack {name!r}")
    results = {}
    if args.before_src is not None:
        print(f"before: {args.before_src}", flush=True)
        results["before"] = run_all(attacks, args.before_src.resolve())
        print("after: this tree", flush=True)
    results["after" if args.before_src is not None else "this"] = run_all(attacks, None)
    write_result(args.json, {"config": {"attacks": args.attacks,
                                        "before_src": str(args.before_src) if args.before_src else None},
                             "results": results}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
