"""Calibrate the simulator's `cpu-tiny` engine profile on the real vLLM CPU engine.

Superseded by `justitia bench calibrate` (server/sim/calibrate.py), which measures every
engine step through the server's own engine and fits the time model the server learns
online; this script runs it with the `cpu-tiny` settings (16,384 KV tokens, context 2,048):

    .venv/bin/python benchmarks/calibrate_cpu_tiny.py [--out benchmarks/results/profile_cpu_tiny_16384.json]

The first calibration (run-level timings, 32-token prompts only) is kept in
benchmarks/results/calibrate_cpu_tiny.json; the built-in `cpu-tiny` profile still uses it.
"""

from __future__ import annotations

import argparse

from justitia_cli import main as justitia


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/profile_cpu_tiny_16384.json")
    parser.add_argument("--quick", action="store_true", help="a four-point grid")
    args = parser.parse_args()
    argv = ["bench", "calibrate", "--kv-tokens", "16384", "--max-model-len", "2048", "--out", args.out]
    return justitia(argv + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    raise SystemExit(main())
