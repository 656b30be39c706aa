"""Kept contexts on the live server (server/runtime/retain.py), in front of the fake engine:
a paused agent's context is charged in the KV ledger while the rule keeps it, touched when
admitted work could reach it in the engine's LRU, given up for an agent ahead in the fair
order, let go when the agent comes back or the rule stops keeping it, and charged to the
agent. Whether it really stays resident in vLLM is measured live (docs/retention.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from server.engine.base import SamplingOptions
from server.runtime.agents import AgentEntry
from server.runtime.live import LiveConfig, LiveScheduler
from server.scheduler.retention import HORIZON_SCALE, break_even_pause_s
from tests.support.fake_engine import FakeEngine

BLOCK = 32


def run(body: Callable[[LiveScheduler, FakeEngine], Awaitable[Any]], **config: Any) -> Any:
    async def main() -> Any:
        engine = FakeEngine(kv_capacity_tokens=4096, block_size=BLOCK)
        await engine.start()
        live = LiveScheduler(engine, LiveConfig(**config))
        try:
            return await asyncio.wait_for(body(live, engine), 30)
        finally:
            await live.close()
            await engine.close()

    return asyncio.run(main())


async def request(live: LiveScheduler, e: AgentEntry, rid: str, prompt: tuple[int, ...], tokens: int = 4) -> None:
    async for _ in live.run(e, rid, prompt, SamplingOptions(max_tokens=tokens, ignore_eos=True)):
        pass


def ctx(n: int, start: int = 10) -> tuple[int, ...]:
    """n token ids of the fake engine's vocabulary, a different sequence for each start."""
    return tuple(3 + (start * 7 + i) % 500 for i in range(n))


def test_always_keeps_a_paused_context_charged_until_the_agent_comes_back() -> None:
    async def body(live: LiveScheduler, engine: FakeEngine) -> tuple[dict, int, dict, float, float]:
        a = live.register("react", "p", "x", predicted_cost=1e5)
        await request(live, a, "r1", ctx(300))
        assert a.state == "paused"
        kept = live.snapshot()["retention"]
        pinned = live.dispatcher.ledger.pinned_kv
        before = live.dispatcher.agents[a.id].consumed_cost
        await asyncio.sleep(0.2)
        await request(live, a, "r2", ctx(340))  # resends its conversation, a turn longer
        after = live.snapshot()["retention"]
        return kept, pinned, after, before, live.dispatcher.agents[a.id].consumed_cost

    kept, pinned, after, before, consumed = run(body, retain="always")
    assert kept["retain"] == "always" and kept["kept_contexts"] == 1
    assert pinned == kept["kept_kv"] == 320  # 300 prompt + 4 generated, less the last, in whole blocks
    # at its return the context is let go and its 0.2 s or more of holding charged to it;
    # its new, longer one is kept in its place
    assert after["kept_kv"] == 352 and after["retained_kv_token_s"] >= 320 * 0.2
    assert consumed - before >= 320 * 0.2


def test_a_kept_context_gives_way_to_an_agent_ahead_and_is_touched_as_work_is_admitted() -> None:
    async def body(live: LiveScheduler, engine: FakeEngine) -> tuple[dict, list, dict, bool]:
        a = live.register("react", "p", "x", predicted_cost=5e6)  # far behind in the fair order
        await request(live, a, "r1", ctx(1500))
        # other work admitted into the free memory reaches the blocks ahead of the context:
        # the context is touched (a one-token request of its own tokens) and stays charged
        b = live.register("other", "p", "x", predicted_cost=1e5)  # ahead of a
        for i in range(6):
            await request(live, b, f"b{i}", ctx(900, start=100 + i), tokens=8)
        touched = [r for r in engine.requests if r.request_id.startswith("touch-")]
        mid = live.snapshot()["retention"]
        # an agent ahead of it whose request needs the memory: the context gives way
        c = live.register("small", "p", "x", predicted_cost=1e3)
        await request(live, c, "c1", ctx(2030, start=200), tokens=8)
        await request(live, c, "c2", ctx(2030, start=201), tokens=8)
        return mid, touched, live.snapshot()["retention"], a.id in live.retention.kept

    mid, touched, end, a_kept = run(body, retain="always")
    assert mid["kept_contexts"] == 2  # a's and b's
    assert touched and all(r.sampling.max_tokens == 1 for r in touched)
    assert any(r.prompt_token_ids == ctx(1500)[:len(r.prompt_token_ids)] for r in touched)
    assert end["retention_yields"] >= 1 and not a_kept  # the furthest behind went first


