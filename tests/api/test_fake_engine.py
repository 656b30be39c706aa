"""The fake engine keeps the engine contract (server/engine/base.py) that the fast tier's
server tests rely on: if it drifted, those tests would pass for the wrong reasons."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from server.engine.base import (
    Engine,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    InvalidRequestError,
    SamplingOptions,
)
from server.shared.profiles import EngineProfile, get_profile
from server.shared.step_time import StepSample
from tests.support.fake_engine import BOS, FakeEngine, SupervisedFakeEngine, decode, encode


def run(engine: FakeEngine, body: Callable[[FakeEngine], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        await engine.start()
        try:
            return await asyncio.wait_for(body(engine), 20)
        finally:
            await engine.close()

    return asyncio.run(main())


def request(rid: str, prompt_len: int = 10, priority: int = 0, **sampling: Any) -> EngineRequest:
    sampling.setdefault("ignore_eos", True)
    # the first token differs per id: prompts share no block (the prefix cache stays out)
    head = 8 + sum(map(ord, rid)) % 200
    return EngineRequest(rid, tuple([head] + [7] * (prompt_len - 1)), SamplingOptions(**sampling), priority)


async def collect(engine: FakeEngine, req: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(req)]


def test_it_is_an_engine_with_the_info_the_server_reads() -> None:
    engine = FakeEngine(kv_capacity_tokens=1024, block_size=16, max_model_len=512,
                        vocab_size=300)
    with pytest.raises(EngineError, match="has not started"):
        engine.info  # noqa: B018  (as the real engines: nothing to tell before it runs)

    async def read(e: FakeEngine) -> EngineInfo:
        assert isinstance(e, Engine)  # (isinstance reads `info`: only once started)
        return e.info

    info = run(engine, read)
    assert (info.kv_capacity_tokens, info.block_size, info.max_model_len, info.vocab_size) == \
        (1024, 16, 512, 300)
    with pytest.raises(ValueError):
        FakeEngine(kv_capacity_tokens=256, max_model_len=512)


def test_the_tokenizer_counts_bytes_and_round_trips() -> None:
    assert encode("") == [BOS]
    assert len(encode("héllo")) == 1 + len("héllo".encode())
    assert decode(encode("ünïcödé 🙂")) == "ünïcödé 🙂"
    with pytest.raises(ValueError):  # a lone surrogate is not text a tokenizer can take
        encode("\ud800")


def test_outputs_are_cumulative_with_deltas_and_exact_lengths() -> None:
    outs = run(FakeEngine(), lambda e: collect(e, request("r", max_tokens=12)))
    assert [o.output_tokens for o in outs] == list(range(1, 13))
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].prompt_tokens == 10
    assert "".join(o.delta_text for o in outs) == outs[-1].text and len(outs[-1].text) == 12


def test_eos_ends_early_unless_ignored_or_below_min_tokens() -> None:
    async def body(e: FakeEngine) -> tuple[EngineOutput, EngineOutput, EngineOutput]:
        free = await collect(e, request("a", max_tokens=20, ignore_eos=False))
        ignored = await collect(e, request("b", max_tokens=20, ignore_eos=True))
        held = await collect(e, request("c", max_tokens=20, ignore_eos=False, min_tokens=8))
        return free[-1], ignored[-1], held[-1]

    free, ignored, held = run(FakeEngine(eos_after=5), body)
    assert (free.output_tokens, free.finish_reason) == (5, "stop")
    assert (ignored.output_tokens, ignored.finish_reason) == (20, "length")
    assert (held.output_tokens, held.finish_reason) == (8, "stop")


def test_a_stop_string_ends_the_text_before_it() -> None:
    outs = run(FakeEngine(), lambda e: collect(e, request("r", max_tokens=200, stop=("fox",))))
    assert outs[-1].finish_reason == "stop" and "fox" not in outs[-1].text
    assert outs[-1].output_tokens < 200


def test_requests_advance_in_lockstep() -> None:
    async def body(e: FakeEngine) -> list[list[EngineOutput]]:
        return await asyncio.gather(*(collect(e, request(f"r{i}", max_tokens=30))
                                      for i in range(4)))

    engine = FakeEngine()
    results = run(engine, body)
    assert engine.peak_running == 4 and all(r[-1].output_tokens == 30 for r in results)
    assert engine.stats().steps_total < 4 * 30  # one step serves all four


def test_abort_ends_the_stream_with_abort_and_frees_the_kv() -> None:
    async def body(e: FakeEngine) -> tuple[list[EngineOutput], float]:
        outs: list[EngineOutput] = []
        async for out in e.generate(request("r", prompt_len=500, max_tokens=1000)):
            outs.append(out)
            if len(outs) == 3:
                assert e.stats().kv_usage > 0.1
                await e.abort("r")
        return outs, e.stats().kv_usage

    outs, usage = run(FakeEngine(), body)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].output_tokens == 3 and usage == 0.0


def test_a_consumer_that_stops_early_frees_its_request() -> None:
    async def body(e: FakeEngine) -> tuple[int, int]:
        stream = e.generate(request("r", prompt_len=500, max_tokens=1000))
        await stream.__anext__()
        running = e.stats().running
        await stream.aclose()
        return running, e.stats().running

    assert run(FakeEngine(), body) == (1, 0)


def test_requests_wait_for_kv_and_lower_priority_values_go_first() -> None:
    """Each request needs most of the cache: they run one at a time, in priority order
    (then arrival), whatever order they were submitted in."""

    async def body(e: FakeEngine) -> list[str]:
        order: list[str] = []

        async def one(rid: str, priority: int) -> None:
            await collect(e, request(rid, prompt_len=600, max_tokens=100, priority=priority))
            order.append(rid)

        blocker = asyncio.create_task(one("first", 0))
        await asyncio.sleep(0.02)  # the blocker holds the cache; the others queue
        assert e.stats().running == 1
        await asyncio.gather(one("late", 5), one("urgent", 1), one("later", 5), blocker)
        return order

    engine = FakeEngine(kv_capacity_tokens=1024, max_model_len=1024, block_size=32)
    assert run(engine, body) == ["first", "urgent", "late", "later"]
    assert engine.stats().preemptions_total == 0


def test_growth_past_the_cache_preempts_the_lowest_ranked_request() -> None:
    async def body(e: FakeEngine) -> list[list[EngineOutput]]:
        return await asyncio.gather(
            collect(e, request("high", prompt_len=200, max_tokens=300, priority=0)),
            collect(e, request("low", prompt_len=200, max_tokens=300, priority=9)))

    engine = FakeEngine(kv_capacity_tokens=768, max_model_len=768, block_size=32)
    high, low = run(engine, body)
    assert high[-1].num_preemptions == 0 and low[-1].num_preemptions >= 1
    assert high[-1].output_tokens == low[-1].output_tokens == 300
    assert engine.stats().preemptions_total == low[-1].num_preemptions


def test_stats_and_step_listeners_report_busy_steps() -> None:
    heard: list[tuple[float, float]] = []

    async def body(e: FakeEngine) -> None:
        e.add_step_listener(lambda dt, kv: heard.append((dt, kv)))
        await collect(e, request("r", prompt_len=100, max_tokens=40))

    engine = FakeEngine(step_s=0.001)
    run(engine, body)
    assert len(heard) >= 30
    assert all(dt > 0 for dt, _ in heard) and all(kv >= 100 for _, kv in heard)
    stats = engine.stats()
    assert stats.iteration_time_s is not None and stats.running == stats.waiting == 0


def test_the_engine_refuses_what_vllm_refuses() -> None:
    engine = FakeEngine(max_model_len=512, vocab_size=300)
    bad = [request("long", prompt_len=500, max_tokens=20),
           EngineRequest("vocab", (1, 300), SamplingOptions()),
           request("min", max_tokens=2, min_tokens=3)]
    for req in bad:
        with pytest.raises(InvalidRequestError):
            run(engine, lambda e, req=req: collect(e, req))


def test_a_killed_engine_fails_its_streams_and_new_requests_until_revived() -> None:
    async def body(e: FakeEngine) -> list[EngineOutput]:
        outs: list[EngineOutput] = []
        with pytest.raises(EngineError, match="died"):
            async for out in e.generate(request("r", max_tokens=1000)):
                outs.append(out)
                if len(outs) == 2:
                    e.kill()
        assert not e.healthy
        with pytest.raises(EngineError, match="not running"):
            await collect(e, request("after"))
        e.revive()
        assert e.healthy
        return await collect(e, request("revived", max_tokens=3))

    assert run(FakeEngine(), body)[-1].output_tokens == 3


@pytest.mark.parametrize("sampling, param", [
    ({"n": 2}, "n"),
    ({"logprobs": 0}, "logprobs"),
    ({"json_object": True}, "response_format"),
    ({"json_schema": '{"type": "object"}'}, "response_format"),
])
def test_what_it_cannot_do_it_refuses_by_name(sampling: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        run(FakeEngine(), lambda e: collect(e, request("r", **sampling)))
    assert caught.value.param == param and "fake engine" in str(caught.value)


def test_the_server_answers_what_the_fake_refuses_with_a_400_naming_it(fake_client) -> None:
    for body, param in (({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"),
                        ({"response_format": {"type": "json_object"}}, "response_format")):
        r = fake_client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and "fake engine" in r.json()["error"]["message"]


def test_a_seed_picks_the_text_and_the_same_seed_gives_the_same_text() -> None:
    async def body(e: FakeEngine) -> list[str]:
        texts = []
        for seed in (1, 1, 2, None):
            outs = await collect(e, request("r", max_tokens=12, seed=seed))
            texts.append(outs[-1].text)
        return texts

    one, again, two, unseeded = run(FakeEngine(), body)
    assert one == again and one != two and unseeded not in (one, two)


def test_steps_last_what_the_profile_says_for_their_shape() -> None:
    """A step that computes a long prompt lasts longer than a decode step, by the profile's
    cost per prefill token; the samples give each step's duration and shape."""
    profile = EngineProfile(name="slow-prefill", kv_tokens=4096, max_num_seqs=256, max_model_len=2048,
                            base_s=0.002, per_seq_s=0.0, per_prefill_token_s=0.0001,
                            per_kv_token_s=0.0)
    samples: list[tuple[str, StepSample]] = []

    async def body(e: FakeEngine) -> None:
        e.add_sample_listener(lambda name, sample: samples.append((name, sample)))
        await collect(e, request("r", prompt_len=1000, max_tokens=20))

    run(FakeEngine(profile=profile), body)
    assert len(samples) == 20 and {name for name, _ in samples} == {"fake"}
    first, rest = samples[0][1], [s for _, s in samples[1:]]
    assert (first.prefill_tokens, first.decode_seqs, first.kv_tokens) == (1000, 1, 1000)
    assert all(s.prefill_tokens == 0 and s.decode_seqs == 1 for s in rest)
    assert [s.kv_tokens for s in rest] == list(range(1001, 1020))
    # 0.002 + 1000 * 0.0001 = 0.102 s, against 0.002 s per decode step (sleeps may overrun)
    assert first.seconds >= 0.1 and first.seconds > 5 * statistics.median(s.seconds for s in rest)


