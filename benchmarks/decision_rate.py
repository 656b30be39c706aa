"""Decisions per second: how many requests one Justitia scheduler admits per second.

Every request is one admission decision of the scheduler (and one placement, with replicas).
The server here is the whole control plane, `justitia serve`'s code in a process of its own
(tests/support/fake_serve.py), over an engine that costs next to nothing (the fake engine,
one step every `--step-s`, 0.1 ms by default): what limits it is the scheduler process (HTTP,
the scheduler, the agent table, the accounting), not decoding. `--agents` registered agents
send one-token completions (`ignore_eos`), `--concurrency` at a time, over HTTP from this
process, for `--seconds` after a warm-up; the rate is the requests that completed per second
(median over `--rounds` rounds), with their p50/p99 latency.

From it, on paper, the fleet one scheduler serves: a replica that completes `r` requests a
second needs `r` decisions a second, so one scheduler keeps `rate / r` such replicas busy.
Writes benchmarks/results/decision_rate.json.

    .venv/bin/python benchmarks/decision_rate.py [--agents 200] [--concurrency 64] [--seconds 15] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from server.launcher import free_port  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def start_server(step_s: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    data = tempfile.mkdtemp(prefix="justitia-decisions-")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fake_serve", "--port", str(port),
                             "--data-dir", data, "--step-s", str(step_s)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


async def run_round(url: str, agents: list[str], concurrency: int, seconds: float,
                    warmup_s: float) -> dict:
    latencies: list[float] = []
    failures = 0
    start = time.monotonic()
    counting_from, stop = start + warmup_s, start + warmup_s + seconds
    # aiohttp: a lighter client than httpx, so that the load generator is not the limit
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as c:
        async def worker(k: int) -> None:
            nonlocal failures
            i = k
            while time.monotonic() < stop:
                agent_id = agents[i % len(agents)]
                i += concurrency
                t0 = time.monotonic()
                async with c.post(url + "/v1/completions", headers={"X-Justitia-Agent": agent_id},
                                  json={"prompt": "hi", "max_tokens": 1, "ignore_eos": True}) as r:
                    await r.read()
                    status = r.status
                t1 = time.monotonic()
                if status != 200:
                    failures += 1
                elif t0 >= counting_from and t1 <= stop:
                    latencies.append(t1 - t0)

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return {"decisions_per_s": round(len(latencies) / seconds, 1), "completed": len(latencies),
            "failed": failures, "p50_ms": round(percentile(latencies, 0.5) * 1000, 2),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.0001)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/decision_rate.json"))
    args = parser.parse_args()
    proc, url = start_server(args.step_s)
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            agents = [c.post("/v1/agents", json={"type": "decisions", "prompt": "x"}).json()["id"]
                      for _ in range(args.agents)]
        rounds = []
        for n in range(args.rounds):
            row = asyncio.run(run_round(url, agents, args.concurrency, args.seconds, args.warmup_s))
            rounds.append(row)
            print(f"round {n + 1}: {row['decisions_per_s']:.0f} decisions/s, p50 {row['p50_ms']} ms, "
                  f"p99 {row['p99_ms']} ms, {row['failed']} failed", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    rate = statistics.median(r["decisions_per_s"] for r in rounds)
    print(f"median: {rate:.0f} decisions/s with {args.concurrency} requests in flight")
    write_result(args.out, {"agents": args.agents, "concurrency": args.concurrency, "seconds": args.seconds,
                            "step_s": args.step_s, "rounds": rounds, "median_decisions_per_s": rate})
    return 0


if __name__ == "__main__":
    sys.exit(main())
