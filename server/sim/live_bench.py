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
counted once (`AgentSpec.kv_cost_shared`), as the simulator's oracle does.

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
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from server.scheduler import get_policy, gps_finish_times
from server.scheduler.cost import KV
from server.scheduler.policies import Justitia

from .simulator import AgentResult, PolicyResult
from .workload import AgentSpec

VOCAB_LOW, VOCAB_HIGH = 10, 700  # token ids of the tiny model's vocabulary, specials excluded


@dataclass(frozen=True)
class LiveOptions:
    kv_tokens: int
    max_model_len: int = 2048
    prediction: str = "oracle"  # oracle: register with the true cost; server: its predictor
    seed: int = 0
    startup_timeout_s: float = 300.0
    log_dir: str | None = None


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


def declared_cost(agent: AgentSpec, policy: str) -> float:
    """What an oracle agent declares: its KV cost, shared prefixes counted once under a
    prefix-aware Justitia (the simulator's oracle tells each policy the same)."""
    pol = get_policy(policy)
    if isinstance(pol, Justitia) and pol.prefix_aware and pol.cost_model == KV:
        return agent.kv_cost_shared
    return agent.kv_cost


async def _call(session: aiohttp.ClientSession, method: str, path: str, **kw) -> dict:
    async with session.request(method, path, **kw) as r:
        body = await r.text()
        if r.status >= 400:
            raise RuntimeError(f"{method} {path} failed with {r.status}: {body}")
        return json.loads(body) if body else {}


async def _run_agent(session: aiohttp.ClientSession, agent: AgentSpec, t0: float,
                     opts: LiveOptions, policy: str, prefixes: PrefixTokens) -> dict:
    await asyncio.sleep(max(0.0, t0 + agent.arrival - time.monotonic()))
    arrival = time.monotonic() - t0
    body: dict[str, Any] = {
        "type": agent.type,
        "prompt": agent.prompt or agent.type,
        # The agent's structure lets the server state a bound that covers its critical path.
        "metadata": {"stages": len(agent.stages),
                     "critical_path_tokens": agent.critical_path_tokens,
                     "workload_id": agent.id},
    }
    if opts.prediction == "oracle":
        body["predicted_cost"] = declared_cost(agent, policy)
    first = await _call(session, "POST", "/v1/agents", json=body)
    agent_id = first["id"]
    headers = {"X-Justitia-Agent": agent_id}
    for s, stage in enumerate(agent.stages):
        await asyncio.gather(*(
            _call(session, "POST", "/v1/completions", headers=headers, json={
                "prompt": _prompt(agent, s, i, p, opts.seed, prefixes), "max_tokens": d,
                "ignore_eos": True, "temperature": 0.0,
            })
            for i, (p, d) in enumerate(stage)
        ))
    final = await _call(session, "POST", f"/v1/agents/{agent_id}/finish")
    return {"arrival": arrival, "finish": time.monotonic() - t0, "first": first, "final": final}


async def _replay(url: str, agents: list[AgentSpec], opts: LiveOptions, policy: str,
                  progress: Callable[[int], None] | None) -> tuple[list[dict], dict]:
    # Idle connections are dropped here before the server would close them (its keep-alive
    # is 30 s), so a request never goes out on a connection the server is closing.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        done = 0
        prefixes = PrefixTokens(opts.seed)

        async def one(a: AgentSpec) -> dict:
            nonlocal done
            out = await _run_agent(session, a, t0, opts, policy, prefixes)
            done += 1
            if progress:
                progress(done)
            return out

        outs = await asyncio.gather(*(one(a) for a in agents))
        snapshot = await _call(session, "GET", "/v1/scheduler")
        async with session.get("/metrics") as r:
            snapshot["metrics_text"] = await r.text()
    return outs, snapshot


def run_policy(agents: list[AgentSpec], policy: str, opts: LiveOptions,
               progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Start a server with `policy`, replay the workload, stop the server."""
    from server.launcher import EmbeddedServer
    from server.metrics import metric_value

    home = tempfile.mkdtemp(prefix=f"justitia-live-{policy}-")
    log = Path(opts.log_dir) / f"server-{policy}.log" if opts.log_dir else None
    args = ["--policy", policy, "--kv-tokens", str(opts.kv_tokens),
            "--max-model-len", str(opts.max_model_len), "--data-dir", home]
    wall0 = time.perf_counter()
    with EmbeddedServer(args, startup_timeout=opts.startup_timeout_s, log_path=log) as srv:
        outs, snap = asyncio.run(_replay(srv.url, agents, opts, policy, progress))
    rate = float(snap["rate"])
    # GPS reference at the rate the server measured, with the costs the agents really had.
    gps = gps_finish_times([o["arrival"] for o in outs], [a.kv_cost_shared for a in agents], rate)
    results = [
        AgentResult(id=a.id, type=a.type, arrival_s=o["arrival"], finish_s=o["finish"],
                    gps_finish_s=g, delay_bound_s=float(o["final"]["delay_bound_s"]),
                    first_eta_s=float(o["first"]["eta_s"]), first_deadline_s=float(o["first"]["deadline_s"]))
        for a, o, g in zip(agents, outs, gps, strict=True)
    ]
    preemptions = metric_value(snap["metrics_text"], "justitia_engine_preemptions") or 0
    extra = {
        "measured_tau_s": float(snap["tau"]),
        "measured_rate": rate,
        "first_eta_s_mean": sum(o["first"]["eta_s"] for o in outs) / max(1, len(outs)),
        # The engine's fitted step-time model at the end of the run (per engine).
        "time_model": snap.get("time_model"),
        # vLLM's prompt tokens served from its prefix cache over all prompt tokens
        "prefix_hit_rate": snap.get("prefix_hit_rate"),
        "kv_saved_total": snap.get("kv_saved_total"),
    }
    return PolicyResult(policy=policy, agents=results, preemptions=int(preemptions),
                        accounting_zero=(snap["pending_requests"] == 0 and snap["running_requests"] == 0
                                         and snap["reserved_kv"] == 0),
                        sim_wall_s=time.perf_counter() - wall0, extra=extra)
