"""How long `justitia serve` takes from launch to ready (`GET /readyz` answers 200).

Starts the embedded server (`server.EmbeddedServer`: `justitia serve` in a child process,
the vLLM CPU engine, the embedded tiny model) `--runs` times, one after another, and prints
each start-up time, the host's load average before it, and the range. The time is mostly
vLLM's: importing it, spawning its engine process, building the model. It varies with what
else the host runs.

    .venv/bin/python benchmarks/startup_time.py --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "startup_time.json"))
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        load = os.getloadavg()[0]
        home = tempfile.mkdtemp(prefix="justitia-startup-")
        srv = EmbeddedServer(["--kv-tokens", str(args.kv_tokens), "--data-dir", home],
                             startup_timeout=args.startup_timeout)
        t0 = time.monotonic()
        srv.start()
        ready = time.monotonic() - t0
        srv.stop()
        runs.append({"run": i + 1, "ready_s": round(ready, 1), "load_avg_1m_before": round(load, 2)})
        print(f"run {i + 1}: ready after {ready:.1f} s (1-minute load average before: {load:.2f})",
              flush=True)
    times = [r["ready_s"] for r in runs]
    print(f"start-up to ready: {min(times):.1f}-{max(times):.1f} s over {len(times)} runs "
          f"on {os.cpu_count()} cores")
    out = {"host": {"cores": os.cpu_count(), "machine": platform.machine()},
           "kv_tokens": args.kv_tokens, "runs": runs,
           "min_s": min(times), "max_s": max(times)}
    write_result(args.json, out, indent=2)


if __name__ == "__main__":
    main()
