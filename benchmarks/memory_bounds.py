"""What a tenant's agents make the server hold: RSS growth of a server process (the real app
on the fake engine, so that only the API process is measured) under three loads:

- `live`: `--agents` (300) agents registered with metadata of 21,700 empty objects each
  (65 KB of JSON: the most --max-metadata-bytes allows by default; as Python dicts it would
  be 1.5 MB an agent);
- `ended`: as many agents with a 64 KiB prompt and that metadata, each run for one request
  and finished (ended agents stay readable for --agent-retention);
- `history`: one `GET /v1/history` page over their rows (bytes of the response, and the RSS
  peak while it is read).

`--src DIR` runs the server from another source tree (e.g. an older commit unpacked with
`git archive REV | tar -x -C DIR`) to compare before and after.

    .venv/bin/python benchmarks/memory_bounds.py [--agents 300] [--src DIR] [--label NAME] \
        [--json benchmarks/results/memory_bounds.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.sim.provenance import write_result  # noqa: E402

_SERVER = textwrap.dedent("""
    import sys, time
    from tests.support.fake_engine import FakeServer
    srv = FakeServer(sys.argv[1], retrain_every=0).start()  # no retraining process
    print(srv.url, flush=True)
    time.sleep(86400)
""")

METADATA = {"rows": [{}] * 21_700}
PROMPT = "p" * (64 * 1024)


def _rss_mb(proc: psutil.Process) -> float:
    return proc.memory_info().rss / 2**20


def _settled_rss(proc: psutil.Process, wait_s: float = 2.0) -> float:
    time.sleep(wait_s)
    return _rss_mb(proc)


def run(src: Path, agents: int, data: Path) -> dict:
    body = json.dumps({"type": "meta", "prompt": "x", "metadata": METADATA}, separators=(",", ":"))
    ended_body = json.dumps({"type": "ended", "prompt": PROMPT, "metadata": METADATA},
                            separators=(",", ":"))
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(data)], cwd=src,
                              env={**os.environ, "PYTHONPATH": str(src)}, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        proc = psutil.Process(server.pid)
        out: dict = {"agents": agents, "metadata_json_bytes": len(json.dumps(METADATA, separators=(",", ":")))}
        headers = {"Content-Type": "application/json"}
        with httpx.Client(base_url=url, timeout=300, headers=headers) as c:
            c.post("/v1/agents", content=body).raise_for_status()  # warm up
            base = _settled_rss(proc)
            started = time.monotonic()
            with ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(lambda _: c.post("/v1/agents", content=body).status_code,
                                      range(agents)))
            out["live"] = {"registered": codes.count(201), "seconds": round(time.monotonic() - started, 1),
                           "rss_before_mb": round(base, 1), "rss_after_mb": round(_settled_rss(proc), 1)}
            out["live"]["rss_growth_mb"] = round(out["live"]["rss_after_mb"] - base, 1)

            def one(_: int) -> int:
                rec = c.post("/v1/agents", content=ended_body).json()
                c.post("/v1/completions", headers={"X-Justitia-Agent": rec["id"]},
                       json={"prompt": "x", "max_tokens": 1}).raise_for_status()
                return c.post(f"/v1/agents/{rec['id']}/finish").status_code

            base = _rss_mb(proc)
            with ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(one, range(agents)))
            out["ended"] = {"finished": codes.count(200), "rss_before_mb": round(base, 1),
                            "rss_after_mb": round(_settled_rss(proc), 1)}
            out["ended"]["rss_growth_mb"] = round(out["ended"]["rss_after_mb"] - base, 1)

            peak = [_rss_mb(proc)]
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak.append(_rss_mb(proc))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample, daemon=True)
            base = _rss_mb(proc)
            sampler.start()
            page = c.get("/v1/history", params={"agent_type": "ended", "limit": 100_000})
            stop.set()
            sampler.join()
            out["history"] = {"page_bytes": len(page.content),
                              "samples_in_page": len(page.json()["samples"]),
                              "next_cursor": page.json().get("next_cursor"),
                              "rss_before_mb": round(base, 1), "rss_peak_mb": round(max(peak), 1),
                              "rss_peak_growth_mb": round(max(peak) - base, 1)}
        return out
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=300)
    ap.add_argument("--src", type=Path, default=ROOT, help="source tree to run the server from")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--json", type=Path, default=None,
                    help="add the run to this JSON file (a list of runs by label)")
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.src.resolve(), args.agents, Path(tmp) / "data")
    result["label"] = args.label
    result["host"] = {"cpus": os.cpu_count()}
    print(json.dumps(result, indent=2))
    if args.json is not None:
        runs = json.loads(args.json.read_text()) if args.json.exists() else {"runs": []}
        runs["runs"] = [r for r in runs["runs"] if r.get("label") != args.label] + [result]
        write_result(args.json, runs, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
