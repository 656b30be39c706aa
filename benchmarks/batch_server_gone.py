"""How long a batch takes to fail when its server is gone.

Two cases, each a 160-input batch at the default concurrency (64) with `retries=1`:
- `never_there`: nothing listens at the URL;
- `killed`: a server (the real app on the fake engine, in its own process) is killed with
  SIGKILL once 20 inputs have finished, and not restarted.
Prints the seconds from the start (never_there) or from the kill (killed) until
`submit_many` returned, and how the inputs ended; writes benchmarks/results/batch_server_gone.json.

    .venv/bin/python benchmarks/batch_server_gone.py [--server-gone-s 120] [--inputs 160]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from justitia_sdk import AsyncClient, ServerGoneError, agent, llm, parallel_map  # noqa: E402
from server.launcher import free_port  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

_SERVE_FAKE = """
import sys, time
from tests.support.fake_engine import FakeEngine, FakeServer
srv = FakeServer(sys.argv[1], engine=FakeEngine(step_s=0.01)).start(port=int(sys.argv[2]))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@agent("gone_fanout")
async def fanout(i: int) -> int:
    parts = await parallel_map(lambda k: llm(f"doc {i} part {k}", max_tokens=40, ignore_eos=True),
                               range(5))
    return len(parts)


def outcome(batch, seconds: float) -> dict:
    errors = [h.error for h in batch if h.error is not None]
    return {"seconds": round(seconds, 1), "inputs": len(batch),
            "finished": sum(h.ok for h in batch),
            "failed_server_gone": sum(isinstance(e, ServerGoneError) for e in errors),
            "distinct_errors": len({id(e) for e in errors}),
            "runs": sum(h.attempts for h in batch),
            "never_run": sum(h.attempts == 0 for h in batch)}


async def never_there(inputs: int, gone_s: float) -> dict:
    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncClient(url, server_gone_s=gone_s) as client:
        t0 = time.perf_counter()
        batch = await client.submit_many(fanout, range(inputs), retries=1, progress=False)
        return outcome(batch, time.perf_counter() - t0)


async def killed(inputs: int, gone_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_FAKE, tempfile.mkdtemp(), str(port)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    killed_at: list[float] = []

    def kill_after_20() -> None:
        while sum(a["state"] == "finished" for a in httpx.get(
                url + "/v1/agents", params={"limit": 1000}).json()["agents"]) < 20:
            time.sleep(0.1)
        proc.kill()
        proc.wait(10)
        killed_at.append(time.perf_counter())

    try:
        async with AsyncClient(url, server_gone_s=gone_s) as client:
            thread = threading.Thread(target=kill_after_20, daemon=True)
            thread.start()
            batch = await client.submit_many(fanout, range(inputs), retries=1, progress=False)
            end = time.perf_counter()
        return outcome(batch, end - killed_at[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-gone-s", type=float, default=120.0)
    parser.add_argument("--inputs", type=int, default=160)
    args = parser.parse_args()
    result = {"server_gone_s": args.server_gone_s, "concurrency": 64, "retries": 1,
              "never_there": anyio.run(never_there, args.inputs, args.server_gone_s),
              "killed": anyio.run(killed, args.inputs, args.server_gone_s)}
    print(json.dumps(result, indent=2))
    out = ROOT / "benchmarks" / "results" / "batch_server_gone.json"
    write_result(out, result, indent=2)


if __name__ == "__main__":
    main()
