"""Whether the engine alone runs a fresh server's first burst slower than later ones.

Live, a fresh server's first burst of agents decodes slower than the bursts after it (the
family's `bursts`, docs/benchmarks.md "the client's turnaround"). This starts the in-process
vLLM CPU engine as the server does (its kernels built for every batch size, no HTTP, no
client), then sends the same burst of 15 requests (prompts of 60-400 tokens, 20-60 output
tokens, one every 20 ms) several times, the second pattern once between, and prints each
burst's time. Equal times: the engine alone is warm from its first burst on.

    python benchmarks/engine_first_burst.py [--rounds 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from server.engine.base import EngineRequest, SamplingOptions
from server.sim.calibrate import VOCAB_HIGH, VOCAB_LOW, calibration_engine_config
from server.sim.provenance import write_result

BURST = 15  # requests of one burst
GAP_S = 0.02  # between two of its requests


async def bursts(patterns: list[int], kv_tokens: int, max_model_len: int) -> list[float]:
    """Each pattern's burst on one engine, in turn: its seconds from the first request sent
    to the last one done."""
    from server.engine.vllm_local import LocalVLLMEngine

    engine = LocalVLLMEngine(calibration_engine_config(kv_tokens, max_model_len))
    await engine.start()
    ids = random.Random(0)
    sent = 0

    async def one(prompt: int, output: int) -> None:
        nonlocal sent
        sent += 1
        request = EngineRequest(f"burst-{sent}", tuple(ids.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(prompt)),
                                SamplingOptions(max_tokens=output, ignore_eos=True, temperature=0.0))
        async for _ in engine.generate(request):
            pass

    async def burst(pattern: int) -> float:
        shape = random.Random(pattern)
        started = time.perf_counter()
        tasks = []
        for _ in range(BURST):
            tasks.append(asyncio.create_task(one(shape.randrange(60, 400), shape.randrange(20, 60))))
            await asyncio.sleep(GAP_S)
        await asyncio.gather(*tasks)
        return time.perf_counter() - started

    try:
        return [await burst(p) for p in patterns]
    finally:
        await engine.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="bursts of the first pattern (default: %(default)s)")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", metavar="OUT", help="write the times here")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2: the first burst against the later ones")
    patterns = [1, 2] + [1] * (args.rounds - 1)  # the second pattern once, after the first burst
    times = asyncio.run(bursts(patterns, args.kv_tokens, args.max_model_len))
    first, later = times[0], [t for p, t in zip(patterns[1:], times[1:], strict=True) if p == 1]
    print("bursts (s): " + " ".join(f"{t:.3f}" for t in times))
    print(f"the first burst {first:.3f} s, the same burst later {min(later):.3f}-{max(later):.3f} s")
    if args.json:
        write_result(args.json, {"config": {"kv_tokens": args.kv_tokens, "max_model_len": args.max_model_len,
                                            "burst": BURST, "gap_s": GAP_S, "patterns": patterns},
                                 "seconds": times, "first_s": first, "later_s": later})
    return 0


if __name__ == "__main__":
    sys.exit(main())
