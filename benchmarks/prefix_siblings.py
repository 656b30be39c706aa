"""Does vLLM's prefix cache share a prompt head between requests admitted together?

Starts the embedded server (justitia, the vLLM CPU engine, the tiny model) and sends, through
its OpenAI API: N requests at once with one common head of H tokens and tails of their own;
then one request with the same head after they finished; then N more at once. After each
group it reads `justitia_prefix_cached_tokens` from /metrics (the sum of vLLM's per-request
`num_cached_tokens`). Prefix-aware admission reserves a shared head once for requests that
run side by side; this checks that the engine does too, for siblings of one
`parallel_map` admitted in the same step.

    .venv/bin/python benchmarks/prefix_siblings.py [--siblings 4] [--head 1024]
        [--json benchmarks/results/prefix_siblings.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import httpx  # noqa: E402

from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

TOKENS = (100, 780)  # inside the tiny model's vocabulary


def cached_total(metrics: str) -> float:
    m = re.search(r"^justitia_prefix_cached_tokens(?:\{[^}]*\})? ([0-9.e+]+)", metrics, re.M)
    if m is None:
        raise RuntimeError("/metrics has no justitia_prefix_cached_tokens")
    return float(m.group(1))


async def measure(url: str, siblings: int, head_tokens: int, tail_tokens: int) -> dict:
    rng = random.Random(0)
    head = [rng.randrange(*TOKENS) for _ in range(head_tokens)]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(seed: int) -> None:
            tail = random.Random(seed)
            prompt = head + [tail.randrange(*TOKENS) for _ in range(tail_tokens)]
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16,
                                                           "ignore_eos": True, "temperature": 0.0})
            r.raise_for_status()

        async def cached() -> float:
            return cached_total((await client.get("/metrics")).text)

        out = {}
        before = await cached()
        await asyncio.gather(*(one(i) for i in range(siblings)))
        out["siblings_at_once_cold"] = (after := await cached()) - before
        await one(1000)
        out["one_later"] = (later := await cached()) - after
        await asyncio.gather(*(one(2000 + i) for i in range(siblings)))
        out["siblings_at_once_warm"] = await cached() - later
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--siblings", type=int, default=4)
    ap.add_argument("--head", type=int, default=1024, help="tokens of the common head")
    ap.add_argument("--tail", type=int, default=64, help="tokens of each request's own tail")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    home = tempfile.mkdtemp(prefix="justitia-siblings-")
    server_args = ["--policy", "justitia", "--kv-tokens", "8192", "--max-model-len", "2048", "--data-dir", home]
    with EmbeddedServer(server_args) as srv:
        out = asyncio.run(measure(srv.url, args.siblings, args.head, args.tail))
    n, h = args.siblings, args.head
    print(f"{n} requests at once, head not cached before: {out['siblings_at_once_cold']:.0f} prompt tokens "
          f"served from the cache (all but the first: {(n - 1) * h})")
    print(f"1 request after them: {out['one_later']:.0f} (the head: {h})")
    print(f"{n} requests at once, head cached: {out['siblings_at_once_warm']:.0f} (all of them: {n * h})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, {"siblings": n, "head_tokens": h, "tail_tokens": args.tail,
                                               **out}, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
