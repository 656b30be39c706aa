"""Retention of paused agents' contexts: the rule (server/scheduler/retention.py), the
engine model's LRU prefix cache with conversations and pins, `ctx` in workloads, and the
simulator end to end. Fast tier: no engine."""

from __future__ import annotations

import json
import math
import random

import pytest

from server.scheduler import Dispatcher, RequestSpec, retention
from server.scheduler.pauses import PauseStats
from server.scheduler.prefix import segments
from server.scheduler.retention import (
    HORIZON_SCALE,
    OWN,
    SHARED,
    Pin,
    Retention,
    break_even_pause_s,
    charge_retained,
    expected_remaining_s,
    keep_until_s,
    pins_to_release,
)
from server.shared.profiles import get_profile
from server.sim.engine import EngineModel, SimRequest
from server.sim.retain import SimRetention
from server.sim.simulator import run_comparison, simulate
from server.sim.talk import AGENTIC, make_agentic_mix, make_talk_mix
from server.sim.workload import AgentSpec, WorkloadError, parse_agent


# -- the rule ------------------------------------------------------------------------------
def test_break_even_is_memory_times_prefill_cost() -> None:
    assert break_even_pause_s(45_000, 0.00009) == pytest.approx(4.05)
    assert break_even_pause_s(4096, 0.0000193) == pytest.approx(0.079, abs=1e-3)


def test_expected_remaining_pause_grows_for_a_heavy_tail() -> None:
    seen = [0.5] * 8 + [10.0, 20.0]
    assert expected_remaining_s(seen, 0.0) == pytest.approx(sum(seen) / 10)
    assert expected_remaining_s(seen, 1.0) == pytest.approx(14.0)  # past the short ones: the long are left
    assert expected_remaining_s(seen, 25.0) == math.inf


def test_keep_until_is_where_the_expected_rest_reaches_the_horizon() -> None:
    seen = [0.5] * 8 + [10.0, 20.0]
    # mean 3.4 < 4: kept at first; past 0.5 s the rest is expected to last 14 s: let go
    assert keep_until_s(seen, 4.0) == pytest.approx(0.5)
    assert keep_until_s(seen, 3.0) == 0.0  # mean 3.4 >= 3: not kept at all
    assert keep_until_s(seen, 100.0) == pytest.approx(20.0)  # past every pause seen
    assert keep_until_s([], 2.0) == 2.0  # nothing seen: the horizon itself
    assert keep_until_s(seen, 0.0) == 0.0


def test_modes_and_resend_rate() -> None:
    pauses = PauseStats()
    for x in (0.2, 0.3, 0.4):
        pauses.observe("chat", x)
    auto = Retention("auto", pauses)
    assert auto.keep_until("chat", 10.0, 45_000, 0.00009) == pytest.approx(10.4)  # past all seen
    assert Retention("never", pauses).keep_until("chat", 10.0, 45_000, 0.00009) == 10.0
    assert Retention("always", pauses).keep_until("chat", 10.0, 45_000, 0.00009) == math.inf
    # a type whose contexts are never resent stops being kept
    for _ in range(20):
        auto.reuse.observe("map", 0, 1000)
    assert auto.horizon_s("map", 45_000, 0.00009) < 0.05 * auto.horizon_s("chat", 45_000, 0.00009)
    with pytest.raises(ValueError, match="retain must be one of"):
        Retention("sometimes", pauses)


def test_each_part_of_a_context_has_its_own_resend_rate() -> None:
    pauses = PauseStats()
    auto = Retention("auto", pauses)
    for _ in range(20):  # a vote resends the question its samples shared, none of the samples
        auto.reuse.observe("vote", 600, 600, SHARED)
        auto.reuse.observe("vote", 0, 3000, OWN)
    assert auto.reuse.rate("vote", SHARED) == pytest.approx(1.0)
    assert auto.reuse.rate("vote", OWN) < 0.05
    assert auto.reuse.rate("vote") == 1.0  # the whole context: nothing seen of it, the prior
    assert auto.horizon_s("vote", 45_000, 0.00009, SHARED) == pytest.approx(HORIZON_SCALE * 4.05)
    # nothing seen of its pauses: kept for the horizon of its share (the prior among 20 none)
    assert auto.keep_until("vote", 3.0, 45_000, 0.00009, OWN) == pytest.approx(3.0 + HORIZON_SCALE * 4.05 / 21)


