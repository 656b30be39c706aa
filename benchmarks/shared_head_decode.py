"""Does a shared prompt head make the CPU engine's decode steps cheaper, or only save memory?

Starts the embedded server (justitia, the vLLM CPU engine, the tiny model) and times N
requests decoding side by side over contexts of H + T tokens in two cases, alternated:

* shared: the H-token head is the same for every request (vLLM stores it once);
* private: every request has a head of its own (stored N times).

Prefill is the same in both: every prompt is put in the prefix cache first (one request at a
time, one output token), so the timed batch prefills its last tokens only and the two cases
differ only in the memory their decode steps read. Prefix-aware accounting counts
a shared head once in memory; this measures whether the engine's decode time follows.

    .venv/bin/python benchmarks/shared_head_decode.py [--requests 8] [--head 1024]
        [--output 128] [--rounds 3] [--json benchmarks/results/shared_head_decode.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.engine_timing import TAIL, TOKENS, completer, embedded_server, write_json  # noqa: E402


def prompts(shared: bool, n: int, head_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(*TOKENS) for _ in range(head_tokens)]
    out = []
    for _ in range(n):
        own = head if shared else [rng.randrange(*TOKENS) for _ in range(head_tokens)]
        out.append(own + [rng.randrange(*TOKENS) for _ in range(TAIL)])
    return out


async def measure(url: str, n: int, head_tokens: int, output: int, rounds: int) -> dict[str, list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        complete = completer(client)

        out: dict[str, list[float]] = {"shared": [], "private": []}
        for k in range(rounds):
            for case in ("shared", "private"):
                batch = prompts(case == "shared", n, head_tokens, seed=2 * k + (case == "private"))
                for p in batch:  # cached before the clock starts: the batch prefills its last tokens only
                    await complete(p, 1)
                t0 = time.perf_counter()
                await asyncio.gather(*(complete(p, output) for p in batch))
                out[case].append(time.perf_counter() - t0)
                print(f"round {k + 1} {case:>7s}: {out[case][-1]:.3f} s", flush=True)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="requests decoding side by side")
    ap.add_argument("--head", type=int, default=1024, help="tokens of each request's head")
    ap.add_argument("--output", type=int, default=128, help="tokens each request decodes")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of both cases")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    # room for every private head at once, and for max_model_len
    kv = max(4096, 2 * args.requests * (args.head + TAIL + args.output))
    with embedded_server(kv, max(2048, args.head + TAIL + args.output), "justitia-shared-head-") as url:
        out = asyncio.run(measure(url, args.requests, args.head, args.output, args.rounds))
    ratios = [s / p for s, p in zip(out["shared"], out["private"], strict=True)]
    res = {"requests": args.requests, "head_tokens": args.head, "tail_tokens": TAIL, "output_tokens": args.output,
           "kv_tokens": kv, **out, "median_shared_s": statistics.median(out["shared"]),
           "median_private_s": statistics.median(out["private"]), "ratios": ratios,
           "median_ratio": statistics.median(ratios)}
    print(f"{args.requests} requests decoding {args.output} tokens over {args.head}-token heads: shared "
          f"{res['median_shared_s']:.3f} s, private {res['median_private_s']:.3f} s (medians); shared / private "
          f"per round {', '.join(f'{r:.2f}' for r in ratios)}")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
