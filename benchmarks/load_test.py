"""A bounded load test through the real server on loopback.

`--agents` agents (default 1,000) of `--requests` requests each (default 10: two stages of
five in parallel, 10,000 requests in all) are pushed through `justitia serve` on the vLLM CPU
engine with the tiny model, `--concurrency` agents at a time. Every request asks for
`max_tokens` tokens with `ignore_eos`, so a reply with fewer tokens, an error or a missing
reply is a lost request. After each round the scheduler must be back to zero (no pending or
running request, no reserved KV, no live agent in the dispatcher, the GPS backlog drained),
and the server's memory (RSS of the API process) is read. Several rounds in one server show
whether memory keeps growing.

    .venv/bin/python benchmarks/load_test.py [--agents 1000] [--requests 10] [--rounds 3]

Prints a table and writes benchmarks/results/load_test.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402


@dataclass
class Round:
    agents: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    after: dict = field(default_factory=dict)
    rss_mb: float = 0.0

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        return {
            "agents": self.agents,
            "requests_ok": self.requests_ok,
            "requests_failed": self.requests_failed,
            "failures": self.failures,
            "wall_s": round(self.wall_s, 2),
            "requests_per_s": round(self.requests_ok / self.wall_s, 1) if self.wall_s else 0.0,
            "latency_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
            "latency_p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1) if lat else None,
            "scheduler_after": self.after,
            "server_rss_mb": round(self.rss_mb, 1),
        }


async def run_agent(session: aiohttp.ClientSession, i: int, requests: int, max_tokens: int,
                    stats: Round) -> None:
    async with session.post("/v1/agents", json={"type": f"load{i % 7}",
                                                 "prompt": f"load test agent {i}"}) as r:
        agent_id = (await r.json())["id"]
    headers = {"X-Justitia-Agent": agent_id}
    half = requests // 2

    async def one(j: int) -> None:
        body = {"prompt": f"agent {i} request {j}: check this claim", "max_tokens": max_tokens,
                "ignore_eos": True}
        started = time.perf_counter()
        try:
            async with session.post("/v1/completions", json=body, headers=headers) as r:
                data = await r.json()
                ok = r.status == 200 and data["usage"]["completion_tokens"] == max_tokens
                reason = "ok" if ok else f"{r.status}: {str(data)[:120]}"
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError) as exc:
            ok, reason = False, type(exc).__name__
        if ok:
            stats.requests_ok += 1
            stats.latencies_s.append(time.perf_counter() - started)
        else:
            stats.requests_failed += 1
            stats.failures[reason] = stats.failures.get(reason, 0) + 1

    for stage in (range(half), range(half, requests)):
        await asyncio.gather(*(one(j) for j in stage))
    async with session.post(f"/v1/agents/{agent_id}/finish") as r:
        await r.read()
    stats.agents += 1


SETTLED = ("pending_requests", "running_requests", "reserved_kv", "agents", "backlog")


async def one_round(url: str, agents: int, requests: int, concurrency: int,
                    max_tokens: int, settled_keys: tuple[str, ...] = SETTLED) -> Round:
    stats = Round()
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, timeout=timeout, connector=connector) as session:

        async def gated(i: int) -> None:
            async with gate:
                await run_agent(session, i, requests, max_tokens, stats)

        started = time.perf_counter()
        done = 0
        tasks = [asyncio.create_task(gated(i)) for i in range(agents)]
        for next_done in asyncio.as_completed(tasks):
            await next_done
            done += 1
            if done % max(1, agents // 10) == 0:
                print(f"  {done}/{agents} agents, {stats.requests_ok} requests ok, "
                      f"{stats.requests_failed} failed, {time.perf_counter() - started:.0f} s",
                      flush=True)
        stats.wall_s = time.perf_counter() - started
        stats.after = await settled(session, settled_keys)
    return stats


async def settled(session: aiohttp.ClientSession, keys: tuple[str, ...],
                  limit_s: float = 120.0) -> dict:
    """The scheduler's accounting once it has drained (the GPS backlog drains in virtual
    time, a little after the last request)."""
    deadline = time.monotonic() + limit_s
    while True:
        async with session.get("/v1/scheduler") as r:
            snap = await r.json()
        after = {k: snap[k] for k in keys}
        if not any(after.values()) or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=10, help="requests per agent (two stages)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds in the same server")
    ap.add_argument("--concurrency", type=int, default=64, help="agents in flight at once")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--url", default=None, help="an already running server (else one is started)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/load_test.json"))
    args = ap.parse_args()

    server = None
    if args.url is None:
        # Ended agents leave memory after 5 s (they stay in the history): what is left to
        # grow across rounds is leaks, not the readable record of the last hour.
        server = EmbeddedServer(["--kv-tokens", str(args.kv_tokens), "--max-model-len", "512",
                                 "--agent-retention", "5"]).start()
    url = args.url or server.url
    try:
        process = psutil.Process(server.process.pid) if server else None
        rss0 = process.memory_info().rss / 2**20 if process else 0.0
        rounds = []
        for k in range(args.rounds):
            print(f"round {k + 1}/{args.rounds}: {args.agents} agents x {args.requests} requests")
            r = asyncio.run(one_round(url, args.agents, args.requests, args.concurrency,
                                      args.max_tokens))
            time.sleep(6)  # past the retention: ended agents are pruned
            r.rss_mb = process.memory_info().rss / 2**20 if process else 0.0
            rounds.append(r.summary())
            print(json.dumps(rounds[-1]))
    finally:
        if server is not None:
            server.stop()
    result = {
        "command": " ".join(sys.argv),
        "agents_per_round": args.agents,
        "requests_per_agent": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "server_rss_start_mb": round(rss0, 1),
        "rounds": rounds,
        "lost_requests": sum(r["requests_failed"] for r in rounds)
        + sum(args.agents * args.requests - r["requests_ok"] - r["requests_failed"] for r in rounds),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result, indent=2)
    print(f"\n{'round':>5} {'ok':>7} {'failed':>6} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'RSS MB':>7}  scheduler after")
    for i, r in enumerate(rounds, 1):
        print(f"{i:>5} {r['requests_ok']:>7} {r['requests_failed']:>6} {r['requests_per_s']:>7} "
              f"{r['latency_p50_ms']:>8} {r['latency_p99_ms']:>8} {r['server_rss_mb']:>7}  "
              f"{r['scheduler_after']}")
    print(f"lost requests: {result['lost_requests']}; wrote {args.out}")
    return 0 if result["lost_requests"] == 0 and all(
        not any(r["scheduler_after"].values()) for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
