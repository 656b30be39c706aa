"""The dashboard under load: first render and stream bandwidth with 1,000 agents queued.

The real application runs on the fake engine (tests/support/fake_engine.py: the engine contract
without vLLM, so that the scheduler, not decoding, is what is measured), in this process,
on a free port. 1,000 agents register and each sends one completion while admission is
paused, so that all of them wait in the queue. Then:

1. first render: headless Chromium (Debian's, via Playwright) opens /dashboard, and the time
   from navigation start to the queue table holding its 200 rows is read from the page's
   own clock (performance.now()), over several fresh page loads;
2. stream bandwidth: GET /v1/scheduler/events is read for `--seconds` with the queue still
   (admission paused) and then while the agents are admitted, run and finish (churn);
   bytes per second and per frame are reported, the first frame apart.

Writes benchmarks/results/dashboard_load.json.

`--streams N --live-agents K` measures instead what many streams cost everyone else: a
server process of its own (the real app on the fake engine, `--max-dashboard-streams N`)
holds K live idle agents of one tenant, N dashboard streams of that tenant are opened and
read for `--seconds`, and a prober reads `/healthz` every 20 ms before (baseline) and
while they run; frames are built once per tick per tenant and shared by its streams.
Writes benchmarks/results/dashboard_streams.json.

    PYTHONPATH=. .venv/bin/python benchmarks/dashboard_load.py [--agents 1000] [--seconds 20]
    PYTHONPATH=. .venv/bin/python benchmarks/dashboard_load.py --streams 500 --live-agents 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from server.sim.provenance import write_result  # noqa: E402
from tests.support.fake_engine import FakeEngine, FakeServer  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
DEFAULT_OUT = str(ROOT / "benchmarks/results/dashboard_load.json")
failures: list[str] = []  # the load's requests that failed (reported, not fatal)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


async def _queue_agents(url: str, n: int, max_tokens: int, registered: threading.Event) -> None:
    """Register `n` agents of various costs, then run one completion each and finish it."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        ids = []
        for k in range(n):
            r = await c.post("/v1/agents", json={"type": f"bench_{k % 5}", "prompt": "x",
                                                 "predicted_cost": 2000.0 + 37.0 * (k % 97) * (k % 13)})
            r.raise_for_status()
            ids.append(r.json()["id"])
        registered.set()

        async def one(agent_id: str) -> None:
            try:
                r = await c.post("/v1/completions", json={"prompt": "load " * 8, "max_tokens": max_tokens,
                                                          "ignore_eos": True, "agent_id": agent_id})
                r.raise_for_status()
                (await c.post(f"/v1/agents/{agent_id}/finish")).raise_for_status()
            except httpx.HTTPError as exc:  # counted, not fatal: the load is the point here
                failures.append(f"{type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(i) for i in ids))


def _pending(url: str) -> int:
    return int(httpx.get(url + "/v1/scheduler", timeout=30).json()["pending_requests"])


def measure_stream(url: str, seconds: float) -> dict:
    """Bytes and frames of the dashboard's stream over `seconds` (first frame apart)."""
    sizes: list[int] = []
    first = 0
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("GET", "/v1/scheduler/events") as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            size = len(line) + len("event: frame\n") + 2
            if not first:
                first = size
                t0 = time.monotonic()
            else:
                sizes.append(size)
            if time.monotonic() - t0 >= seconds:
                break
    elapsed = time.monotonic() - t0
    return {"seconds": round(elapsed, 2), "first_frame_bytes": first, "frames": len(sizes),
            "bytes": sum(sizes), "bytes_per_s": round(sum(sizes) / elapsed, 1),
            "max_frame_bytes": max(sizes, default=0),
            "mean_frame_bytes": round(statistics.fmean(sizes), 1) if sizes else 0.0}


def measure_first_render(url: str, loads: int) -> dict:
    from playwright.sync_api import sync_playwright

    times: list[float] = []
    phases: list[dict] = []
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for _ in range(loads):
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(url + "/dashboard")
            page.wait_for_selector("#queue tbody tr:nth-child(200)", timeout=30_000)
            times.append(page.evaluate("performance.now()") / 1000.0)
            # where the time went: when each file and the stream's first bytes arrived
            phases.append(page.evaluate(
                "Object.fromEntries([['dom_content_loaded', performance.getEntriesByType('navigation')[0]"
                ".domContentLoadedEventEnd]].concat(performance.getEntriesByType('resource')"
                ".map(e => [e.name.split('/').pop(), Math.round(e.responseStart)])))"))
            context.close()
        browser.close()
    return {"loads": loads, "p50_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
            "all_s": [round(t, 3) for t in times], "phases_ms": phases, "console_errors": errors}


_STREAMS_SERVER = """
import sys, time
from tests.support.fake_engine import FakeServer
srv = FakeServer(sys.argv[1], retrain_every=0, max_dashboard_streams=int(sys.argv[2]),
                 max_agents=None).start()
print(srv.url, flush=True)
time.sleep(86400)
"""


async def _read_streams(url: str, n: int, seconds: float) -> dict:
    """`n` dashboard streams read for `seconds`: their statuses, frames and bytes."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    frames: list[int] = []
    first_frame_s: list[float] = []
    statuses: dict[int, int] = {}

    async def one(c: httpx.AsyncClient, k: int) -> None:
        opened = time.monotonic()
        got = 0
        async with c.stream("GET", "/v1/scheduler/events") as r:
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                return
            try:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        if not got:
                            first_frame_s.append(time.monotonic() - opened)
                        got += 1
            finally:
                # The stream never ends by itself: its reader is cancelled at the end of
                # the window, and the frames it read until then still count.
                frames.append(got)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        tasks = [asyncio.create_task(one(c, k)) for k in range(n)]
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    first = sorted(first_frame_s) or [0.0]
    return {"statuses": statuses, "streams_with_frames": len(first_frame_s),
            "frames_per_stream_p50": statistics.median(frames) if frames else 0,
            "first_frame_p50_s": round(statistics.median(first), 3), "first_frame_max_s": round(first[-1], 3)}


def measure_streams(streams: int, live_agents: int, seconds: float, out: str) -> None:
    import subprocess
    import tempfile

    from benchmarks.attacks import Prober

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-c", _STREAMS_SERVER, tmp, str(streams)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            started = time.monotonic()
            asyncio.run(_register_idle(url, live_agents))
            registered_s = time.monotonic() - started
            with Prober(url) as quiet:
                time.sleep(min(seconds, 5.0))
            with Prober(url) as loaded:
                read = asyncio.run(_read_streams(url, streams, seconds))
        finally:
            proc.terminate()
            proc.wait(30)
    result = {
        "config": {"streams": streams, "live_agents": live_agents, "seconds": seconds, "engine": "FakeEngine",
                   "max_dashboard_streams": streams,
                   "machine": "2 cores shared with other engineers' test runs"},
        "registered_s": round(registered_s, 1),
        "healthz_quiet": quiet.summary(), "healthz_streams": loaded.summary(), "streams": read,
        "targets": {"healthz_max_ms": 1000},
        "met": {"healthz": loaded.summary()["healthz_max_ms"] < 1000},
    }
    write_result(out, result, indent=2)
    print(json.dumps(result, indent=1), file=sys.stderr)


async def _register_idle(url: str, n: int) -> None:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def some(start: int) -> None:
            for k in range(start, n, 16):
                (await c.post("/v1/agents", json={"type": "idle", "prompt": f"p{k}",
                                                  "lease_s": 86_400})).raise_for_status()

        await asyncio.gather(*(some(i) for i in range(16)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=0,
                    help="measure N dashboard streams over --live-agents instead (a server process of its own)")
    ap.add_argument("--live-agents", type=int, default=20_000)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.streams:
        measure_streams(args.streams, args.live_agents, args.seconds,
                        str(ROOT / "benchmarks/results/dashboard_streams.json")
                        if args.out == DEFAULT_OUT else args.out)
        return

    import tempfile

    engine = FakeEngine(kv_capacity_tokens=16384, max_model_len=2048, step_s=0.002)
    with tempfile.TemporaryDirectory() as tmp, FakeServer(tmp, engine=engine) as srv:
        httpx.post(srv.url + "/v1/admin/pause", timeout=30).raise_for_status()
        registered = threading.Event()
        runner = threading.Thread(target=lambda: asyncio.run(
            _queue_agents(srv.url, args.agents, args.max_tokens, registered)), daemon=True)
        runner.start()
        registered.wait(600)
        deadline = time.monotonic() + 120
        while _pending(srv.url) < args.agents and time.monotonic() < deadline:
            time.sleep(0.2)
        queued = _pending(srv.url)
        print(f"{queued} requests of {args.agents} agents queued", file=sys.stderr)
        render = measure_first_render(srv.url, args.loads)
        print(f"first render: {render}", file=sys.stderr)
        still = measure_stream(srv.url, args.seconds)
        print(f"stream, queue still: {still}", file=sys.stderr)
        httpx.post(srv.url + "/v1/admin/resume", timeout=30).raise_for_status()
        churn = measure_stream(srv.url, args.seconds)
        churn["pending_requests_after"] = _pending(srv.url)
        print(f"stream, agents running and finishing: {churn}", file=sys.stderr)
        runner.join(600)
        churn["load_requests_failed"] = len(failures)
        churn["load_failures_sample"] = failures[:3]

    result = {
        "config": {"agents": args.agents, "queued_requests": queued, "engine": "FakeEngine",
                   "kv_capacity_tokens": 16384, "max_tokens": args.max_tokens, "seconds": args.seconds,
                   "browser": "Debian chromium, headless",
                   "machine": "2 cores shared with other engineers' test runs"},
        "first_render": render,
        "stream_still": still,
        "stream_churn": churn,
        "targets": {"first_render_s": 1.0, "stream_bytes_per_s": 100_000},
        "met": {"first_render": render["max_s"] < 1.0,
                "stream": max(still["bytes_per_s"], churn["bytes_per_s"]) < 100_000},
    }
    write_result(args.out, result, indent=2)
    print(json.dumps(result["met"]), file=sys.stderr)


if __name__ == "__main__":
    main()