def test_a_retention_charge_moves_a_late_agent_by_its_cost_in_iterations() -> None:
    """Kept memory is charged as if the agent were running: tokens x seconds, counted in
    engine iterations of tau, from where its tag stands. An agent GPS would have finished
    already keeps its lead over one arriving now."""
    d = Dispatcher("justitia", 8000, 0.025)
    for a, cost in (("late", 1000.0), ("big", 1e6)):
        d.register_agent(a, cost, 0.0)
        d.submit(RequestSpec(f"{a}/0", a, 10, 10, 10), 0.0)
    late = d.agents["late"]
    tag, charged = late.virtual_finish, late.charged_cost
    d.clock.advance(1.0)
    assert d.clock.V > tag
    charge_retained(d, "late", 80.0, 1.0)  # 80 token-seconds = 3,200 token-iterations
    assert late.charged_cost - charged == pytest.approx(3200.0)
    assert late.virtual_finish == pytest.approx(tag + 3200.0) and late.virtual_finish < d.clock.V
    d.register_agent("new", 10.0, 1.0)
    d.submit(RequestSpec("new/0", "new", 1, 1, 1), 1.0)
    assert [s.agent_id for s in d.admit(1.0, 8000, 10)] == ["late", "new", "big"]
    charge_retained(d, "late", 0.0, 1.0)  # nothing held, nothing moves
    assert late.virtual_finish == pytest.approx(tag + 3200.0)


def test_pins_yield_to_agents_ahead_furthest_behind_first() -> None:
    pins = [Pin("a", 500, 1.0), Pin("b", 300, 5.0), Pin("c", 400, 9.0)]
    assert pins_to_release(pins, 2.0, 600, 100) == ["c", "b"]  # behind the head: c then b
    assert pins_to_release(pins, 2.0, 100, 100) == []  # it fits: nobody yields
    assert pins_to_release(pins, 6.0, 2000, 100) == []  # releasing all behind would not do
    assert pins_to_release(pins, 0.5, 500, 100) == ["c"]


def test_a_pin_yields_only_once_the_agent_ahead_waited_as_long_as_its_prefill() -> None:
    pins = [Pin("a", 500, 1.0), Pin("b", 300, 5.0), Pin("c", 4000, 9.0)]
    c = 0.0001  # s per prefilled token: b's context costs 0.03 s again, c's 0.4 s
    w = retention.YIELD_WAIT
    assert pins_to_release(pins, 2.0, 400, 100, waited_s=0.0, prefill_token_s=c) == []
    # b's prefill is short: it gives way first; c's, ten times longer, only after a longer wait
    assert pins_to_release(pins, 2.0, 400, 100, waited_s=w * 0.031, prefill_token_s=c) == ["b"]
    assert pins_to_release(pins, 2.0, 4000, 100, waited_s=w * 0.031, prefill_token_s=c) == []
    assert pins_to_release(pins, 2.0, 4000, 100, waited_s=w * 0.41, prefill_token_s=c) == ["c"]
    assert pins_to_release(pins, 2.0, 400, 100, waited_s=w * 0.41, prefill_token_s=c) == ["c"]  # furthest behind first
    # kept contexts holding more memory than the running requests do: waiting would not free it
    assert pins_to_release(pins, 2.0, 400, 100, waited_s=0.0, prefill_token_s=c, running_tokens=4000) == ["c"]
    assert pins_to_release(pins, 2.0, 400, 100, waited_s=0.0, prefill_token_s=c, running_tokens=4301) == []


# -- the engine model: conversations kept in blocks, LRU, pins --------------------------------
def _req(rid: str, agent: str, p: int, d: int, chain=(), ctx=None) -> SimRequest:
    return SimRequest(rid, agent, p, d, segments=segments(chain), ctx=ctx)


