"""`justitia bench live`: replay a workload through the real server on the real engine.

For each policy in turn: start `justitia serve --policy P` (in-process vLLM, the embedded
tiny model, KV capacity M), replay the workload's agents at their arrival times over HTTP
(register, run stage after stage with the stage's requests in parallel, finish), then stop
the server. Requests use `ignore_eos` with `max_tokens = d`, so output lengths are exactly
the trace's. Prompts are `p` random token ids, seeded per request: identical prompts would
share KV blocks through vLLM's prefix cache and hide the memory contention being measured.
A request that names shared prefixes (`prefix` in the workload) starts with really identical
tokens instead: the tokens of prefix `id` at prompt positions [start, end) are the same in
every request naming it (one seeded stream per id, indexed by position, so that a longer
prefix of an id extends a shorter one), and only the rest of the prompt is private. The
results then carry the engine's `prefix_hit_rate` (prompt tokens vLLM served from its prefix
cache over all prompt tokens) and `kv_saved_total` (KV tokens admission did not reserve again).
Under a prefix-aware Justitia, oracle agents declare their cost with shared prefixes
counted once, exactly as the server will charge it: from the whole units of the rendered
prompts (the server hashes prompts in units of whole blocks, `prefix_block` tokens, so a
named prefix shares only its whole units). A declaration even slightly below the server's charge is an
over-run, and an over-running agent whose GPS share has run out goes behind every agent that
arrived meanwhile (docs/concepts.md, "Over-runs"): measured on the 48-agent prefix workload,
declaring `kv_cost_shared` (token-exact prefixes) made 38 of 48 agents over-run by 0.6% in
all, and justitia ran 16% slower than its prefix-blind ablation.

Tool pauses (`pauses_s`) are waited out before their stages, the agent registered and
paused. A request carrying `ctx` resends the whole sequence of the agent's previous request
of that conversation as the engine really produced it (its prompt as sent and the token ids
it generated, `return_token_ids`), then the rest of its rendered prompt; so the prefix cache
can hit what it still holds. Its `reprefill_tokens` are the tokens of that sequence, in whole
blocks, that the engine did not serve from its cache (`usage.prompt_tokens_details`).

The replay client is aiohttp, not httpx: with a few hundred requests in flight, httpx's
connection pool added seconds to every call on this 2-core machine (median 0.65 s, max 10 s
to register an agent, measured with the 40-agent workload), which delayed arrivals and
stages more than any scheduler could win back; aiohttp answered the same calls in 10-26 ms.

The JSON is the same as `bench sim`'s. Times are on the workload's clock (seconds since the
replay began); `gps_finish_s` is the exact fluid GPS finish time at the rate R = M / tau the
server measured during the run, and `delay_bound_s` is what the server promised the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from justitia_cli.bench.scheduler_kill import SchedulerRestart, delete_engines
from server.scheduler import get_policy, gps_finish_times
from server.scheduler.cost import KV
from server.scheduler.policies import Justitia
from server.scheduler.prefix import block_chain, stage_kv_cost
from server.sim.results import AgentResult, PolicyResult
from server.sim.workload import AgentSpec

VOCAB_LOW, VOCAB_HIGH = 10, 700  # token ids of the tiny model's vocabulary, specials excluded
TEACH_SEED = 7919
RAY_STARTUP_TIMEOUT_S = 1500.0  # the teaching replay's token ids: the measured seed's plus this


@dataclass(frozen=True)
class LiveOptions:
    kv_tokens: int
    max_model_len: int = 2048
    prediction: str = "oracle"  # oracle: register with the true cost; server: its predictor
    seed: int = 0
    startup_timeout_s: float = 300.0
    log_dir: str | None = None
    las_half_life_s: float | None = None  # the las policy's half-life (None: its default)
    las_head_wait_weight: float | None = None  # its head-wait weight (None: its default)
    # Replayed first on each server, unmeasured: the measured run then meets a server taught by
    # another sample of the same traffic (its engine speed, its cost predictor, its arrivals).
    teach: list[AgentSpec] | None = None
    # With `teach`: stop the taught server and start another on its data dir before the
    # measured run, which then meets what a restarted server learns again from its history.
    restart: bool = False
    # A `bench calibrate` file: each server's time model starts from it (`serve --profile`).
    profile: str | None = None
    # Engine replicas on Ray Serve (`serve --ray ADDRESS --replicas N`; kv_tokens is their
    # sum), on `ray_address`, a cluster the caller started (server/engine/ray_cluster.py),
    # whose processes are under `ray_pid`.
    ray: bool = False
    ray_address: str = ""
    ray_pid: int | None = None
    replicas: int = 1
    # With `ray`: kill one engine replica's process (and its engine) this many seconds
    # into the replay; Ray replaces it.
    kill_replica_after_s: float | None = None
    # With `ray`: SIGKILL the server (the scheduler) this many seconds into the replay and
    # start it again on the same port (justitia_cli/bench/scheduler_kill.py).
    kill_scheduler_after_s: float | None = None
    # An agent not done this long after the last arrival is lost (it hangs).
    hang_timeout_s: float = 900.0
    # Each server's `serve --retain` (kept contexts of paused agents; policies that keep none: never).
    retain: str = "auto"
    # With `teach`: the measured run's clock starts this long after the teaching's last
    # arrival (or when its last agent is done, if later), a lull the server sees as silence.
    # None: at once when the teaching is done.
    teach_lull_s: float | None = None


class PrefixTokens:
    """The token ids of named prefixes: one seeded stream per id, indexed by prompt position."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._streams: dict[str, tuple[random.Random, list[int]]] = {}

    def tokens(self, key: str, start: int, end: int) -> list[int]:
        rng, ids = self._streams.setdefault(key, (random.Random(f"{self.seed}:prefix:{key}"), []))
        while len(ids) < end:
            ids.append(rng.randrange(VOCAB_LOW, VOCAB_HIGH))
        return ids[start:end]


