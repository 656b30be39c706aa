"""Where a live run's time went, request by request, against the simulator's run of it.

`bench live` keeps each server's data dir and names it in its JSON (`data_dir`); the
server's history there holds every agent's requests with when each was submitted, admitted
and finished. The simulator replays the same workload under the same policy on the engine
the server fitted to the run's own steps (its `time_model`, every step since the start), and
the same three times are taken from its dispatcher. Printed and written: per request size,
the time in the engine (admitted to finished) live over simulated; in all, the time waited
in the queue (submitted to admitted), the makespan and the mean JCT; and the live requests'
time from admission to finish split by the engine's own clocks (its way in, its queue,
prefill, decode, the way back) and the server's rest. A simulator whose
engine is right but whose order is not shows equal engine times and unequal waits.

    python benchmarks/requests_vs_sim.py RUN.json [--policy justitia] [--history FILE] [--turnaround S] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import statistics
import sys
from pathlib import Path

from justitia_cli.bench.sim import fitted_profile
from server.scheduler import dispatcher as dispatcher_module
from server.shared.profiles import EngineProfile
from server.sim.provenance import write_result
from server.sim.simulator import run_comparison
from server.sim.workload import AgentSpec, load_workload

SIZES = ((0, 1024), (1024, 2048), (2048, 3500), (3500, 10**9))  # prompt + output tokens
# A request's time inside the engine by the engine's clocks, as the server's history keeps it
# (server/runtime/agents.py `RequestLog`): the way in, the engine's queue, prefill, decode,
# the way back.
ENGINE_PARTS = ("to_engine_s", "engine_queued_s", "prefill_s", "decode_s", "from_engine_s")


def _size_name(tokens: int) -> str:
    """The SIZES bucket a request of `tokens` (prompt + output) falls in, as "lo-hi"."""
    lo, hi = next(b for b in SIZES if b[0] <= tokens < b[1])
    return f"{lo}-{hi if hi < 10**9 else ''}"


def live_requests(history: Path) -> dict[tuple[str, int], list[dict]]:
    """(workload agent id, prompt + output tokens) -> its requests' times, in seconds since
    the first agent's registration."""
    db = sqlite3.connect(f"file:{history}?mode=ro", uri=True)
    rows = db.execute("SELECT metadata, submitted_at, requests FROM agents").fetchall()
    t0 = min(r[1] for r in rows)
    out: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for metadata, submitted, requests in rows:
        agent = json.loads(metadata)["workload_id"]
        for r in json.loads(requests):
            at = submitted - t0
            times = {"submitted": at + r["submitted_s"], "admitted": at + r["admitted_s"],
                     "finished": at + r["finished_s"], **{k: r.get(k) for k in ENGINE_PARTS}}
            out[(agent, r["prompt_tokens"] + r["output_tokens"])].append(times)
    return out


def simulated_requests(agents: list[AgentSpec], policy: str, profile: EngineProfile,
                       kv_tokens: int) -> tuple[dict[tuple[str, int], list[dict]], dict]:
    """The same times from the simulator's dispatcher (its submit, admission and finish
    calls, observed), and the run's summary."""
    seen: dict[int, dict[str, dict]] = collections.defaultdict(dict)  # per dispatcher: the isolated runs too
    cls = dispatcher_module.Dispatcher
    submit, admitted, finished = cls.submit, cls.mark_running, cls.on_request_finished

    def on_submit(self, spec, now):
        seen[id(self)][spec.request_id] = {"agent": spec.agent_id, "submitted": now}
        return submit(self, spec, now)

    def on_admit(self, agent, req, now):
        seen[id(self)][req.spec.request_id]["admitted"] = now
        return admitted(self, agent, req, now)

    def on_finish(self, request_id, prompt_tokens, output_tokens, *args, **kwargs):
        now = kwargs.get("now", args[0] if args else None)
        seen[id(self)][request_id]["finished"] = now
        return finished(self, request_id, prompt_tokens, output_tokens, *args, **kwargs)

    cls.submit, cls.mark_running, cls.on_request_finished = on_submit, on_admit, on_finish  # type: ignore[method-assign]
    try:
        [result] = run_comparison(agents, [policy], profile, kv_tokens, tau="measured")
    finally:
        cls.submit, cls.mark_running, cls.on_request_finished = submit, admitted, finished  # type: ignore[method-assign]
    run = max(seen.values(), key=len)  # the run of every agent, not one alone
    by_id = {a.id: a for a in agents}
    out: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for request_id, times in run.items():
        agent, stage, index = request_id.rsplit("/", 2)
        p, d = by_id[agent].stages[int(stage)][int(index)]
        out[(agent, p + d)].append(times)
    return out, result.summary()


