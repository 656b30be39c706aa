"""A notebook-style batch of many agents with the SDK's default settings, on the real engine.

Reports whether every agent finished, the wall time, and the peak number of TCP connections
the client held to the server (sampled every 50 ms with psutil): with one event stream per
batch and a bounded pool it stays bounded whatever the batch's size (one stream per agent
would have 100 agents hold 100 event streams, fill the client's pool and deadlock).

    .venv/bin/python benchmarks/batch_scale.py --agents 1000 --json benchmarks/results/batch_scale.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from justitia_sdk import Client, agent, llm, parallel_map  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402


@agent("scale_fanout")
async def fanout(i: int, branches: int = 3) -> str:
    parts = await parallel_map(lambda k: llm(f"part {k} of {i}", max_tokens=8),
                               range(branches))
    return await llm("combine " + " ".join(parts), max_tokens=8)


class ConnectionSampler:
    """The peak number of this process's TCP connections to `port`."""

    def __init__(self, port: int, every_s: float = 0.05) -> None:
        self.port = port
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _count(self) -> int:
        conns = psutil.Process().net_connections(kind="tcp")
        return sum(1 for c in conns if c.raddr and c.raddr.port == self.port
                   and c.status == psutil.CONN_ESTABLISHED)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._count())
            time.sleep(self.every_s)

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--url", help="a running server (default: start the embedded one)")
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--no-progress", action="store_true", help="no live table")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    server = None
    url = args.url
    if url is None:
        from server.launcher import EmbeddedServer

        server = EmbeddedServer(["--kv-tokens", str(args.kv_tokens)]).start()
        url = server.url
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        with Client(url) as client, ConnectionSampler(port) as sampler:
            started = time.monotonic()
            batch = client.submit_many(fanout, list(range(args.agents)),
                                       progress=not args.no_progress)
            wall = time.monotonic() - started
    finally:
        if server is not None:
            server.stop()
    statuses: dict[str, int] = {}
    for h in batch:
        statuses[h.status] = statuses.get(h.status, 0) + 1
    result = {
        "agents": args.agents,
        "finished": statuses.get("finished", 0),
        "statuses": statuses,
        "wall_s": round(wall, 2),
        "agents_per_s": round(args.agents / wall, 2),
        "peak_client_connections": sampler.peak,
        "mean_jct_s": batch.mean_jct_s(),
        "settings": "defaults (concurrency 64, progress view on)" if not args.no_progress
        else "defaults, no progress view",
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, result, indent=2)
    return 0 if result["finished"] == args.agents else 1


if __name__ == "__main__":
    raise SystemExit(main())