def _prompt(agent: AgentSpec, stage: int, index: int, p: int, seed: int,
            prefixes: PrefixTokens | None = None) -> list[int]:
    head: list[int] = []
    if prefixes is not None:
        for key, tokens in agent.prefix(stage, index):
            head += prefixes.tokens(key, len(head), tokens)
    rng = random.Random(f"{seed}:{agent.id}:{stage}:{index}")
    return head + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(p - len(head))]


def declared_cost(agent: AgentSpec, policy: str, prompts: dict[tuple[int, int], list[int]],
                  block_size: int) -> float:
    """What an oracle agent declares: its KV cost, under a prefix-aware Justitia with the
    prefixes its rendered prompts share counted once, block by block as the server counts
    them (`prompts`: the prompt of each (stage, index))."""
    pol = get_policy(policy)
    if not (isinstance(pol, Justitia) and pol.prefix_aware and pol.cost_model == KV) or not agent.prefixes:
        return agent.kv_cost
    return sum(stage_kv_cost([(p, d, block_chain(prompts[(s, i)], block_size)) for i, (p, d) in enumerate(st)],
                             block_size)
               for s, st in enumerate(agent.stages))


def render(agents: list[AgentSpec], seed: int) -> dict[str, dict[tuple[int, int], list[int]]]:
    """Every request's prompt token ids, by agent id and (stage, index)."""
    prefixes = PrefixTokens(seed)
    return {a.id: {(s, i): _prompt(a, s, i, p, seed, prefixes) for s, st in enumerate(a.stages)
                   for i, (p, _) in enumerate(st)} for a in agents}


async def _call(session: aiohttp.ClientSession, method: str, path: str, **kw) -> dict:
    async with session.request(method, path, **kw) as r:
        body = await r.text()
        if r.status >= 400:
            raise RuntimeError(f"{method} {path} failed with {r.status}: {body}")
        return json.loads(body) if body else {}