def time_split(live: dict) -> dict | None:
    """The live requests' time from admission to finish, summed, split by the engine's own
    clocks into its parts (`ENGINE_PARTS`) and the server's own rest (from its admission to
    its hand-off, and from the engine's last output to its bookkeeping). None when the history
    has no engine times (an engine that does not report them)."""
    reqs = [r for rs in live.values() for r in rs if all(r.get(k) is not None for k in ENGINE_PARTS)]
    if not reqs:
        return None
    total = sum(r["finished"] - r["admitted"] for r in reqs)
    parts = {k: sum(r[k] for r in reqs) for k in ENGINE_PARTS}
    return {"requests": len(reqs), "admitted_to_finished_s": total, **parts,
            "server_s": total - sum(parts.values())}


def compare(live: dict, sim: dict) -> dict:
    """Requests matched by agent and size, in order: engine time per size, waits in all."""
    sizes: dict[str, list[list[float]]] = {_size_name(lo): [[], []] for lo, _ in SIZES}
    waits = [0.0, 0.0]
    for key, mine in live.items():
        twins = list(sim.get(key, []))
        for r in mine:
            if not twins:
                continue
            s = twins.pop(0)
            bucket = sizes[_size_name(key[1])]
            bucket[0].append(r["finished"] - r["admitted"])
            bucket[1].append(s["finished"] - s["admitted"])
            waits[0] += r["admitted"] - r["submitted"]
            waits[1] += s["admitted"] - s["submitted"]
    return {
        "engine_time_by_size": {name: {
            "requests": len(live_s), "live_s": sum(live_s), "sim_s": sum(sim_s),
            "live_over_sim": sum(live_s) / sum(sim_s) if sum(sim_s) > 0 else None,
            "median_ratio": statistics.median(a / b for a, b in zip(live_s, sim_s, strict=True) if b > 0)
            if live_s else None} for name, (live_s, sim_s) in sizes.items()},
        "queue_wait_live_s": waits[0], "queue_wait_sim_s": waits[1],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_json", help="a `bench live --json` file")
    ap.add_argument("--policy", default="justitia", help="the policy's run to compare (default: %(default)s)")
    ap.add_argument("--history", help="the server's history file (default: history.sqlite3 in the run's data_dir)")
    ap.add_argument("--json", help="write the comparison here")
    ap.add_argument("--turnaround", type=float, default=None, metavar="S",
                    help="the client's turnaround the simulation waits before each later stage of an agent "
                         "(default: the one the server measured during the run; 0: none)")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.run_json).read_text())
    [run] = [r for r in doc["results"] if r["policy"] == args.policy]
    history = Path(args.history or Path(run["data_dir"]) / "history.sqlite3")
    profile = fitted_profile(EngineProfile.from_dict(doc["config"]["profile"]), run["time_model"],
                             run.get("stage_turnaround_s") if args.turnaround is None else args.turnaround)
    if profile is None:
        raise SystemExit("the run reports no fitted engine to simulate it on")
    agents = load_workload(doc["config"]["workload"])
    sim, summary = simulated_requests(agents, args.policy, profile, doc["config"]["kv_tokens"])
    out = {"run": args.run_json, "policy": args.policy, "profile": profile.as_dict(),
           "live_mean_jct_s": run["mean_jct_s"], "sim_mean_jct_s": summary["mean_jct_s"],
           "live_makespan_s": run["makespan_s"], "sim_makespan_s": summary["makespan_s"],
           **compare(live := live_requests(history), sim), "live_time_split": time_split(live)}
    print(f"mean JCT live {out['live_mean_jct_s']:.2f} s, simulated on the run's own engine "
          f"{out['sim_mean_jct_s']:.2f} s; makespan {out['live_makespan_s']:.1f} / {out['sim_makespan_s']:.1f} s")
    for name, b in out["engine_time_by_size"].items():
        if b["requests"]:
            print(f"requests of {name} tokens: {b['requests']:4d}, in the engine {b['live_s']:.2f} s live, "
                  f"{b['sim_s']:.2f} s simulated ({b['live_over_sim']:.2f}x; median request {b['median_ratio']:.2f}x)")
    print(f"waited in the queue: {out['queue_wait_live_s']:.1f} request-seconds live, "
          f"{out['queue_wait_sim_s']:.1f} simulated")
    if split := out["live_time_split"]:
        print(f"live, admitted to finished: {split['admitted_to_finished_s']:.2f} request-seconds over "
              f"{split['requests']} requests: " + ", ".join(
                  f"{name} {split[key]:.2f}" for name, key in (
                      ("on the way in", "to_engine_s"), ("in the engine's queue", "engine_queued_s"),
                      ("prefill", "prefill_s"), ("decode", "decode_s"), ("on the way back", "from_engine_s"),
                      ("the server's own", "server_s"))))
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
