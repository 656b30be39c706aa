"""How much the SDK's HTTP transport costs agents that fan out.

Runs the same batch of agents (each a `parallel_map` of short completions) through the
embedded server twice from one process: once with httpx's own connection pool, once with
httpx over aiohttp (`httpx_aiohttp.AiohttpTransport`). Prints wall time and mean JCT of each.

    .venv/bin/python benchmarks/sdk_transport.py [--agents 40] [--fanout 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from justitia_sdk import AsyncClient, agent, llm, parallel_map  # noqa: E402
from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402


@agent("fanout")
async def fanout(text: str, n: int) -> int:
    parts = await parallel_map(lambda i: llm(f"{text} part {i}", max_tokens=24, ignore_eos=True),
                               range(n))
    return len(parts)


async def batch(url: str, transport, agents: int, n: int) -> dict:
    async with AsyncClient(url, transport=transport) as client:
        t0 = time.perf_counter()
        b = await client.submit_many(fanout, [{"text": f"doc {i}", "n": n} for i in range(agents)],
                                     progress=False)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "mean_jct_s": b.mean_jct_s()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=40)
    ap.add_argument("--fanout", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from httpx_aiohttp import AiohttpTransport

    out: dict[str, list[dict]] = {"httpx": [], "aiohttp": []}
    with EmbeddedServer(["--kv-tokens", "16384"]) as srv:
        for _ in range(args.rounds):  # alternate, so that both see the same machine state
            out["httpx"].append(anyio.run(batch, srv.url, None, args.agents, args.fanout))
            out["aiohttp"].append(anyio.run(batch, srv.url, AiohttpTransport(), args.agents, args.fanout))
    for k, runs in out.items():
        print(f"{k:8s} wall {statistics.median(r['wall_s'] for r in runs):.2f} s, mean JCT "
              f"{statistics.median(r['mean_jct_s'] for r in runs):.2f} s")
    path = ROOT / "benchmarks/results/sdk_transport.json"
    write_result(path, {"config": vars(args), "runs": out}, indent=1)


if __name__ == "__main__":
    main()