async def _register(session: aiohttp.ClientSession, body: dict[str, Any], patience_s: float) -> dict:
    """Register an agent; while the server does not answer (it is being restarted), try
    again every second for `patience_s`, as a client would."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return await _call(session, "POST", "/v1/agents", json=body)
        except aiohttp.ClientError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def _run_agent(session: aiohttp.ClientSession, agent: AgentSpec, t0: float,
                     opts: LiveOptions, prompts: dict[tuple[int, int], list[int]], cost: float,
                     block_size: int = 1) -> dict:
    """Replay one agent; an agent that fails (a request answered with an error) is
    cancelled on the server and reported with its error instead of its finish."""
    state: dict[str, Any] = {}
    try:
        return await _agent_steps(session, agent, t0, opts, prompts, cost, block_size, state)
    except (RuntimeError, aiohttp.ClientError) as exc:  # an error answer, or the server went away
        if "id" in state:
            with contextlib.suppress(RuntimeError, aiohttp.ClientError):
                await _call(session, "DELETE", f"/v1/agents/{state['id']}")
        return {"arrival": state.get("arrival"), "error": str(exc), "first": state.get("first")}


async def _agent_steps(session: aiohttp.ClientSession, agent: AgentSpec, t0: float, opts: LiveOptions,
                       prompts: dict[tuple[int, int], list[int]], cost: float, block_size: int,
                       state: dict[str, Any]) -> dict:
    await asyncio.sleep(max(0.0, t0 + agent.arrival - time.monotonic()))
    arrival = state["arrival"] = time.monotonic() - t0
    body: dict[str, Any] = {
        "type": agent.type,
        "prompt": agent.prompt or agent.type,
        # The agent's structure lets the server state a bound that covers its critical path.
        "metadata": {"stages": len(agent.stages),
                     "critical_path_tokens": agent.critical_path_tokens,
                     "prefill_tokens": agent.prefill_tokens,
                     "prefill_square_tokens": agent.prefill_square_tokens,
                     "first_request_tokens": agent.first_request_tokens,
                     "stage_request_tokens": list(agent.stage_request_tokens),
                     "workload_id": agent.id},
    }
    if opts.prediction == "oracle":
        body["predicted_cost"] = cost
    first = state["first"] = await _register(session, body, opts.hang_timeout_s)
    agent_id = state["id"] = first["id"]
    headers = {"X-Justitia-Agent": agent_id}
    talk = _Conversations(block_size)
    for s, stage in enumerate(agent.stages):
        if (pause := agent.pause_before(s)) > 0:
            await asyncio.sleep(pause)  # a tool call: registered, nothing in flight
        sent = [talk.prompt(agent, s, i, prompts[(s, i)]) for i in range(len(stage))]
        outs = await asyncio.gather(*(
            _call(session, "POST", "/v1/completions", headers=headers, json={
                "prompt": sent[i], "max_tokens": d,
                "ignore_eos": True, "temperature": 0.0, "return_token_ids": True,
            })
            for i, (p, d) in enumerate(stage)
        ))
        for i, out in enumerate(outs):
            talk.answered(agent, s, i, sent[i], out)
    final = await _call(session, "POST", f"/v1/agents/{agent_id}/finish")
    return {"arrival": arrival, "finish": time.monotonic() - t0, "first": first, "final": final,
            "reprefill_tokens": talk.reprefill}


class _Conversations:
    """One agent's conversations (`ctx`): the sequence each one has reached, as sent and
    generated, and the tokens of them the engine prefilled again."""

    def __init__(self, block_size: int) -> None:
        self.block_size = max(1, block_size)
        self.sequences: dict[str, list[int]] = {}
        self.reprefill = 0
        self._expected: dict[tuple[int, int], int] = {}  # request -> tokens it could find cached

    def prompt(self, agent: AgentSpec, stage: int, index: int, rendered: list[int]) -> list[int]:
        ctx = agent.ctx(stage, index)
        seq = self.sequences.get(ctx) if ctx is not None else None
        if not seq:
            return rendered
        resent = next((t for k, t in agent.prefix(stage, index) if k == ctx), len(seq))
        resent = min(resent, len(seq))
        # what vLLM could still hold of it: its whole blocks (the last token's KV is never computed)
        self._expected[(stage, index)] = min(resent, len(seq) - 1) // self.block_size * self.block_size
        return seq[:resent] + rendered[resent:]

    def answered(self, agent: AgentSpec, stage: int, index: int, sent: list[int], out: dict) -> None:
        choice = (out.get("choices") or [{}])[0]
        ctx = agent.ctx(stage, index)
        if ctx is not None:
            self.sequences[ctx] = sent + list(choice.get("token_ids") or [])
        expected = self._expected.pop((stage, index), 0)
        if expected:
            details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
            self.reprefill += max(0, expected - int(details.get("cached_tokens") or 0))


async def _replay(url: str, agents: list[AgentSpec], opts: LiveOptions, policy: str,
                  progress: Callable[[int], None] | None, cluster_pid: int | None = None,
                  restart: SchedulerRestart | None = None, start_at: float | None = None) -> tuple[list[dict], dict]:
    # Idle connections are dropped here before the server would close them (its keep-alive
    # is 30 s), so a request never goes out on a connection the server is closing.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        # rendered, and costed the way the server will cost them, before the clock starts
        snap0 = await _call(session, "GET", "/v1/scheduler")
        block_size = int(snap0.get("prefix_block") or 1)
        engine_block = int(snap0.get("block_size") or block_size)
        prompts = render(agents, opts.seed)
        costs = {a.id: declared_cost(a, policy, prompts[a.id], block_size) for a in agents}
        if start_at is not None:  # the clock starts then (`time.monotonic()`), not before
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        t0 = time.monotonic()
        done = 0

        async def one(a: AgentSpec) -> dict:
            nonlocal done
            out = await _run_agent(session, a, t0, opts, prompts[a.id], costs[a.id], engine_block)
            done += 1
            if progress:
                progress(done)
            return out

        tasks = [asyncio.ensure_future(one(a)) for a in agents]
        killer = None
        if opts.kill_replica_after_s is not None and cluster_pid is not None:
            killer = asyncio.ensure_future(_kill_replica_later(cluster_pid, t0, opts.kill_replica_after_s))
        restarter = None
        if restart is not None and opts.kill_scheduler_after_s is not None:
            restarter = asyncio.ensure_future(restart.kill_later(t0, opts.kill_scheduler_after_s))
        last_arrival = max((a.arrival for a in agents), default=0.0)
        await asyncio.wait(tasks, timeout=max(0.0, t0 + last_arrival + opts.hang_timeout_s - time.monotonic()))
        outs = []
        for task in tasks:
            if task.done():
                outs.append(task.result())
            else:  # it hangs: lost
                task.cancel()
                outs.append({"lost": True, "error": f"not done {opts.hang_timeout_s:.0f} s after the last arrival"})
        killed = await killer if killer is not None else None
        scheduler_killed = await restarter if restarter is not None else None
        snapshot = await _call(session, "GET", "/v1/scheduler")
        snapshot["replica_killed"] = killed
        snapshot["scheduler_killed"] = scheduler_killed
        snapshot["replay_t0"] = t0  # when the replay's clock started (`time.monotonic()`)
        async with session.get("/metrics") as r:
            snapshot["metrics_text"] = await r.text()
    return outs, snapshot


async def _kill_replica_later(cluster_pid: int, t0: float, after_s: float) -> dict | None:
    """`after_s` seconds after `t0`, SIGKILL one engine replica and its engine's processes (as a
    crashed node would lose them); what was killed, or None when no replica was found."""
    import psutil

    from server.engine.ray_cluster import engine_replicas

    await asyncio.sleep(max(0.0, t0 + after_s - time.monotonic()))
    replicas = engine_replicas(cluster_pid)
    if not replicas:
        return None
    victim = replicas[0]
    doomed = [victim, *victim.children(recursive=True)]
    for proc in doomed:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return {"pid": victim.pid, "processes": len(doomed), "at_s": time.monotonic() - t0}


def _fitted_steps(snapshot: dict) -> int:
    """Engine steps behind the time model of a `/v1/scheduler` snapshot (all engines)."""
    engines = (snapshot.get("time_model") or {}).get("engines") or {}
    return sum(int(e.get("samples") or 0) for e in engines.values())


@contextlib.contextmanager
def _off_worker_cores(server_pid: int | None) -> Iterator[None]:
    """This (client) process kept off the cores the server's engine worker is pinned to, as
    the server keeps itself (`keep_off_worker_cores`): on 2 cores, a client that the OS put
    on the worker's core slowed every engine step. Restored after, so that the next server
    this process starts may use every core."""
    from server.engine.processes import PINNING, pin_threads, worker_cores

    before = os.sched_getaffinity(0) if PINNING else set()
    others = before - worker_cores(server_pid) if server_pid and PINNING else set()
    if others and others != before:
        pin_threads(os.getpid(), others)
    try:
        yield
    finally:
        if others and others != before:
            pin_threads(os.getpid(), before)


def _serve_args(policy: str, opts: LiveOptions, home: str) -> list[str]:
    """The `justitia serve` options of a policy's server."""
    args = ["--policy", policy, "--kv-tokens", str(opts.kv_tokens),
            "--max-model-len", str(opts.max_model_len), "--data-dir", home, "--retain", opts.retain]
    if opts.profile is not None:
        args += ["--profile", opts.profile]
    if opts.las_half_life_s is not None:
        args += ["--las-half-life-s", str(opts.las_half_life_s)]
    if opts.las_head_wait_weight is not None:
        args += ["--las-head-wait-weight", str(opts.las_head_wait_weight)]
    if opts.ray:
        args += ["--ray", opts.ray_address or "local", "--replicas", str(opts.replicas)]
    return args


