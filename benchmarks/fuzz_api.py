"""A fuzz campaign against the HTTP API: schemathesis generates inputs from the server's own
OpenAPI schema, valid ones and invalid ones, for every operation, and sends them to a fresh
`justitia serve` (CPU engine, tiny model, API keys, limits on) as the tenant "admin".

Each answer is checked: no 5xx, status / content type / headers / body as documented, the key
required, an answer within the timeout (tests/fuzz_driver.py). The operations on one agent
and the completions are fuzzed again with the id of a live agent. Prints inputs tried and
failures per operation; writes benchmarks/results/fuzz_api.json. Exit status 1 on failures.

    .venv/bin/python benchmarks/fuzz_api.py [--examples 150] [--seed 0] [--json OUT]

The suite runs the same driver with 40 examples (tests/test_fuzz_api.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import schemathesis  # noqa: E402

from server.launcher import EmbeddedServer  # noqa: E402
from tests.fuzz_driver import (  # noqa: E402
    CHECKS,
    EXCLUDED,
    Tally,
    fuzz_operation,
    load_schema,
    operations,
    summarize,
)

KEYS = {"admin": "key-admin-fuzz-campaign", "alice": "key-alice-fuzz-campaign"}
SERVER_ARGS = ["--kv-tokens", "2048", "--max-model-len", "512",
               "--max-request-tokens", "400", "--rate-limit", "1000:1000"]
LIVE_AGENT_PATH = ("GET /v1/agents/{agent_id}", "POST /v1/agents/{agent_id}/finish",
                   "DELETE /v1/agents/{agent_id}")
LIVE_AGENT_HEADER = ("POST /v1/completions", "POST /v1/chat/completions")


def campaign(url: str, examples: int, seed: int, timeout_s: float) -> list[Tally]:
    headers = {"Authorization": f"Bearer {KEYS['admin']}"}
    api = operations(load_schema(url))
    tallies: list[Tally] = []
    for _, op in sorted(api.items()):
        tallies += fuzz_operation(op, headers=headers, examples=examples, timeout_s=timeout_s,
                                  seed=seed)
    for label in LIVE_AGENT_PATH + LIVE_AGENT_HEADER:
        agent_id = httpx.post(f"{url}/v1/agents", headers=headers,
                              json={"type": "fuzzed"}).json()["id"]
        fixed = ({"path_parameters": {"agent_id": agent_id}} if label in LIVE_AGENT_PATH
                 else {"headers": {"X-Justitia-Agent": agent_id}})
        tallies += fuzz_operation(api[label], headers=headers, examples=examples,
                                  timeout_s=timeout_s, seed=seed, fixed=fixed,
                                  label=f"{label} [live agent]")
    return tallies


def print_table(summary: dict) -> None:
    print(f"{'operation':<50} {'inputs':>7} {'+/-':>9} {'slowest s':>9}  statuses / failures")
    for label, op in summary["operations"].items():
        statuses = " ".join(f"{k}:{v}" for k, v in op["statuses"].items())
        failures = "; ".join(f"{k} x{v}" for k, v in op["failures"].items())
        print(f"{label:<50} {op['inputs']:>7} {op['positive']:>4}/{op['negative']:<4} "
              f"{op['slowest_s']:>9.3f}  {statuses}{'  FAILURES: ' + failures if failures else ''}")
    print(f"total: {summary['inputs']} inputs, {summary['failures']} failures, "
          f"{summary['server_errors']} 5xx answers, slowest answer {summary['slowest_s']} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=150,
                        help="inputs per operation and generation mode (positive, negative)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds an answer may take before it counts as a hang")
    parser.add_argument("--json", default=str(ROOT / "benchmarks/results/fuzz_api.json"))
    args = parser.parse_args()

    # A throwaway data dir: the fuzzer's agents must not land in the real history.
    server_args = [*SERVER_ARGS, "--data-dir", tempfile.mkdtemp(prefix="justitia-fuzz-")]
    for tenant, key in KEYS.items():
        server_args += ["--api-key", f"{tenant}={key}"]
    start = time.monotonic()
    with EmbeddedServer(server_args) as srv:
        tallies = campaign(srv.url, args.examples, args.seed, args.timeout)
        healthy = httpx.get(f"{srv.url}/healthz").status_code == 200
    elapsed = time.monotonic() - start
    summary = summarize(tallies)
    print_table(summary)
    print(f"server healthy after the run: {healthy}; {elapsed:.0f} s including the server start")
    result = {
        "config": {"examples_per_mode": args.examples, "seed": args.seed,
                   "timeout_s": args.timeout, "server_args": SERVER_ARGS + ["--api-key ..."],
                   "checks": list(CHECKS), "excluded": sorted(EXCLUDED),
                   "schemathesis": schemathesis.__version__},
        "elapsed_s": round(elapsed, 1),
        "healthy_after": healthy,
        **summary,
        "failed_inputs": [{"operation": t.label, "mode": t.mode, "kind": kind, "example": ex}
                          for t in tallies for kind, ex in t.examples.items()],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if summary["failures"] == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
