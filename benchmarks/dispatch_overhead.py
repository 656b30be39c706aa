"""Dispatch overhead: time of one admission decision with 10,000 queued requests.

1,000 agents with 10 pending requests each; every step admits one request (engine_free_slots=1),
finishes it and submits a replacement, so the queue stays at 10,000. Reports the median and
p99 of the admit() call (one decision) per policy, and the full step (admit + finish +
submit). Writes benchmarks/results/dispatch_overhead.json.

The benchmark's requests finish the moment they are admitted, so ewsjf, which groups requests
by their measured service time, learns a single group here. The row `ewsjf-8groups` gives it
a partition of 8 groups first (frozen during the run) to time the decision over 8 queues,
and `ewsjf_refit` times one refit that moves every edge and reroutes the 10,000 queued
requests (ewsjf refits every 32 finished requests, and reroutes only when the edges move by more
than its hysteresis).

The rows `eta-upkeep` time the ETA upkeep (server/scheduler/eta.py) with 10,000 agents
queued (one pending request each, justitia; a time model, the `cpu-tiny` profile's, and a
declared shape per agent, as a live server has them): the same loop, plus `refresh_etas` every
`--refresh-every` decisions (250: a quarter second at the loop's 1 ms of simulated time per
decision), against the same loop without it. The upkeep per decision is the difference of the
median steps; the refresh itself is amortised over the decisions between two refreshes (mean).

The rows `justitia-prefixes` and `justitia-blockhash` time justitia's decision with shared
prompt prefixes: every request names its agent type's system prompt and its
agent's instructions (two named prefixes, as a workload file does), or carries the prefix
chain the live server hashes from token ids (one id per unit of 128 tokens, 4 blocks of 32,
the heads shared per agent type and per agent; a request's own tokens are slices of one
random pool, as a tokenizer hands them over), so that every admission checks the running set's
holds.

Every decision here runs right after the previous one, with the scheduler's data still in the
core's caches. `--flush-kib 4096` overwrites 4 MiB between two decisions (untimed), for every
row alike: the cold-cache figure of a live server, where request handling runs in between.

    .venv/bin/python benchmarks/dispatch_overhead.py [--agents 1000] [--per-agent 10] [--steps 20000]
        [--flush-kib 4096 --out benchmarks/results/dispatch_overhead_cold.json]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dataclasses import replace  # noqa: E402

from server.scheduler import POLICY_NAMES, AgentShape, Dispatcher, RequestSpec, kv_cost  # noqa: E402
from server.scheduler.prefix import block_chain  # noqa: E402
from server.shared.profiles import get_profile  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

PREFIX_ROWS = ("justitia-prefixes", "justitia-blockhash")


@functools.cache
def _token_pool() -> list[int]:
    """Token ids of the requests' own text: slices of one random pool (built on first use).
    Drawing each prompt's ids with about 1,500 calls of `random` between two decisions
    (`--token-source random`) runs enough Python to evict the scheduler's data from
    the core's caches before every timed decision, in this row only: 21 us against 17.6."""
    return random.Random(5).choices(range(10, 700), k=1 << 20)


def _prefix(mode: str, agent: int, p: int, rid: str, unit: int, tokens: str = "pool") -> tuple:
    """A request's prefix chain in the prefix rows: 400 tokens of one of 8 system prompts,
    then 300 of its agent's instructions, then its own tokens."""
    if mode == "justitia-prefixes":
        chain = [(f"sys{agent % 8}", min(p, 400))]
        if p > 400:
            chain.append((f"a{agent}/instr", min(p, 700)))
        return tuple(chain)
    ids = ([agent % 8] * 400 + [1000 + agent] * 300)[:p]
    rng = random.Random(rid)
    if tokens == "random":  # one call of `random` per token: evicts the caches
        ids += [rng.randrange(10, 700) for _ in range(p - len(ids))]
    else:  # the request's own tokens, as a tokenizer hands them over
        pool = _token_pool()
        start = rng.randrange(len(pool) - 3000)
        ids += pool[start:start + p - len(ids)]
    return block_chain(ids, unit)


def _ewsjf_groups(d: Dispatcher, groups: int = 8) -> None:
    """Teach ewsjf `groups` kinds of request (x = ln work from 7 to 14, each e^0.8 slower
    than the last), then freeze its partition and tuner for the run."""
    state = d.policy.state
    rng = random.Random(1)
    lo, hi = 7.0, 14.0
    for g in range(groups):
        x = lo + (hi - lo) * g / max(1, groups - 1)
        state._obs.extend((x + rng.uniform(-0.3, 0.3), 0.8 * g + rng.gauss(0, 0.05)) for _ in range(30))
    state.params = (state.params[0], state.params[1], 0.25)
    state.refit()
    state.config = replace(state.config, epoch=10**12)  # no further epochs or refits
    assert len(state.counts) == groups, state.partition


