"""What a fresh server's warm-up reads against measured profiles (the prior's check).

Starts the embedded server (justitia, the vLLM CPU engine, the tiny model) `--starts` times
with each `--profile`, in turn (so that a slow minute of the host falls on one start of each
rather than on all starts of one), and records each start's `time_model.prior_check` from
`GET /v1/scheduler`: the warm-up's summed step time over the profile's prediction (`ratio`)
and whether the server scaled the profile (server/runtime/prior_check.py). Side by side, they
show how far one host's warm-up moves from start to start against the same profile, and how
far it stands from a profile of another host.

    python benchmarks/prior_check_readings.py --profile A.json --profile B.json --starts 3 \\
        --json benchmarks/results/prior_check_readings.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from benchmarks.engine_timing import write_json  # noqa: E402
from server.launcher import EmbeddedServer  # noqa: E402
from server.runtime.prior_check import TOLERANCE  # noqa: E402
from server.shared.profiles import load_profile  # noqa: E402


def read_once(profile: str, kv_tokens: int, max_model_len: int, tolerance: float) -> dict[str, Any]:
    """One fresh server given `profile`: its check of the profile against its warm-up."""
    home = tempfile.mkdtemp(prefix="justitia-prior-check-")
    args = ["--policy", "justitia", "--kv-tokens", str(kv_tokens), "--max-model-len", str(max_model_len),
            "--data-dir", home, "--profile", profile, "--prior-tolerance", str(tolerance)]
    with EmbeddedServer(args) as srv:
        described = httpx.get(f"{srv.url}/v1/scheduler", timeout=30).json()
    return described["time_model"]["prior_check"]


def summary(checks: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [c["ratio"] for c in checks if c.get("ratio") is not None]
    return {"ratios": ratios, "scaled": sum(bool(c["scaled"]) for c in checks),
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_range": [min(ratios), max(ratios)] if ratios else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="append", required=True, metavar="FILE",
                    help="a `bench calibrate` profile file (repeat for several)")
    ap.add_argument("--starts", type=int, default=3, help="fresh servers per profile (default 3)")
    ap.add_argument("--kv-tokens", type=int, default=4096, help="the engine's KV cache (default 4096)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="the engine's context (default 4096)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help=f"the servers' --prior-tolerance (default {TOLERANCE})")
    ap.add_argument("--json", metavar="FILE", help="write the readings here")
    args = ap.parse_args()
    if args.starts < 1:
        ap.error("--starts must be at least 1")
    for path in args.profile:
        load_profile(path)  # a bad file fails before any server starts
    checks: dict[str, list[dict[str, Any]]] = {path: [] for path in args.profile}
    for start in range(args.starts):
        for path in args.profile:
            check = read_once(path, args.kv_tokens, args.max_model_len, args.tolerance)
            checks[path].append(check)
            print(f"start {start + 1} {Path(path).name}: warm-up / profile {check['ratio']}, "
                  f"scaled {check['scaled']}", flush=True)
    profiles = [{"file": Path(path).name, "checks": checks[path], **summary(checks[path])}
                for path in args.profile]
    result = {"config": {"starts": args.starts, "kv_tokens": args.kv_tokens, "max_model_len": args.max_model_len,
                         "tolerance": args.tolerance}, "profiles": profiles}
    for p in profiles:
        print(f"{p['file']}: warm-up / profile {p['ratios']}, scaled {p['scaled']} of {args.starts}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