def test_auto_lets_a_context_go_once_its_pause_outlasts_the_break_even() -> None:
    async def body(live: LiveScheduler, engine: FakeEngine) -> tuple[dict, dict, dict]:
        for _ in range(5):  # the type's pauses are short against M x c (0.079 s here): keep
            live.dispatcher.pauses.observe("react", 0.04)
        a = live.register("react", "p", "x", predicted_cost=1e5)
        await request(live, a, "r1", ctx(300))
        kept = live.snapshot()["retention"]
        await asyncio.sleep(0.3)  # far past M x c on this engine (well under 0.1 s)
        expired = live.snapshot()["retention"]
        for _ in range(20):
            live.dispatcher.pauses.observe("slow", 30.0)
        s = live.register("slow", "p", "x", predicted_cost=1e5)
        await request(live, s, "s1", ctx(300, start=50))
        return kept, expired, live.snapshot()["retention"]

    kept, expired, slow = run(body, retain="auto")
    assert kept["kept_contexts"] == 1
    assert expired["kept_contexts"] == 0 and expired["kept_kv"] == 0
    assert 0 < expired["retained_kv_token_s"] <= 320 * 0.04 + 1e-6  # charged up to the rule's end only
    assert slow["kept_contexts"] == 0  # its type pauses for 30 s: not worth keeping at all


def test_a_declared_tool_call_decides_and_an_ended_agent_keeps_nothing() -> None:
    async def body(live: LiveScheduler, engine: FakeEngine) -> tuple[int, int, int]:
        for _ in range(20):
            live.dispatcher.pauses.observe("react", 30.0)
        a = live.register("react", "p", "x", predicted_cost=1e5)
        await request(live, a, "r1", ctx(300))
        not_kept = live.dispatcher.ledger.pinned_kv
        b = live.register("react", "p", "x", predicted_cost=1e5)
        await request(live, b, "r2", ctx(300, start=60))
        live.tool_call(b, "lookup", 0.0)  # says its tool answers at once
        kept = live.dispatcher.ledger.pinned_kv
        await live.finish(b)
        return not_kept, kept, live.dispatcher.ledger.pinned_kv

    not_kept, kept, ended = run(body, retain="auto")
    assert not_kept == 0  # its type pauses for 30 s
    assert kept == 320  # but this call is declared instant: kept from the announcement on
    assert ended == 0


@pytest.mark.parametrize("config", [{"retain": "never"}, {"policy": "justitia-noretain"}, {"policy": "vtc"}])
def test_never_and_policies_that_keep_nothing_keep_nothing(config: dict) -> None:
    async def body(live: LiveScheduler, engine: FakeEngine) -> dict:
        a = live.register("react", "p", "x", predicted_cost=1e5)
        await request(live, a, "r1", ctx(300))
        assert a.state == "paused"
        return live.snapshot()["retention"]

    summary = run(body, **config)
    assert summary["retain"] == "never" and summary["kept_contexts"] == 0 and summary["touches"] == 0


def test_a_type_whose_agents_end_after_their_request_is_kept_ever_shorter() -> None:
    """An agent that finishes after a pause resent nothing of what it left: counted as such,
    a type of one-request agents (a client splitting its work into an agent per request)
    soon has its contexts kept for a sliver of the break-even between request and finish,
    not for all of it."""

    async def body(live: LiveScheduler, engine: FakeEngine) -> list[float]:
        held = []
        for i in range(12):
            a = live.register("flood", "p", "x", predicted_cost=1e5)
            await request(live, a, f"f{i}", ctx(300, start=20 + i))
            kept = live.retention.kept[a.id]
            # in break-even pauses of the moment (c is refitted as the engine's steps are seen)
            held.append((kept.until - kept.since)
                        / break_even_pause_s(live.dispatcher.kv_capacity, live.retention.prefill_token_s()))
            await live.finish(a)
        return held

    held = run(body, retain="auto")
    # nothing known of the type at first: kept for the whole horizon; after 11 agents that
    # never resent, for about a twelfth of it
    assert held[0] == pytest.approx(HORIZON_SCALE, rel=0.2)
    assert held[-1] <= held[0] / 9