def run_policy(agents: list[AgentSpec], policy: str, opts: LiveOptions,
               progress: Callable[[int], None] | None = None, round_index: int | None = None) -> PolicyResult:
    """Start a server with `policy`, replay the workload, stop the server. `round_index`:
    which of `--repeat`'s rounds (its server log is named after it)."""
    from server.launcher import EmbeddedServer
    from server.runtime.metrics import metric_value

    home = tempfile.mkdtemp(prefix=f"justitia-live-{policy}-")
    log = None
    if opts.log_dir:
        name = f"server-{policy}.log" if round_index is None else f"server-{policy}-round{round_index + 1}.log"
        log = Path(opts.log_dir) / name
        log.parent.mkdir(parents=True, exist_ok=True)
    args = _serve_args(policy, opts, home)
    if opts.ray:
        # a Ray cluster and N engines: minutes on a busy machine
        opts = replace(opts, startup_timeout_s=max(opts.startup_timeout_s, RAY_STARTUP_TIMEOUT_S))
    wall0 = time.perf_counter()
    restart = bool(opts.teach) and opts.restart
    with EmbeddedServer(args, startup_timeout=opts.startup_timeout_s, log_path=log) as srv, \
            _off_worker_cores(srv.process.pid if srv.process else None):
        taught: dict | None = None  # the server's counters once taught: the run counts from there
        start_at = None
        if opts.teach:
            # Other token ids than the measured run's: what it taught is not its prefix cache.
            _, taught = asyncio.run(_replay(srv.url, opts.teach, replace(opts, seed=opts.seed + TEACH_SEED),
                                            policy, None))
            if opts.teach_lull_s is not None:
                start_at = taught["replay_t0"] + max(a.arrival for a in opts.teach) + opts.teach_lull_s
        if not restart:
            restarter = (SchedulerRestart(srv, opts.startup_timeout_s, log)
                         if opts.ray and opts.kill_scheduler_after_s is not None else None)
            try:
                outs, snap = asyncio.run(_replay(srv.url, agents, opts, policy, progress, opts.ray_pid, restarter,
                                                 start_at))
            finally:
                if restarter is not None:
                    restarter.stop()  # it attached: the engines it leaves running go next
                    delete_engines(opts.ray_address)
    if restart:  # the same data dir: the history the taught server wrote
        log = log.with_name(log.stem + "-restarted.log") if log is not None else None
        with EmbeddedServer(args, startup_timeout=opts.startup_timeout_s, log_path=log) as srv, \
                _off_worker_cores(srv.process.pid if srv.process else None):
            outs, snap = asyncio.run(_replay(srv.url, agents, opts, policy, progress, opts.ray_pid))
    rate = float(snap["rate"])
    # GPS reference at the rate the server measured, with the costs the agents really had.
    arrivals = [o["arrival"] if o.get("arrival") is not None else a.arrival for a, o in zip(agents, outs, strict=True)]
    gps = gps_finish_times(arrivals, [a.kv_cost_shared for a in agents], rate)
    results = [
        AgentResult(id=a.id, type=a.type, arrival_s=o["arrival"], finish_s=o["finish"],
                    gps_finish_s=g, delay_bound_s=float(o["final"]["delay_bound_s"]),
                    first_eta_s=float(o["first"]["eta_s"]), first_deadline_s=float(o["first"]["deadline_s"]),
                    first_eta_interval_s=_interval(o["first"].get("eta_interval_s")),
                    reprefill_tokens=int(o.get("reprefill_tokens") or 0),
                    first_tool_allowance_s=o["first"].get("tool_allowance_s"),
                    paused_s=float(o["final"].get("paused_s") or 0.0))
        for a, o, g in zip(agents, outs, gps, strict=True) if "error" not in o
    ]
    counted_before = taught if not restart else None  # a restarted server counts from zero

    def since(metric: str) -> float:
        """The metric's growth over the measured run (a taught server counted before it)."""
        now = metric_value(snap["metrics_text"], metric) or 0.0
        return now - (metric_value(counted_before["metrics_text"], metric) or 0.0) if counted_before else now

    preemptions = since("justitia_engine_preemptions")
    prompt_tokens = since("justitia_prefix_prompt_tokens")
    extra = {
        "measured_tau_s": float(snap["tau"]),
        "measured_rate": rate,
        "first_eta_s_mean": sum(o["first"]["eta_s"] for o in outs) / max(1, len(outs)),
        # The engine's fitted step-time model at the end of the run (per engine).
        "time_model": snap.get("time_model"),
        # the median of the clients' recent turnarounds between an agent's stages, as the
        # server measured them (server/scheduler/pauses.py; the simulator's `stage_turnaround_s`)
        "stage_turnaround_s": (snap.get("pauses") or {}).get("turnaround_p50_s"),
        # vLLM's prompt tokens served from its prefix cache over all prompt tokens
        "prefix_hit_rate": since("justitia_prefix_cached_tokens") / prompt_tokens if prompt_tokens else None,
        "kv_saved_total": (snap.get("kv_saved_total") or 0) - ((counted_before or {}).get("kv_saved_total") or 0),
        "taught_by": len(opts.teach) if opts.teach else 0,  # agents replayed before the run
        # from the teaching's clock start to the measured run's, on the server that was taught
        "teach_offset_s": snap["replay_t0"] - taught["replay_t0"] if taught and not restart else None,
        "restarted": restart,  # the measured run met a server restarted after the teaching
        # what the measured run's server learned again from the history when it started
        "recalled": snap.get("recalled"),
        # engine steps the server's time model had fitted when the measured run began
        "taught_steps": _fitted_steps(taught) if taught else 0,
        # what the engine computed in (a profile measured in another dtype measured another engine)
        "engine_dtype": (snap.get("engine") or {}).get("dtype"),
        # kept contexts of paused agents: the mode, touches, yields, KV token-time charged
        "retention": snap.get("retention"),
        # agents that ended with an error (a request failed), and agents that hung
        "agents_failed": sum("error" in o and not o.get("lost") for o in outs),
        "agents_lost": sum(bool(o.get("lost")) for o in outs),
        # the server's data dir, kept: its history holds every agent's requests with when each
        # was submitted, admitted and finished (benchmarks/requests_vs_sim.py reads it)
        "data_dir": home,
        "failures": [{"id": a.id, "error": o["error"], "lost": bool(o.get("lost"))}
                     for a, o in zip(agents, outs, strict=True) if "error" in o],
    }
    if opts.ray:
        extra["replicas"] = opts.replicas
        extra["replica_killed"] = snap.get("replica_killed")
        extra["scheduler_killed"] = snap.get("scheduler_killed")
    return PolicyResult(policy=policy, agents=results, preemptions=int(preemptions),
                        accounting_zero=(snap["pending_requests"] == 0 and snap["running_requests"] == 0
                                         and snap["reserved_kv"] == 0),
                        sim_wall_s=time.perf_counter() - wall0, extra=extra)


def _interval(raw: object) -> tuple[float, float] | None:
    """A record's `eta_interval_s` ([p10, p90]) as a pair; None when the server gave none."""
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        return None
    return float(raw[0]), float(raw[1])