def _run_out(engine: EngineModel) -> list[SimRequest]:
    done: list[SimRequest] = []
    t = 0.0
    while engine.running:
        t, fin = engine.step(t, math.inf)
        done += fin
    return done


def test_a_finished_conversation_stays_cached_in_whole_blocks_and_is_hit() -> None:
    prof = get_profile("a100-llama7b")
    engine = EngineModel(prof, 4000, False, block_size=16, cache_sequences=True)
    engine.add(_req("r0", "a", 100, 50, ctx="a/c"))
    [r0] = _run_out(engine)
    assert r0.kept_key == "a/c"
    assert engine.cache.entries["a/c"].end == 144  # 149 computed tokens, floored to 9 blocks
    engine.add(_req("r1", "a", 200, 10, chain=[("a/c", 150)], ctx="a/c"))
    assert engine.running[0].cached == 144
    assert engine.reprefill_tokens("a") == 0


def test_lru_evicts_the_oldest_tail_first_and_counts_the_agents_reprefill() -> None:
    prof = get_profile("a100-llama7b")
    engine = EngineModel(prof, 1000, False, block_size=16, cache_sequences=True)
    engine.add(_req("r0", "a", 300, 33, ctx="a/c"))
    _run_out(engine)
    assert engine.cache.entries["a/c"].end == 320
    engine.add(_req("x", "b", 700, 20))  # needs room: a's context loses whole blocks of its tail
    assert engine.cache.entries["a/c"].end == 288
    _run_out(engine)  # its decode takes one more block
    left = engine.cache.entries["a/c"].end
    assert left == 272
    engine.add(_req("r1", "a", 400, 10, chain=[("a/c", 333)], ctx="a/c"))
    assert engine.running[0].cached == left
    assert engine.reprefill_tokens("a") == 320 - left
    assert engine.reprefill_tokens("b") == 0


def test_a_pinned_context_is_neither_free_nor_evicted_and_gives_way_before_preemption() -> None:
    prof = get_profile("a100-llama7b")
    engine = EngineModel(prof, 1000, False, block_size=16, cache_sequences=True)
    engine.add(_req("r0", "a", 300, 33, ctx="a/c"))
    _run_out(engine)
    free = engine.free_kv
    assert engine.cache.pin("a/c") == 320
    assert engine.free_kv == free - 320
    engine.add(_req("x", "b", 600, 20))  # fits beside the pin
    assert engine.cache.entries["a/c"].end == 320
    _run_out(engine)
    engine.add(_req("y", "b", 900, 20))  # does not: the pin gives way, nothing is preempted
    assert engine.pins_broken == 1 and engine.preemptions == 0
    assert "a/c" not in engine.cache.pinned


def _voted(mode: str, reuse: list[tuple[float, float, str]]) -> tuple[SimRetention, EngineModel]:
    """An agent's stage of three samples of one 608-token question has finished (each
    sample's own sequence kept under its id); the rule has seen `reuse` and pauses of 0.3 s."""
    prof = get_profile("a100-llama7b")
    engine = EngineModel(prof, 20_000, False, block_size=16, cache_sequences=True)
    rule = Retention(mode, PauseStats())
    for x in (0.2, 0.3, 0.4):
        rule.pauses.observe("vote", x)
    for resent, left, part in reuse:
        rule.reuse.observe("vote", resent, left, part)
    keeper = SimRetention(rule, Dispatcher("justitia", 20_000, 0.025), engine, 20_000, prof.per_prefill_token_s)
    for k in range(3):
        engine.add(_req(f"r{k}", "a", 800, 40 + 10 * k, chain=[("a/q", 608)]))
    for r in _run_out(engine):
        keeper.request_kept("a", r.kept_key, (seg.key for seg in r.segments))
    return keeper, engine


