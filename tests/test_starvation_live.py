"""Starvation freedom on the real engine: while one tenant streams small agents near the
engine's rate, in surges above it that leave a backlog of queued agents, another tenant's
large agent finishes by the firm deadline it was given at registration, and the stream goes
on meanwhile.

The server is its own (two API keys, one per tenant; the engine tier's 4,096 KV tokens).
Requests use `ignore_eos`, so output lengths are exact and the declared costs are the true
ones (as `bench live`'s oracle). The deadline is the one of the registration's answer, as it
was given: nothing in the test scales it. Bounded: the stream runs until the large agent is
done, at most STREAM_LIMIT_S; the numbers are printed (run with -s) for docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest

from server.scheduler import kv_cost
from tests.conftest import serve_with_keys

KEYS = {"stream": "key-stream", "big": "key-big"}
# The stream offers SHARE of the engine's pessimistic rate (M / bound_tau, the rate a firm
# deadline assumes; the server measures it and the stream re-reads it every second), in
# cycles of CYCLE_S seconds: SURGE x that rate for the first SURGE_S (above what the engine
# serves, bound_tau / tau being 1.1-1.4 here: small agents queue up behind each other), the
# rest of the cycle what keeps the mean at SHARE. A mean below 0.9 of the pessimistic rate
# is what a firm promise allows (a fixed 10 agents a second was 65% of it on some hosts and
# 163% on one 1.7x slower, where no finite promise holds).
SHARE = 0.8
SURGE = 1.6
CYCLE_S = 5.0
SURGE_S = 2.0
SMALL = [(300, 80)] * 3  # one stage of three requests
LARGE = [[(300, 120)] * 4 for _ in range(2)]  # two stages of four requests: 4.2 small agents' work
# The large agent comes with a surge, once the arrivals have been measured for longer than
# its deadline looks ahead (a promise made on less history is widened: the start of a burst
# looks like a light load). How far that is depends on the engine's speed, which moves 3x
# with what else the machine runs: the test estimates it from the server's figures (the
# agent's fair time alone, doubled for the stream's agents beside it, over the share of the
# rate the arrivals leave) and waits for it, at least MIN_LARGE_AT_S and at most
# MAX_LARGE_AT_S.
MIN_LARGE_AT_S = 4 * CYCLE_S
MAX_LARGE_AT_S = 40 * CYCLE_S
STREAM_LIMIT_S = MAX_LARGE_AT_S + 150.0
DRAIN_S = 60.0  # after the large agent, the small ones still queued get this long, then go


@pytest.fixture(scope="module")
def two_tenant_server(tmp_path_factory: pytest.TempPathFactory):
    home = str(tmp_path_factory.mktemp("starvation-home"))
    # a start-up of its own on a shared machine: allow it the engine tier's worst (15 min)
    yield from serve_with_keys(["--kv-tokens", "4096", "--max-model-len", "2048"], KEYS, home,
                               startup_timeout=900.0)


def _prompt(rng: random.Random, p: int) -> list[int]:
    # distinct token ids: identical prompts would share KV blocks through the prefix cache
    return [rng.randrange(10, 700) for _ in range(p)]


async def _run(session: aiohttp.ClientSession, tenant: str, stages: list[list[tuple[int, int]]],
               rng: random.Random, type_: str) -> dict:
    auth = {"Authorization": f"Bearer {KEYS[tenant]}"}
    cost = sum(kv_cost(p, d) for st in stages for p, d in st)
    body = {"type": type_, "prompt": type_, "predicted_cost": cost,
            "metadata": {"stages": len(stages), "critical_path_tokens": sum(max(d for _, d in st) for st in stages)}}
    t0 = time.monotonic()
    async with session.post("/v1/agents", json=body, headers=auth) as r:
        assert r.status == 201, await r.text()
        first = await r.json()
    headers = {**auth, "X-Justitia-Agent": first["id"]}
    stage_times = []
    for stage in stages:
        async def one(p: int, d: int) -> None:
            payload = {"prompt": _prompt(rng, p), "max_tokens": d, "ignore_eos": True, "temperature": 0.0}
            async with session.post("/v1/completions", json=payload, headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
        begun = time.monotonic() - t0
        await asyncio.gather(*(one(p, d) for p, d in stage))
        stage_times.append((round(begun, 2), round(time.monotonic() - t0, 2)))
    async with session.post(f"/v1/agents/{first['id']}/finish", headers=auth) as r:
        assert r.status == 200, await r.text()
        last = await r.json()
    return {"first": first, "last": last, "jct_s": time.monotonic() - t0, "stages": stage_times}


async def _snapshot(session: aiohttp.ClientSession) -> dict:
    async with session.get("/v1/scheduler", headers={"Authorization": f"Bearer {KEYS['big']}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _speed(snap: dict) -> dict:
    keys = ("now", "tau", "bound_tau", "bound_iteration_s", "rate", "arrival_promise_rate",
            "arrival_history_s", "queued_agents", "pending_requests", "agents", "promise")
    return {k: snap[k] for k in keys}


async def _scenario(url: str) -> dict:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10)
    async with aiohttp.ClientSession(url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        rng = random.Random(7)
        big_done = asyncio.Event()
        big_due = asyncio.Event()
        small: list[asyncio.Task] = []
        t0 = time.monotonic()
        cost = sum(kv_cost(p, d) for p, d in SMALL)
        large_cost = sum(kv_cost(p, d) for st in LARGE for p, d in st)
        pessimistic = [0.0]  # cost units a second at M / bound_tau, re-read every half second
        queued: list[tuple[float, int, int]] = []  # (t, agents queued, requests pending) while the large one runs
        waited_for: list[float] = []  # the history the large agent waited for

        def factor(t: float) -> float:
            """The stream's rate at t seconds, as a multiple of the pessimistic rate."""
            calm = (SHARE * CYCLE_S - SURGE * SURGE_S) / (CYCLE_S - SURGE_S)
            return SURGE if t % CYCLE_S < SURGE_S else calm

        async def stream() -> None:
            # work credited continuously at the current rate; an agent each time it covers one
            credit, last, tick = cost, t0, 0.02
            while not big_done.is_set() and time.monotonic() - t0 < STREAM_LIMIT_S:
                now = time.monotonic()
                credit += factor(now - t0) * pessimistic[0] * (now - last)
                last = now
                while credit >= cost:
                    credit -= cost
                    small.append(asyncio.create_task(_run(session, "stream", [SMALL], rng, "small")))
                await asyncio.sleep(tick)

        async def pace() -> None:
            while not big_done.is_set():
                snap = await _snapshot(session)
                slow = snap["bound_tau"] / snap["tau"]
                pessimistic[0] = snap["rate"] / slow
                t = time.monotonic() - t0
                if big_due.is_set():
                    queued.append((snap["now"], snap["queued_agents"], snap["pending_requests"]))
                elif t >= MIN_LARGE_AT_S and (t % CYCLE_S) > CYCLE_S - 0.6 and snap["promise"] == "firm":
                    # due at the next surge if the history covers what the deadline will look ahead
                    share = min(0.9, snap["arrival_promise_rate"] / pessimistic[0])
                    horizon = 2.0 * large_cost / snap["rate"] / (1.0 - share) * slow
                    if (snap["arrival_history_s"] or 0.0) >= 1.2 * horizon + CYCLE_S or t >= MAX_LARGE_AT_S:
                        waited_for.append(1.2 * horizon)
                        big_due.set()
                await asyncio.sleep(0.5)

        async def large() -> dict:
            await big_due.wait()
            await asyncio.sleep(max(0.0, CYCLE_S - (time.monotonic() - t0) % CYCLE_S))  # a surge begins
            try:
                at_registration = _speed(await _snapshot(session))
                run = await _run(session, "big", LARGE, rng, "large")
                return {**run, "speed": at_registration, "speed_after": _speed(await _snapshot(session))}
            finally:
                big_done.set()

        streaming = asyncio.create_task(stream())
        pacing = asyncio.create_task(pace())
        big = await large()
        await streaming
        await pacing
        stream_s = time.monotonic() - t0
        during = list(small)  # every small agent registered while the stream ran
        finished, unfinished = await asyncio.wait(during, timeout=DRAIN_S)
        for task in unfinished:  # bounded: whatever is still queued is abandoned
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        results = [t.result() for t in finished if t.exception() is None]
    first = big["first"]
    return {
        "large_jct_s": big["jct_s"],
        "large_first_deadline_s": first["deadline_s"],
        "large_first_eta_s": first["eta_s"],
        "large_promise": first["promise"],
        "large_promise_reason": first["promise_reason"],
        "large_first_bound_s": first["delay_bound_s"],
        "large_first_fair_finish_s": first["fair_finish_s"],
        "large_first_bound": first["delay_bound_terms"],
        "large_stages_s": big["stages"],  # (sent, done) of each stage, from registration
        "large_charged_over_declared": big["last"]["charged_cost"] / first["predicted_cost"],
        "small_agents": len(during),
        "small_per_s": len(during) / stream_s,
        "small_finished": len(results),
        "small_mean_jct_s": sum(r["jct_s"] for r in results) / max(1, len(results)),
        "small_max_jct_s": max((r["jct_s"] for r in results), default=0.0),
        # the backlog while the large agent ran: small agents the scheduler held queued
        "max_queued_agents": max((q for _, q, _ in queued), default=0),
        "max_pending_requests": max((p for _, _, p in queued), default=0),
        "samples_with_queue": sum(q >= 2 for _, q, _ in queued),
        "samples": len(queued),
        "history_waited_for_s": waited_for[0] if waited_for else None,
        "stream_s": stream_s,
        "at_registration": big["speed"],
        "at_end": big["speed_after"],
    }


@pytest.mark.engine
def test_large_agent_keeps_its_firm_promise_behind_a_surging_stream(two_tenant_server) -> None:
    """A stream of another tenant's small agents near the engine's rate, surging above it,
    does not starve a large agent: it finishes while the stream goes on, by the firm deadline
    of its registration. The surges leave small agents queued while it runs, so the
    scheduler arbitrates a backlog rather than an idle engine."""
    out = asyncio.run(_scenario(two_tenant_server.url))
    print("\nstarvation live:", json.dumps(out, indent=1))
    # what the promise was given on: measured arrivals under 90% of the pessimistic rate,
    # over longer than the deadline looks ahead, and a measured engine
    assert out["large_promise"] == "firm", out
    assert out["large_jct_s"] < out["stream_s"], out  # done while the stream still ran
    assert out["small_per_s"] >= 0.5 * SHARE * out["at_registration"]["rate"] * out["at_registration"]["tau"] \
        / out["at_registration"]["bound_tau"] / sum(kv_cost(p, d) for p, d in SMALL), out  # the stream went on
    assert out["max_queued_agents"] >= 3, out  # a backlog of small agents while it ran
    assert out["large_jct_s"] <= out["large_first_deadline_s"], out
