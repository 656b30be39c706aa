"""Starvation freedom on the real engine: while one tenant streams small agents
(about 10 a second), another tenant's large agent finishes by the deadline it was given at
registration, and the stream goes on meanwhile.

The server is its own (two API keys, one per tenant; the engine tier's 4,096 KV tokens).
Requests use `ignore_eos`, so output lengths are exact and the declared costs are the true
ones (as `bench live`'s oracle). Bounded: the stream runs until the large agent is done, at
most STREAM_LIMIT_S; the numbers are printed (run with -s) for docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest

from server.scheduler import kv_cost
from tests.support.servers import embedded_server

KEYS = {"stream": "key-stream", "big": "key-big"}
STREAM_EVERY_S = 0.1  # ~10 small agents a second, at most
# The stream offers this share of the engine's pessimistic rate (M / bound_tau), measured by
# the server while the stream starts, because hosts of this kind differ: a fixed 10 a second
# is 65% of one host's rate and 163% of another's (an engine 1.7x slower), an overload under
# which no deadline holds (the promise says so).
STREAM_SHARE = {"two_thirds": 0.65, "near_rate": 0.9}
STREAM_LIMIT_S = 90.0
# Small agents: one stage of three requests (prompt, output), sent often enough to offer
# STREAM_SHARE of the engine's rate: at 65% the promise is firm, at 90% it may be widened
# (work arrives near the rate). Either way the small agents queue up behind each other and
# the large one must get its fair share all the same.
SMALLS = {"two_thirds": [(300, 64)] * 3, "near_rate": [(300, 80)] * 3}
LARGE = [[(300, 120)] * 6 for _ in range(3)]  # three stages of six requests
LARGE_AT_S = 5.0  # the stream is under way and the engine's rate measured
DRAIN_S = 60.0  # after the large agent, the small ones still queued get this long, then go


@pytest.fixture(scope="module")
def two_tenant_server(tmp_path_factory: pytest.TempPathFactory):
    home = str(tmp_path_factory.mktemp("starvation-home"))
    with embedded_server(["--kv-tokens", "4096", "--max-model-len", "2048"], KEYS, home) as srv:
        yield srv


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
    return {"first": first, "last": last, "jct_s": time.monotonic() - t0, "registered": t0,
            "stages": stage_times}


async def _scenario(url: str, small_agent: list[tuple[int, int]], share: float) -> dict:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10)
    async with aiohttp.ClientSession(url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        rng = random.Random(7)
        big_done = asyncio.Event()
        small: list[asyncio.Task] = []
        t0 = time.monotonic()
        every = [STREAM_EVERY_S]  # the stream's interval, set to the engine's rate below
        cost = sum(kv_cost(p, d) for p, d in small_agent)

        async def stream() -> None:
            next_at = t0
            while not big_done.is_set() and time.monotonic() - t0 < STREAM_LIMIT_S:
                small.append(asyncio.create_task(_run(session, "stream", [small_agent], rng, "small")))
                next_at += every[0]
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        async def pace() -> None:
            # once a second until the large agent comes: the interval that offers `share` of
            # the rate the server measures (its pessimistic one, as the promise counts it)
            for _ in range(int(LARGE_AT_S) - 1):
                await asyncio.sleep(1.0)
                snap = await _engine_speed(session)
                pessimistic = snap["rate"] * snap["tau"] / snap["bound_tau"]
                every[0] = max(STREAM_EVERY_S, cost / (share * pessimistic))

        async def large() -> dict:
            await asyncio.sleep(max(0.0, t0 + LARGE_AT_S - time.monotonic()))
            try:
                at_registration = await _engine_speed(session)
                run = await _run(session, "big", LARGE, rng, "large")
                # the engine's speed over the large agent's run (not over the drain below)
                return {**run, "speed": at_registration, "speed_after": await _engine_speed(session)}
            finally:
                big_done.set()

        streaming = asyncio.create_task(stream())
        await pace()
        big = await large()
        await streaming
        started_during = len(small)  # small agents registered while the large one ran
        finished, unfinished = await asyncio.wait(small, timeout=DRAIN_S)
        for task in unfinished:  # bounded: the backlog of an overloaded stream is abandoned
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        results = [t.result() for t in finished if t.exception() is None]
    speed = big["speed_after"]
    stream_s = big["jct_s"] + LARGE_AT_S
    # How much slower the engine ran by the end than when the promise was made (the
    # slowest sustained stretch, as measured by the server): the machine is shared.
    slowdown = max(1.0, speed["bound_tau"] / big["speed"]["bound_tau"],
                   speed["bound_iteration_s"] / big["speed"]["bound_iteration_s"])
    return {
        "large_jct_s": big["jct_s"],
        "large_first_deadline_s": big["first"]["deadline_s"],
        "large_first_eta_s": big["first"]["eta_s"],
        "large_promise": big["first"]["promise"],
        "large_promise_reason": big["first"]["promise_reason"],
        "stream_interval_s": every[0],
        "small_agents": started_during,
        "small_per_s": started_during / stream_s,
        "small_finished": len(results),
        "small_mean_jct_s": sum(r["jct_s"] for r in results) / max(1, len(results)),
        "large_first_bound_s": big["first"]["delay_bound_s"],
        "large_first_fair_finish_s": big["first"]["fair_finish_s"],
        "large_first_bound": big["first"]["delay_bound_terms"],
        "large_stages_s": big["stages"],  # (sent, done) of each stage, from registration
        # charged more than declared: an over-run moves its virtual finish (and deadline)
        "large_charged_over_declared": big["last"]["charged_cost"] / big["first"]["predicted_cost"],
        "at_registration": big["speed"],
        "at_end": speed,
        "engine_slowdown": slowdown,
    }


async def _engine_speed(session: aiohttp.ClientSession) -> dict[str, float]:
    async with session.get("/v1/scheduler", headers={"Authorization": f"Bearer {KEYS['big']}"}) as r:
        snap = await r.json()
    keys = ("now", "tau", "bound_tau", "bound_iteration_s", "rate", "arrival_promise_rate",
            "arrival_history_s", "etas_refreshed_at", "backlog", "agents")
    return {k: snap[k] for k in keys}


@pytest.mark.engine
@pytest.mark.parametrize("load", ["two_thirds"])  # near_rate: a benchmark figure only
def test_large_agent_is_not_starved_by_another_tenants_stream(two_tenant_server, load: str) -> None:
    """The large agent finishes while the stream goes on (it is not left waiting behind
    it), by the deadline it was given at registration.

    The server runs in the test's session (`EmbeddedServer`): in a session of its own, the
    kernel's autogroup scheduler starves this test's client for seconds while the engine
    generates, so the stream's and the large agent's requests are sent late (small agents
    taking 0.4-3.3 s instead of 0.2 s) and the promise breaks for the client's sake. The
    deadline assumes the engine keeps the speed
    measured when it was made, so it is scaled by how much slower the server measured the
    engine at the end than at registration (1.0 on a steady machine)."""
    out = asyncio.run(_scenario(two_tenant_server.url, SMALLS[load], STREAM_SHARE[load]))
    out["load"] = load
    print("\nstarvation live:", json.dumps(out, indent=1))
    assert out["large_jct_s"] < STREAM_LIMIT_S, out  # done while the stream still ran
    assert out["small_per_s"] >= 0.5 / out["stream_interval_s"], out  # the stream went on
    assert out["large_jct_s"] <= out["large_first_deadline_s"] * out["engine_slowdown"], out