def test_the_part_a_stage_resends_is_kept_the_part_it_does_not_is_let_go() -> None:
    learnt = [(608.0, 608.0, SHARED), (0.0, 700.0, OWN)] * 20
    keeper, engine = _voted("auto", learnt)
    keeper.pause("a", "vote", 10.0)
    assert set(keeper.pins["a"].keys) == {"a/q"}  # the question, not the samples
    assert set(engine.cache.pinned) == {"a/q"} and keeper.pins["a"].tokens == 608
    keeper.expire(10.3)
    assert "a" in keeper.pins  # kept while the pause is expected to end soon
    keeper.resume("a", "vote", ["a/q"], 10.35)  # the vote resends the question only
    assert keeper.pins["a"].keys["a/q"][1] == math.inf  # now kept until its request is admitted
    keeper.release("a", 10.5)
    assert not engine.cache.pinned and keeper.held_token_s == pytest.approx(608 * 0.5)
    # `always` keeps all of it
    keeper, engine = _voted("always", learnt)
    keeper.pause("a", "vote", 10.0)
    assert set(keeper.pins["a"].keys) == {"a/q", "seq/r0", "seq/r1", "seq/r2"}


def test_what_a_stage_resends_is_learnt_per_part() -> None:
    keeper, _ = _voted("auto", [])
    keeper.pause("a", "vote", 10.0)
    keeper.resume("a", "vote", ["a/q"], 10.3)
    assert keeper.rule.reuse.rate("vote", SHARED) == pytest.approx(1.0)
    assert keeper.rule.reuse.rate("vote", OWN) == pytest.approx(0.5)  # one pause, none resent, and the prior
    assert set(keeper.pins["a"].keys) == {"a/q"}  # the samples let go at once


# -- workloads ------------------------------------------------------------------------------
def _agent(stages: list) -> dict:
    return {"id": "a1", "arrival": 0, "stages": stages}


def test_ctx_round_trips_and_is_checked() -> None:
    obj = _agent([[{"p": 100, "d": 20, "ctx": "a1/c"}],
                  [{"p": 200, "d": 5, "ctx": "a1/c", "prefix": {"id": "a1/c", "tokens": 120}}]])
    a = parse_agent(obj)
    assert a.ctx(1, 0) == "a1/c" and a.ctx(0, 0) == "a1/c"
    assert parse_agent(json.loads(json.dumps(a.to_json()))).ctxs == a.ctxs
    with pytest.raises(WorkloadError, match="ctx must be a non-empty string"):
        parse_agent(_agent([[{"p": 10, "d": 2, "ctx": 3}]]))
    with pytest.raises(WorkloadError, match="more than the 120"):
        parse_agent(_agent([[{"p": 100, "d": 20, "ctx": "c"}],
                            [{"p": 200, "d": 5, "ctx": "c", "prefix": {"id": "c", "tokens": 150}}]]))
    with pytest.raises(WorkloadError, match="must be the last of the chain"):
        parse_agent(_agent([[{"p": 200, "d": 5, "ctx": "c",
                              "prefix": [{"id": "c", "tokens": 50}, {"id": "x", "tokens": 60}]}]]))


def test_talk_mix_resends_whole_sequences_and_pauses() -> None:
    agents = make_talk_mix(60, get_profile("a100-llama7b"), seed=3, load=1.0)
    talkers = [a for a in agents if a.ctxs]
    assert talkers and all(a.pauses[0] == 0.0 and len(a.pauses) == len(a.stages) for a in agents)
    for a in talkers:
        for k in range(1, len(a.stages)):
            (p0, d0), (p1, _) = a.stages[k - 1][0], a.stages[k][0]
            assert a.prefix(k, 0)[-1] == (a.ctx(k, 0), p0 + d0) and p1 > p0 + d0
    flat = make_talk_mix(60, get_profile("a100-llama7b"), seed=3, load=1.0, multi_turn=False)
    assert len(flat) == 60 and not any(a.ctxs for a in flat)