def bench(policy: str, agents: int, per_agent: int, steps: int, seed: int = 0, flush_kib: int = 0,
          tokens: str = "pool") -> dict:
    """`flush_kib`: overwrite that much memory after each step (untimed), so that every decision
    starts with the core's caches holding none of the scheduler's data, as in a live server
    where request handling runs between two decisions."""
    rng = random.Random(seed)
    flush = bytearray(flush_kib * 1024)
    junk = bytes(len(flush))
    name = policy
    groups = policy.endswith("-8groups")
    prefixes = policy if policy in PREFIX_ROWS else ""
    policy = policy.removesuffix("-8groups")
    if prefixes:
        policy = "justitia"
    block = 32 if prefixes else 1
    d = Dispatcher(policy, kv_capacity_tokens=10**9, iteration_time_s=0.025, block_size=block)
    unit = d.prefix_block  # the live server's hashing unit (128 tokens: 4 blocks of 32)
    chains: dict[str, tuple] = {}

    def spec(rid: str, agent: int, p: int, o: int) -> RequestSpec:
        chain = chains.setdefault(rid, _prefix(prefixes, agent, p, rid, unit, tokens)) if prefixes else ()
        return RequestSpec(rid, f"a{agent}", p, o, o, prefix=chain)

    if groups:
        _ewsjf_groups(d)
    now = 0.0
    k = 0
    lengths = {}
    for a in range(agents):
        d.register_agent(f"a{a}", kv_cost(1000, 200) * per_agent * rng.uniform(0.2, 5), now)
        for _ in range(per_agent):
            p, o = rng.randint(50, 3000), rng.randint(10, 800)
            d.submit(spec(f"r{k}", a, p, o), now)
            lengths[f"r{k}"] = (p, o)
            k += 1
    decide, step = [], []
    for _ in range(steps):
        now += 0.001
        t0 = time.perf_counter_ns()
        out = d.admit(now, engine_free_slots=1)
        t1 = time.perf_counter_ns()
        done = out[0]
        d.on_request_finished(done.request_id, *lengths.pop(done.request_id), now)
        p, o = rng.randint(50, 3000), rng.randint(10, 800)
        # the live server hashes a prompt once, when its request arrives: not timed here
        th = time.perf_counter_ns()
        nxt = spec(f"r{k}", int(done.agent_id[1:]), p, o)
        hashing = time.perf_counter_ns() - th
        d.submit(nxt, now)
        lengths[f"r{k}"] = (p, o)
        k += 1
        t2 = time.perf_counter_ns() - hashing
        decide.append((t1 - t0) / 1000)
        step.append((t2 - t0) / 1000)
        if flush:
            flush[:] = junk  # reads one buffer and writes the other: twice `flush_kib` through the caches
    assert d.ledger.pending_count == agents * per_agent
    q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))]  # noqa: E731
    extra = {}
    if policy == "ewsjf":
        extra["groups"] = len(d.policy.state.counts)
    if groups:  # one refit that moves the edges: every queued request is rerouted
        state = d.policy.state
        state._obs.extend((x + 1.0, y) for x, y in list(state._obs))
        t0 = time.perf_counter_ns()
        state.refit()
        extra["refit_ms"] = (time.perf_counter_ns() - t0) / 1e6
        extra["rerouted"] = state.queued
    return {
        "policy": name,
        **extra,
        "flush_kib": flush_kib,
        "token_source": tokens if prefixes == "justitia-blockhash" else None,
        "queued_requests": d.ledger.pending_count,
        "agents": agents,
        "decisions": steps,
        "median_decision_us": statistics.median(decide),
        "p99_decision_us": q(decide, 0.99),
        "median_step_us": statistics.median(step),
    }


def bench_eta(agents: int, steps: int, refresh_every: int, refresh: bool, seed: int = 0) -> dict:
    """justitia with `agents` agents of one pending request each; `refresh`: run the ETA pass
    every `refresh_every` decisions (its cost lands in the step it follows)."""
    rng = random.Random(seed)
    # as in a live server: a time model (the profile prior at least) and agents that declare
    # their shape, so that the pass takes its per-agent prefill path
    d = Dispatcher("justitia", kv_capacity_tokens=10**9, iteration_time_s=0.025,
                   time_model=get_profile("cpu-tiny").time_model())
    now, lengths = 0.0, {}
    for a in range(agents):
        shape = AgentShape(rng.randint(1, 8), rng.randint(50, 2000), rng.randint(0, 20_000))
        d.register_agent(f"a{a}", kv_cost(1000, 200) * rng.uniform(0.2, 5), now, tenant=f"t{a % 8}",
                         shape=shape)
        p, o = rng.randint(50, 3000), rng.randint(10, 800)
        d.submit(RequestSpec(f"r{a}", f"a{a}", p, o, o), now)
        lengths[f"r{a}"] = (p, o)
    k, step, passes = agents, [], []
    for i in range(steps):
        now += 0.001
        t0 = time.perf_counter_ns()
        if refresh and i % refresh_every == 0:
            d.refresh_etas(now)
            passes.append((time.perf_counter_ns() - t0) / 1e6)
        spec = d.admit(now, engine_free_slots=1)[0]
        d.on_request_finished(spec.request_id, *lengths.pop(spec.request_id), now)
        p, o = rng.randint(50, 3000), rng.randint(10, 800)
        d.submit(RequestSpec(f"r{k}", spec.agent_id, p, o, o), now)
        lengths[f"r{k}"] = (p, o)
        k += 1
        step.append((time.perf_counter_ns() - t0) / 1000)
    assert d.ledger.pending_count == agents
    return {
        "agents": agents,
        "refresh_every": refresh_every if refresh else None,
        "median_step_us": statistics.median(step),
        "mean_step_us": statistics.fmean(step),
        "median_refresh_ms": statistics.median(passes) if passes else None,
    }