def test_a_time_scale_runs_the_same_steps_faster() -> None:
    """`time_scale=k`: every step lasts the profile's time divided by k; the steps, their
    shapes and the text are those of the engine at its own speed."""
    profile = EngineProfile(name="slow-prefill", kv_tokens=4096, max_num_seqs=256, max_model_len=2048,
                            base_s=0.004, per_seq_s=0.0, per_prefill_token_s=0.0001,
                            per_kv_token_s=0.0)

    def steps(engine: FakeEngine) -> tuple[list[StepSample], str]:
        samples: list[StepSample] = []

        async def body(e: FakeEngine) -> str:
            e.add_sample_listener(lambda name, sample: samples.append(sample))
            return (await collect(e, request("r", prompt_len=1000, max_tokens=20)))[-1].text

        return samples, run(engine, body)

    (slow, slow_text), (fast, fast_text) = steps(FakeEngine(profile=profile)), steps(
        FakeEngine(profile=profile, time_scale=10.0))
    shape = [(s.prefill_tokens, s.decode_seqs, s.kv_tokens) for s in slow]
    assert shape == [(s.prefill_tokens, s.decode_seqs, s.kv_tokens) for s in fast] and fast_text == slow_text
    assert FakeEngine(profile=profile, time_scale=10.0).step_time(1, 1000, 1000) == pytest.approx(0.0104)
    # 0.104 s at its own speed, 0.0104 s ten times faster (sleeps may overrun, not underrun)
    assert slow[0].seconds >= 0.1 and 0.01 <= fast[0].seconds < slow[0].seconds / 2
    with pytest.raises(ValueError, match="time_scale"):
        FakeEngine(time_scale=0)


def test_the_default_profile_is_the_committed_cpu_profile() -> None:
    assert FakeEngine().profile == get_profile("cpu-tiny")
    assert FakeEngine(step_s=0.01).profile.iteration_s(7, 500, 900) == 0.01


def test_a_supervised_engine_is_restarted_then_fails_for_good() -> None:
    states: list[str] = []

    async def body(e: SupervisedFakeEngine) -> list[EngineOutput]:
        e.add_state_listener(lambda state, detail: states.append(state))
        assert e.state == "running" and not e.recovering
        e.kill()
        assert e.recovering and not e.healthy
        while e.state != "running":
            await asyncio.sleep(0.01)
        done = await collect(e, request("after the restart", max_tokens=3))
        e.kill()
        assert e.state == "failed" and not e.recovering
        return done

    engine = SupervisedFakeEngine(max_restarts=1, restart_delay_s=0.05)
    assert run(engine, body)[-1].output_tokens == 3
    assert states == ["restarting", "running", "failed"] and engine.restarts == 1