def test_agentic_mix_loops_resend_the_whole_growing_conversation_with_tool_results() -> None:
    prof = get_profile("a100-llama7b")
    agents = make_agentic_mix(80, prof, seed=4, load=1.0)
    loops = [a for a in agents if a.type == AGENTIC]
    assert len(loops) == 40 and len({a.id for a in agents}) == 80
    assert [a.arrival for a in agents] == sorted(a.arrival for a in agents)
    assert any(a.ctxs and a.type != AGENTIC for a in agents)  # the multi-turn mix's talkers too
    system = next(iter(loops)).prefix(0, 0)[0]
    assert system[0] == f"sys/{AGENTIC}" and system[1] > 0
    for a in loops:
        assert all(len(st) == 1 for st in a.stages) and len(a.pauses) == len(a.stages) and a.pauses[0] == 0.0
        assert all(x > 0 for x in a.pauses[1:])
        assert all(p + d <= prof.max_model_len for st in a.stages for p, d in st)
        ctx = a.ctx(0, 0)
        assert all(a.ctx(k, 0) == ctx for k in range(len(a.stages)))
        for k in range(1, len(a.stages)):
            (p0, d0), (p1, _) = a.stages[k - 1][0], a.stages[k][0]
            # the whole previous turn (prompt and output) is resent after the tool definitions,
            # and the tool's result is appended: the conversation grows every turn
            assert a.prefix(k, 0) == (system, (ctx, p0 + d0))
            assert p1 >= p0 + d0 + 20
    assert sum(len(a.stages) > 3 for a in loops) > len(loops) / 2
    # the same seed gives the same mix; the multi-turn mix's agents kept their own conversations
    again = make_agentic_mix(80, prof, seed=4, load=1.0)
    assert [(a.id, a.stages, a.prefixes) for a in again] == [(a.id, a.stages, a.prefixes) for a in agents]
    for a in agents:
        assert all(c.startswith(f"{a.id}/") for c in a.ctxs.values())


# -- the simulator ---------------------------------------------------------------------------
def _chats(n: int, seed: int) -> list[AgentSpec]:
    rng = random.Random(seed)
    agents = []
    for i in range(n):
        stages, prefixes, ctxs, pauses, p = [], {}, {}, [0.0], rng.randint(300, 800)
        prev = 0
        for k in range(5):
            d = rng.randint(20, 100)
            stages.append([(p, d)])
            if k:
                prefixes[(k, 0)] = ((f"a{i}/c", prev),)
                pauses.append(round(rng.lognormvariate(math.log(0.8), 1.0), 3))
            ctxs[(k, 0)] = f"a{i}/c"
            prev = p + d
            p = prev + rng.randint(50, 200)
        agents.append(AgentSpec(f"a{i}", "chat", i * 0.3, stages, prefixes=prefixes, ctxs=ctxs, pauses=pauses))
    return agents


def test_retention_cuts_reprefill_and_keeps_every_promise() -> None:
    agents = _chats(40, 1)
    prof = get_profile("a100-llama7b")
    keep, drop = run_comparison(agents, ["justitia", "justitia-noretain"], prof, 8000, retain="always")
    k, d = keep.summary(), drop.summary()
    assert d["reprefill_tokens"] > 0
    assert k["reprefill_tokens"] < 0.8 * d["reprefill_tokens"]
    assert k["retain"] == "always" and d["retain"] == "never"
    assert k["promises_kept"] == d["promises_kept"] == len(agents)
    assert k["accounting_zero"] and d["accounting_zero"]
    assert k["retained_kv_token_s"] > 0
    assert sum(a["reprefill_tokens"] for a in keep.as_dict()["agents"]) == k["reprefill_tokens"]


def test_policies_without_a_fair_order_never_retain_and_workloads_without_talk_are_unchanged() -> None:
    prof = get_profile("a100-llama7b")
    agents = _chats(20, 2)
    assert simulate(agents, "vtc", prof, 8000, retain="always").summary()["retain"] == "never"
    plain = [AgentSpec(a.id, a.type, a.arrival, a.stages) for a in agents]
    s = simulate(plain, "justitia", prof, 8000, retain="always").summary()
    assert "retain" not in s and s["reprefill_tokens"] == 0
