"""Attacks of a hostile tenant on a real `justitia serve` (vLLM CPU engine), one at a time.

For each attack, a prober measures `/healthz` latency every 20 ms while the attack runs
(p50, p99, max); the API process's RSS is read before and after; answers with status >= 500
are counted. Attacks:

- `agents`: one tenant registers `--agents` idle agents (20,000 by default), then reads
  `GET /v1/agents` page by page;
- `prompt4mb`: ten ~4 MB prompts (under the body limit) to /v1/completions;
- `chat200k`: a chat of 200,000 messages;
- `ids1m`: a prompt of 10^6 token ids;
- `deep`: 200 bodies nested 900 deep (agent metadata and completion metadata);
- `slowloris`: `--slow-connections` connections (2,000) that never finish their headers;
- `kill9`: `--restarts` kill -9 of the server during a batch of agents, restarting it on
  the same data directory each time: agents the client saw finish and that are missing from
  the history afterwards are lost; engine processes left behind are orphans.

    .venv/bin/python benchmarks/hostile_tenant.py [--attacks agents,prompt4mb,...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.attacks import Prober, send_bodies, tenant_client  # noqa: E402
from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

KEYS = {"mallory": "key-mallory", "alice": "key-alice", "admin": "key-admin"}
ATTACKS = ("agents", "prompt4mb", "chat200k", "ids1m", "deep", "slowloris", "kill9")


def _server_args(home: str) -> list[str]:
    args = ["--kv-tokens", "4096", "--max-model-len", "2048"]
    for tenant, key in KEYS.items():
        args += ["--api-key", f"{tenant}={key}"]
    return args


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _client(url: str, tenant: str = "mallory", timeout: float = 120) -> httpx.Client:
    return tenant_client(url, KEYS[tenant], timeout)


def attack_agents(url: str, n: int) -> dict:
    statuses: dict[int, int] = {}

    def register(i: int) -> None:
        with _client(url) as c:
            for k in range(i, n, 16):
                s = c.post("/v1/agents", json={"type": "idle", "prompt": f"p{k}"}).status_code
                statuses[s] = statuses.get(s, 0) + 1

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(register, range(16)))
    pages, listed, slowest = 0, 0, 0.0
    with _client(url) as c:
        cursor = None
        while True:
            started = time.monotonic()
            body = c.get("/v1/agents", params={"limit": 1000,
                                                **({"cursor": cursor} if cursor else {})}).json()
            slowest = max(slowest, time.monotonic() - started)
            pages += 1
            listed += len(body["agents"])
            cursor = body.get("next_cursor")
            if not cursor:
                break
    return {"register_statuses": statuses, "listed": listed, "pages": pages,
            "slowest_page_s": round(slowest, 3), "5xx": sum(v for k, v in statuses.items() if k >= 500)}


def _post_many(url: str, path: str, bodies: list[bytes]) -> dict:
    return send_bodies(url, KEYS["mallory"], path, bodies)


def attack_prompt4mb(url: str) -> dict:
    body = json.dumps({"prompt": "word " * 800_000, "max_tokens": 1}).encode()
    return _post_many(url, "/v1/completions", [body] * 10)


def attack_chat200k(url: str) -> dict:
    msgs = [{"role": "user", "content": "hi"}] * 200_000
    return _post_many(url, "/v1/chat/completions",
                      [json.dumps({"messages": msgs, "max_tokens": 1}).encode()])


def attack_ids1m(url: str) -> dict:
    return _post_many(url, "/v1/completions",
                      [json.dumps({"prompt": [1] * 1_000_000, "max_tokens": 1}).encode()])


def attack_deep(url: str) -> dict:
    nested = "[" * 900 + "1" + "]" * 900
    agent = ('{"type": "deep", "prompt": "x", "metadata": {"k": ' + nested + "}}").encode()
    completion = ('{"prompt": "x", "max_tokens": 1, "metadata": {"k": ' + nested + "}}").encode()
    a = _post_many(url, "/v1/agents", [agent] * 100)
    b = _post_many(url, "/v1/completions", [completion] * 100)
    return {"agents": a, "completions": b, "5xx": a["5xx"] + b["5xx"]}


def attack_slowloris(url: str, n: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    time.sleep(12)  # past the server's 10 s header timeout
    closed = 0
    for s in socks:
        s.settimeout(1)
        try:
            closed += s.recv(10) == b""
        except OSError:
            pass
        s.close()
    return {"connections": n, "closed_by_server": closed}


def _agent(url: str, i: int, stop: threading.Event) -> str | None:
    if stop.is_set():
        return None
    try:
        with _client(url, "alice", timeout=30) as c:
            rec = c.post("/v1/agents", json={"type": "durable", "prompt": f"p{i}"}).json()
            c.post("/v1/completions", json={"prompt": f"x {i}", "max_tokens": 2},
                   headers={"X-Justitia-Agent": rec["id"]}).raise_for_status()
            r = c.post(f"/v1/agents/{rec['id']}/finish")
            return rec["id"] if r.status_code == 200 and r.json()["state"] == "finished" else None
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def attack_kill9(home: str, restarts: int) -> dict:
    reported: set[str] = set()
    orphans = 0
    for _ in range(restarts):
        srv = EmbeddedServer(_server_args(home), env={"JUSTITIA_HOME": home}).start()
        children = psutil.Process(srv.process.pid).children(recursive=True)
        stop = threading.Event()
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(_agent, srv.url, i, stop) for i in range(2000)]
            for done, f in enumerate(futures):
                f.result()
                if done == 60:
                    os.kill(srv.process.pid, signal.SIGKILL)
                    stop.set()
                    break
            reported |= {f.result() for f in futures} - {None}
        srv.process.wait(30)
        time.sleep(3)
        orphans += sum(1 for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
        for p in children:  # clean up whatever is left, so the next round starts clean
            try:
                p.kill()
            except psutil.Error:
                pass
    with EmbeddedServer(_server_args(home), env={"JUSTITIA_HOME": home}) as srv, \
            _client(srv.url, "alice") as c:
        kept: set[str] = set()
        cursor = None
        while True:
            body = c.get("/v1/history", params={"agent_type": "durable",
                                                 **({"cursor": cursor} if cursor else {})}).json()
            kept |= {s["agent_id"] for s in body["samples"]}
            cursor = body.get("next_cursor")
            if not cursor:
                break
    return {"restarts": restarts, "reported_finished": len(reported),
            "lost": len(reported - kept), "orphaned_engine_processes": orphans}


def run_attack(name: str, args: argparse.Namespace, home: str) -> dict:
    if name == "kill9":
        return attack_kill9(tempfile.mkdtemp(prefix="justitia-kill9-"), args.restarts)
    runners: dict[str, Callable[[str], dict]] = {
        "agents": lambda url: attack_agents(url, args.agents),
        "prompt4mb": attack_prompt4mb, "chat200k": attack_chat200k, "ids1m": attack_ids1m,
        "deep": attack_deep, "slowloris": lambda url: attack_slowloris(url, args.slow_connections),
    }
    with EmbeddedServer(_server_args(home), env={"JUSTITIA_HOME": home}) as srv:
        pid = srv.process.pid
        rss_before = _rss_mb(pid)
        with Prober(srv.url) as prober:
            started = time.monotonic()
            result = runners[name](srv.url)
            wall = time.monotonic() - started
        return {**result, **prober.summary(), "wall_s": round(wall, 1),
                "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(_rss_mb(pid), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"comma-separated, from {', '.join(ATTACKS)}")
    ap.add_argument("--agents", type=int, default=20_000, help="idle agents of the agents attack")
    ap.add_argument("--slow-connections", type=int, default=2_000)
    ap.add_argument("--restarts", type=int, default=10, help="kill -9 rounds of the kill9 attack")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/hostile_tenant.json")
    args = ap.parse_args()
    results = {}
    for name in args.attacks.split(","):
        if name not in ATTACKS:
            ap.error(f"unknown attack {name!r}")
        home = tempfile.mkdtemp(prefix=f"justitia-{name}-")
        print(f"attack {name} ...", flush=True)
        results[name] = run_attack(name, args, home)
        print(json.dumps(results[name]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, {"config": vars(args) | {"json": str(args.json)},
                                     "results": results}, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
