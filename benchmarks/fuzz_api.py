"""A fuzz campaign against the HTTP API: schemathesis generates inputs from the server's own
OpenAPI schema, valid ones and invalid ones, for every operation, and sends them to a fresh
`justitia serve` (CPU engine, tiny model, API keys, limits on) as the tenant "admin".

Each answer is checked: no 5xx, status / content type / headers / body as documented, the key
required, an answer within the timeout (tests/support/fuzz_driver.py). The operations on one agent
and the completions are fuzzed again with the id of a live agent. Prints inputs tried and
failures per operation; writes benchmarks/results/fuzz_api.json. Exit status 1 on failures.

    .venv/bin/python benchmarks/fuzz_api.py [--examples 150] [--seed 0] [--json OUT]

The suite runs the same driver with 40 examples (tests/api/test_input_regressions.py).
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
from server.sim.provenance import write_result  # noqa: E402
from tests.support.fuzz_driver import (  # noqa: E402
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


HOSTILE_TARGETS = ("POST /v1/agents", "POST /v1/completions", "POST /v1/chat/completions",
                   "POST /v1/agents/{agent_id}/finish")


def _nested(depth: int, open_: str, close: str, leaf: str = "1") -> bytes:
    return (open_ * depth + leaf + close * depth).encode()


def hostile_bodies() -> list[tuple[str, bytes]]:
    """Bodies no schema generator writes: deep nesting (raw, past any recursion limit),
    huge strings, arrays and objects, numbers JSON parsers disagree on, broken encodings."""
    bodies: list[tuple[str, bytes]] = []
    for depth in (33, 100, 990, 1000, 5000, 100_000):
        bodies.append((f"metadata nested lists, depth {depth}",
                       b'{"type": "t", "prompt": "x", "metadata": {"k": ' + _nested(depth, "[", "]") + b"}}"))
        bodies.append((f"metadata nested objects, depth {depth}",
                       b'{"type": "t", "prompt": "x", "metadata": '
                       + _nested(depth, '{"a": ', "}", "1") + b"}"))
        bodies.append((f"prompt nested lists, depth {depth}",
                       b'{"prompt": ' + _nested(depth, "[", "]") + b', "max_tokens": 1}'))
        bodies.append((f"top-level nested lists, depth {depth}", _nested(depth, "[", "]")))
    for size in (1 << 20, (4 << 20) - 1024):
        bodies.append((f"prompt of {size} bytes", json.dumps({"type": "t", "prompt": "a " * (size // 2),
                                                              "max_tokens": 1}).encode()))
    bodies += [
        ("metadata of 100,000 keys", json.dumps({"type": "t", "prompt": "x",
                                                 "metadata": {f"k{i}": i for i in range(100_000)}}).encode()),
        ("10^6 token ids", json.dumps({"prompt": list(range(10, 1_000_010)), "max_tokens": 1}).encode()),
        ("200,000 chat messages", json.dumps({"messages": [{"role": "user", "content": "hi"}] * 200_000,
                                              "max_tokens": 1}).encode()),
        ("number 1e400", b'{"prompt": "x", "max_tokens": 1e400}'),
        ("integer of 5,000 digits", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
        ("NaN", b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}'),
        ("Infinity", b'{"prompt": "x", "max_tokens": 1, "top_p": Infinity}'),
        ("-0 and 1e-400", b'{"prompt": "x", "max_tokens": -0, "temperature": 1e-400}'),
        ("duplicate keys", b'{"prompt": "x", "prompt": ["y"], "max_tokens": 1, "max_tokens": "z"}'),
        ("raw invalid UTF-8 bytes", b'{"type": "t", "prompt": "' + bytes([0xFF, 0xFE, 0xC0]) + b'"}'),
        ("lone surrogate escape", b'{"type": "t", "prompt": "\\ud800"}'),
        ("NUL bytes", b'{"type": "t\\u0000", "prompt": "a\\u0000b"}'),
        ("truncated JSON", b'{"type": "t", "prompt": "x'),
        ("empty body", b""),
        ("top-level string", b'"just a string"'),
        ("top-level null", b"null"),
        ("a 4 MB string of quotes", b'{"prompt": "' + b'\\"' * (1 << 20) + b'"}'),
        ("stop list of 100,000", json.dumps({"prompt": "x", "max_tokens": 1, "stop": ["s"] * 100_000}).encode()),
        ("logit_bias of 100,000", json.dumps({"prompt": "x", "max_tokens": 1,
                                              "logit_bias": {str(i): 1 for i in range(100_000)}}).encode()),
    ]
    return bodies


def hostile_campaign(url: str, headers: dict[str, str], agent_id: str, timeout_s: float) -> dict:
    """Every hostile body to every JSON operation: no 5xx, an answer within the timeout,
    and /healthz still answering after each."""
    results: dict = {"inputs": 0, "server_errors": 0, "hangs": 0, "slowest_s": 0.0, "statuses": {},
                     "failed": []}
    with httpx.Client(base_url=url, timeout=timeout_s,
                      headers={**headers, "Content-Type": "application/json"}) as c:
        for target in HOSTILE_TARGETS:
            path = target.split(" ", 1)[1].replace("{agent_id}", agent_id)
            for name, body in hostile_bodies():
                t0 = time.monotonic()
                try:
                    status = c.post(path, content=body).status_code
                except httpx.TimeoutException:
                    status = "timeout"
                    results["hangs"] += 1
                elapsed = time.monotonic() - t0
                results["inputs"] += 1
                results["slowest_s"] = round(max(results["slowest_s"], elapsed), 3)
                results["statuses"][str(status)] = results["statuses"].get(str(status), 0) + 1
                if status == "timeout" or int(status) >= 500:
                    results["server_errors"] += status != "timeout"
                    results["failed"].append({"operation": target, "body": name, "status": status})
        results["healthy_after"] = c.get("/healthz").status_code == 200
    return results


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
        admin = {"Authorization": f"Bearer {KEYS['admin']}"}
        live = httpx.post(f"{srv.url}/v1/agents", headers=admin, json={"type": "fuzzed"}).json()["id"]
        hostile = hostile_campaign(srv.url, admin, live, args.timeout)
        healthy = httpx.get(f"{srv.url}/healthz").status_code == 200
    elapsed = time.monotonic() - start
    summary = summarize(tallies)
    print_table(summary)
    print(f"hostile bodies: {hostile['inputs']} inputs, {hostile['server_errors']} 5xx, "
          f"{hostile['hangs']} hangs, slowest {hostile['slowest_s']} s, statuses {hostile['statuses']}")
    print(f"all: {summary['inputs'] + hostile['inputs']} inputs, "
          f"{summary['server_errors'] + hostile['server_errors']} 5xx")
    print(f"server healthy after the run: {healthy}; {elapsed:.0f} s including the server start")
    result = {
        "config": {"examples_per_mode": args.examples, "seed": args.seed,
                   "timeout_s": args.timeout, "server_args": SERVER_ARGS + ["--api-key ..."],
                   "checks": list(CHECKS), "excluded": sorted(EXCLUDED),
                   "schemathesis": schemathesis.__version__},
        "elapsed_s": round(elapsed, 1),
        "healthy_after": healthy,
        **summary,
        "hostile_bodies": hostile,
        "total_inputs": summary["inputs"] + hostile["inputs"],
        "total_server_errors": summary["server_errors"] + hostile["server_errors"],
        "failed_inputs": [{"operation": t.label, "mode": t.mode, "kind": kind, "example": ex}
                          for t in tallies for kind, ex in t.examples.items()],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, result, indent=1)
    print(f"wrote {args.json}")
    clean = summary["failures"] == 0 and not hostile["failed"] and hostile["healthy_after"]
    return 0 if clean and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