def compare_token_sources(args: argparse.Namespace) -> int:
    """The hashed-chain row with each token source, alternated in one run."""
    rows = []
    for run in range(args.compare_token_sources):
        for tokens in ("random", "pool"):
            r = bench("justitia-blockhash", args.agents, args.per_agent, args.steps, tokens=tokens)
            rows.append({"run": run, **r})
            print(f"run {run} {tokens:6s} median decision {r['median_decision_us']:5.1f} us   "
                  f"p99 {r['p99_decision_us']:5.1f} us")
    medians = {t: statistics.median(r["median_decision_us"] for r in rows if r["token_source"] == t)
               for t in ("random", "pool")}
    print("median of the runs' medians: " + ", ".join(f"{t} {m:.1f} us" for t, m in medians.items()))
    out = args.out.replace(".json", "_tokens.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_result(out, {"python": sys.version.split()[0], "median_of_medians_us": medians,
                                     "rows": rows}, indent=1)
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--per-agent", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--out", default="benchmarks/results/dispatch_overhead.json")
    ap.add_argument("--eta-agents", type=int, default=10_000)
    ap.add_argument("--refresh-every", type=int, default=250)
    ap.add_argument("--eta-only", action="store_true", help="only the eta-upkeep rows")
    ap.add_argument("--token-source", choices=("pool", "random"), default="pool",
                    help="how the hashed-chain row makes each new prompt's own token ids: slices of a "
                         "pool (default), or one call of `random` per token between two decisions "
                         "(which evicts the caches in that row only)")
    ap.add_argument("--flush-kib", type=int, default=0,
                    help="overwrite this much memory between two decisions (untimed), so that each "
                         "decision starts with cold caches, as in a live server (4096 > a core's L2)")
    ap.add_argument("--compare-token-sources", type=int, default=0, metavar="N",
                    help="only time the hashed-chain row with both token sources, alternated N times, "
                         "and write OUT with the suffix _tokens")
    args = ap.parse_args()
    if args.compare_token_sources:
        return compare_token_sources(args)
    eta_rows = []
    for run in range(3):  # alternated, so that the machine's load hits both alike
        for refresh in (False, True):
            eta_rows.append({"run": run, **bench_eta(args.eta_agents, args.steps, args.refresh_every, refresh)})
    base = statistics.median(r["median_step_us"] for r in eta_rows if r["refresh_every"] is None)
    with_eta = [r for r in eta_rows if r["refresh_every"] is not None]
    upkeep = {
        "median_step_without_us": base,
        "median_step_with_us": statistics.median(r["median_step_us"] for r in with_eta),
        "mean_step_without_us": statistics.median(r["mean_step_us"] for r in eta_rows if r["refresh_every"] is None),
        "mean_step_with_us": statistics.median(r["mean_step_us"] for r in with_eta),
        "median_refresh_ms": statistics.median(r["median_refresh_ms"] for r in with_eta),
    }
    print(f"eta-upkeep    {args.eta_agents} agents queued: median step {upkeep['median_step_without_us']:.1f} us "
          f"without, {upkeep['median_step_with_us']:.1f} us with refresh_etas every {args.refresh_every} decisions; "
          f"mean {upkeep['mean_step_without_us']:.1f} / {upkeep['mean_step_with_us']:.1f} us; "
          f"one refresh {upkeep['median_refresh_ms']:.1f} ms")
    rows: list[dict] = []
    if args.eta_only:
        args.out = args.out.replace(".json", "_eta.json")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, {"python": sys.version.split()[0], "eta_upkeep": upkeep,
                                              "eta_rows": eta_rows}, indent=1)
        print(f"wrote {args.out}")
        return 0
    for policy in (*POLICY_NAMES, "ewsjf-8groups", *PREFIX_ROWS):
        r = bench(policy, args.agents, args.per_agent, args.steps, flush_kib=args.flush_kib, tokens=args.token_source)
        rows.append(r)
        more = f", {r['groups']} groups" if "groups" in r else ""
        print(f"{policy:13s} median decision {r['median_decision_us']:6.1f} us   p99 {r['p99_decision_us']:6.1f} us   "
              f"admit+finish+submit {r['median_step_us']:6.1f} us   ({r['queued_requests']} queued{more})")
        if "refit_ms" in r:
            print(f"{'':13s} one refit that moves every edge: {r['refit_ms']:.1f} ms "
                  f"({r['rerouted']} requests rerouted)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {"python": sys.version.split()[0], "rows": rows, "eta_upkeep": upkeep,
                                          "eta_rows": eta_rows}, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
