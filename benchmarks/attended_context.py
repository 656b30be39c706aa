"""Does a decode step cost the context each sequence attends over, even when that context
is one shared prefix stored once?

Starts the embedded server (justitia, the vLLM CPU engine, the tiny model) and times N
requests decoding side by side, for N = 1, 4, 8, 16, in two cases, alternated:

* long: every request's prompt is one shared H-token head (stored once) and a 16-token tail;
* short: every request's prompt is a 16-token head and the same tail.

Every prompt is put in the prefix cache first (one request at a time, one output token), so
the timed batch prefills its last tokens only. The two cases hold about the same memory per
request beyond the head (the long case holds the head once more); if attention read a shared
head once per step, the difference between them would not grow with N. It grows by about
the head's length per added sequence: the engine time model's KV term counts the context
attended (a shared prefix once per sequence that reads it), not the blocks held
(server/scheduler/time_model.py).

    .venv/bin/python benchmarks/attended_context.py [--head 2048] [--output 128]
        [--rounds 3] [--json benchmarks/results/attended_context.json]
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

SIZES = (1, 4, 8, 16)


async def measure(url: str, head_tokens: int, output: int, rounds: int) -> dict[str, list[float]]:
    rng = random.Random(0)
    out: dict[str, list[float]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        complete = completer(client)

        for k in range(rounds):
            for n in SIZES:
                for case, head in (("short", TAIL), ("long", head_tokens)):
                    shared = [rng.randrange(*TOKENS) for _ in range(head)]
                    batch = [shared + [rng.randrange(*TOKENS) for _ in range(TAIL)] for _ in range(n)]
                    for p in batch:  # cached before the clock starts
                        await complete(p, 1)
                    t0 = time.perf_counter()
                    await asyncio.gather(*(complete(p, output) for p in batch))
                    dt = time.perf_counter() - t0
                    out.setdefault(f"{n}/{case}", []).append(dt)
                    print(f"round {k + 1}: {n:2d} requests, {case:>5s} head: {dt:.3f} s "
                          f"({1000 * dt / output:.2f} ms a step)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=int, default=2048, help="tokens of the shared head of the long case")
    ap.add_argument("--output", type=int, default=128, help="tokens each request decodes")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of every case")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    kv = 2 * max(SIZES) * (TAIL + args.output) + 2 * (args.head + TAIL) + 4096
    with embedded_server(kv, max(2048, args.head + 2 * TAIL + args.output), "justitia-attended-") as url:
        runs = asyncio.run(measure(url, args.head, args.output, args.rounds))
    rows = []
    for n in SIZES:
        short = statistics.median(runs[f"{n}/short"]) / args.output
        long = statistics.median(runs[f"{n}/long"]) / args.output
        rows.append({"requests": n, "step_short_ms": 1000 * short, "step_long_ms": 1000 * long,
                     "difference_ms": 1000 * (long - short)})
        print(f"{n:2d} requests: a step over 16-token heads {1000 * short:.2f} ms, over one shared "
              f"{args.head}-token head {1000 * long:.2f} ms, difference {1000 * (long - short):.2f} ms")
    first, last = rows[0], rows[-1]
    added = (last["requests"] - first["requests"]) * args.head  # head tokens attended more
    per_token = (last["difference_ms"] - first["difference_ms"]) / 1000 / added
    print(f"each added sequence over the shared head: {1e9 * per_token:.0f} ns a step per head token")
    res = {"head_tokens": args.head, "tail_tokens": TAIL, "output_tokens": args.output, "kv_tokens": kv,
           "runs": runs, "rows": rows, "per_attended_token_s": per_token}
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
