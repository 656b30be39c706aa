"""The live scheduler's pieces (docs/architecture.md, "The live scheduler"): the agent
lifecycle's one transition function, admission, and the side effects as listeners; run
in front of the fake engine (no vLLM)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from server.engine.base import EngineOutput, SamplingOptions
from server.runtime.agent_listeners import AgentListener
from server.runtime.agents import TERMINAL, AgentEntry, AgentStatus
from server.runtime.declared import declared_shape
from server.runtime.lifecycle import TRANSITIONS, AgentConflict, IllegalTransition, transition
from server.runtime.limits import PerTenant, QuotaExceeded, Quotas
from server.runtime.live import LiveConfig, LiveScheduler
from server.scheduler import AgentShape
from tests.support.fake_engine import FakeEngine

STATES = list(TRANSITIONS)


def entry(state: str = "queued") -> AgentEntry:
    e = AgentEntry(id="agt-1", type="t", tenant="x", prompt="p", metadata={},
                   submitted_at=0.0, submitted_mono=0.0, predicted_cost=1.0)
    e.state = state  # type: ignore[assignment]
    return e


def test_the_declared_shape_is_parsed_once_into_one_typed_value() -> None:
    """`metadata.stages` (with `critical_path_tokens` and `prefill_tokens`) becomes one
    AgentShape at registration; the entry's declared stages are that shape's."""
    assert declared_shape({"stages": 3, "critical_path_tokens": 900, "prefill_tokens": 40}) == \
        AgentShape(stages=3, critical_path_tokens=900, prefill_tokens=40)
    assert declared_shape({"stages": 1, "first_request_tokens": 4087}) == \
        AgentShape(stages=1, first_request_tokens=4087)
    assert declared_shape({"stages": 1, "prefill_tokens": 8000, "prefill_square_tokens": 32_000_000}) == \
        AgentShape(stages=1, prefill_tokens=8000, prefill_square_tokens=32_000_000)
    assert declared_shape({"stages": 2, "critical_path_tokens": "9"}) == AgentShape(stages=2)
    # each stage's largest request; the first stage's is the first request where not declared apart
    assert declared_shape({"stages": 2, "stage_request_tokens": [300, 4087]}) == \
        AgentShape(stages=2, first_request_tokens=300, stage_request_tokens=(300, 4087))
    assert declared_shape({"stages": 2, "first_request_tokens": 310, "stage_request_tokens": [300, 4087]}) == \
        AgentShape(stages=2, first_request_tokens=310, stage_request_tokens=(300, 4087))
    for other in ([300, "4087"], [300, True], "300", []):  # not a list of integers: the caller's own
        assert declared_shape({"stages": 2, "stage_request_tokens": other}) == AgentShape(stages=2), other
    # not an integer number of stages (a boolean, a string, a float, none): nothing declared
    for stages in (True, "3", 3.0, 0, None):
        assert declared_shape({"stages": stages}) is None, stages
    e = AgentEntry(id="agt-2", type="t", tenant="x", prompt="p", metadata={"stages": 4},
                   submitted_at=0.0, submitted_mono=0.0, predicted_cost=1.0)
    assert e.declared == AgentShape(stages=4) and e.declared_stages == 4
    assert entry().declared_stages is None


@pytest.mark.parametrize("start", STATES)
@pytest.mark.parametrize("to", STATES)
def test_the_transition_function_applies_legal_moves_and_refuses_the_rest(start, to) -> None:
    e = entry(start)
    legal = (start, to) in {("queued", "running"), ("running", "paused"), ("paused", "running")} | {
        (s, t) for s in ("queued", "running", "paused") for t in TERMINAL}
    if not legal:
        with pytest.raises(IllegalTransition, match=f"is {start}; it cannot become {to}"):
            transition(e, to, wall=5.0, now=2.0)
        assert e.state == start and e.finished_at is None
        return
    transition(e, to, wall=5.0, now=2.0)
    assert e.state == to
    assert (e.finished_at, e.last_activity_mono) == ((5.0, 2.0) if to in TERMINAL else (None, 0.0))


def test_an_illegal_transition_is_a_conflict_for_the_api() -> None:
    assert issubclass(IllegalTransition, AgentConflict)  # answered 409, never 500


class Recorder(AgentListener):
    def __init__(self) -> None:
        self.heard: list[tuple[str, str, str]] = []

    def on_agent_registered(self, entry: AgentEntry) -> None:
        self.heard.append(("registered", entry.id, entry.state))

    def on_agent_ended(self, entry: AgentEntry) -> None:
        self.heard.append(("ended", entry.id, entry.state))

    def on_request_finished(self, entry: AgentEntry, out: EngineOutput) -> None:
        self.heard.append(("request", entry.id, out.finish_reason or ""))


class Broken(AgentListener):
    def on_agent_ended(self, entry: AgentEntry) -> None:
        raise RuntimeError("a listener's bug")


def live_run(body: Callable[[LiveScheduler], Awaitable[Any]], *,
             listeners: list[AgentListener] | None = None, predictors: Any = None, **config: Any) -> Any:
    async def main() -> Any:
        engine = FakeEngine()
        await engine.start()
        live = LiveScheduler(engine, LiveConfig(**config), listeners=listeners, predictors=predictors)
        try:
            return await asyncio.wait_for(body(live), 20)
        finally:
            await live.close()
            await engine.close()

    return asyncio.run(main())


async def one_request(live: LiveScheduler, e: AgentEntry, rid: str, tokens: int = 5) -> int:
    last = None
    async for out in live.run(e, rid, (1, 5, 6, 7), SamplingOptions(max_tokens=tokens,
                                                                    ignore_eos=True)):
        last = out
    assert last is not None
    return last.output_tokens


def test_listeners_hear_each_event_once_and_a_broken_one_stops_nothing() -> None:
    recorder = Recorder()

    async def body(live: LiveScheduler) -> AgentEntry:
        e = live.register("t", "prompt", "x", predicted_cost=1e4)
        assert await one_request(live, e, "r1") == 5
        await live.finish(e)
        # A second end (a cancel racing the finish) is refused by the lifecycle, and the
        # listeners do not hear the agent end twice.
        with pytest.raises(AgentConflict):
            await live.cancel(e)
        with pytest.raises(IllegalTransition):
            transition(e, AgentStatus.CANCELLED, wall=0.0, now=live.now())
        return e

    e = live_run(body, listeners=[Broken(), recorder])
    assert e.state == "finished" and e.finished_at is not None
    assert recorder.heard == [("registered", e.id, "queued"), ("request", e.id, "length"),
                              ("ended", e.id, "finished")]


def test_an_agent_runs_once_admitted_and_a_failed_one_keeps_its_error() -> None:
    async def body(live: LiveScheduler) -> tuple[list[str], AgentEntry]:
        e = live.register("t", "prompt", "x", predicted_cost=1e4)
        seen = [e.state]
        await one_request(live, e, "r1")
        seen.append(e.state)
        await live.finish(e, error="ValueError: boom")
        seen.append(e.state)
        return seen, e

    seen, e = live_run(body)
    assert seen == ["queued", "paused", "failed"] and e.error == "ValueError: boom"


def test_paused_admission_holds_requests_and_resume_admits_them() -> None:
    async def body(live: LiveScheduler) -> tuple[str, int, int]:
        e = live.register("t", "prompt", "x", predicted_cost=1e4)
        live.pause()
        task = asyncio.create_task(one_request(live, e, "held"))
        await asyncio.sleep(0.05)
        held = (e.state, live.dispatcher.ledger.pending_count)
        live.resume()
        tokens = await task
        return held[0], held[1], tokens

    assert live_run(body) == ("queued", 1, 5)


def test_the_queued_quota_is_counted_by_admission_and_given_back() -> None:
    quotas = Quotas(queued_requests=PerTenant(1, {}))

    async def body(live: LiveScheduler) -> int:
        e = live.register("t", "prompt", "x", predicted_cost=1e4)
        live.pause()
        first = asyncio.create_task(one_request(live, e, "a"))
        await asyncio.sleep(0.02)
        with pytest.raises(QuotaExceeded):
            await one_request(live, e, "b")
        live.resume()
        await first
        return await one_request(live, e, "c")  # the quota was given back

    assert live_run(body, quotas=quotas) == 5


def test_a_prior_measured_elsewhere_sets_the_eta_rate_only_once_fitted_to_enough_steps() -> None:
    """The built-in prior (another host's engine, no attention term) made ETAs divide by
    three times the engine's rate in a fresh server's first burst: until the fit has seen
    TRUSTED_STEPS steps, the time model times critical paths but the measured R stays."""
    from server.runtime.engine_upkeep import TRUSTED_STEPS
    from server.scheduler.time_model import StepSample

    async def body(live: LiveScheduler) -> tuple[float, float, float, float]:
        e = live.register("t", "prompt", "x", predicted_cost=1e4)
        await one_request(live, e, "r1", tokens=50)  # a mix to sustain
        fast = StepSample(seconds=0.0005, decode_seqs=4, prefill_tokens=0, kv_tokens=200)
        for _ in range(TRUSTED_STEPS - 1):
            live.time_models.observe("local", fast)
        live.upkeep.update()
        few = (live.dispatcher.eta_rate, live.dispatcher.rate)
        live.time_models.observe("local", fast)
        live.upkeep.update()
        return (*few, live.dispatcher.eta_rate, live.dispatcher.rate)

    eta_few, rate_few, eta_enough, rate_enough = live_run(body)
    assert eta_few == rate_few  # 1,023 steps: not yet the engine's model
    assert eta_enough > 2 * rate_enough  # 1,024: its rate on the mix (the fit's 0.5 ms steps)


def test_a_calibrated_prior_times_etas_until_the_fit_has_seen_enough_steps() -> None:
    """A calibration (or the last run's saved fit) describes this engine; a fit to a burst's
    first few hundred steps, mostly prefills, does not: live, it halved the rate ETAs divide
    by and a fresh server told the burst's last third twice its JCTs. Until the fit has seen
    TRUSTED_STEPS steps the calibration times ETAs; then the fit does."""
    from server.runtime.engine_upkeep import TRUSTED_STEPS
    from server.scheduler.time_model import StepSample, TimeModel

    calibration = TimeModel(0.004, 0.00002, 0.00009, 0.0000007, source="calibration")

    async def body(live: LiveScheduler) -> tuple[Any, Any]:
        slow = StepSample(seconds=0.05, decode_seqs=4, prefill_tokens=0, kv_tokens=200)
        for _ in range(TRUSTED_STEPS - 1):
            live.time_models.observe("local", slow)
        live.upkeep.update()
        few = live.dispatcher.etas.time_model
        live.time_models.observe("local", slow)
        live.upkeep.update()
        return few, live.dispatcher.etas.time_model

    few, enough = live_run(body, time_model_prior=calibration, prior_measured=True)
    assert few is calibration  # 1,023 steps of a slower engine: the calibration still times ETAs
    assert enough.samples == TRUSTED_STEPS  # 1,024: the fit, of 50 ms steps
    assert enough.step_s(4, 0, 200) > 5 * calibration.step_s(4, 0, 200)

    async def unmeasured(live: LiveScheduler) -> tuple[Any, bool]:
        step = StepSample(seconds=0.05, decode_seqs=4, prefill_tokens=0, kv_tokens=200)
        for _ in range(31):  # not yet a refit: the built-in prior is no fit, tau times paths
            live.time_models.observe("local", step)
        live.upkeep.update()
        before = live.dispatcher.etas.time_model
        live.time_models.observe("local", step)  # the first refit
        live.upkeep.update()
        return before, live.dispatcher.etas.time_model is live.time_models.models()["local"]

    before, fitted = live_run(unmeasured)
    assert before is None and fitted  # the built-in prior: the early fit times paths at once


def test_a_guessed_cost_is_timed_as_the_one_request_it_stands_for() -> None:
    """A cost the server guesses (the fallback, a cold start) is one request of the agent's
    prompt decoding until the cost is spent, and its ETA expects that decode: the guessed
    cost at the engine's full rate, with no critical path, would be a tenth or less of the
    agent's JCT. A declared cost with no shape keeps its ETA."""
    from predictors import PredictorRegistry
    from server.runtime.cost_estimate import FALLBACK_OUTPUT_TOKENS

    prompt = "word " * 400

    async def body(live: LiveScheduler) -> tuple[float, AgentEntry, AgentEntry]:
        step = live.dispatcher.etas.iteration_s()
        declared = live.register("new_type", prompt, "x", predicted_cost=2e5)
        guessed = live.register("new_type", prompt, "y")
        return step, declared, guessed

    for predictors, source in ((None, "fallback"), (PredictorRegistry(None), "cold_start")):
        step, declared, guessed = live_run(body, predictors=predictors)
        assert (declared.cost_source, guessed.cost_source) == ("declared", source)
        assert declared.first_eta_s is not None and guessed.first_eta_s is not None
        assert declared.first_eta_s < 100 * step  # its cost at the full rate: no path expected
        # one request of 256 output tokens (the fallback's, and the cold start's d0 before any
        # output was seen): 257 engine steps at least
        assert guessed.first_eta_s >= (FALLBACK_OUTPUT_TOKENS + 1) * step


def test_an_agent_between_its_requests_is_paused_and_its_record_says_since_when() -> None:
    """running while a request is in flight; paused (since when, for how long) once none is;
    running again at its next request; a paused agent can end."""
    clock = [100.0]

    async def main() -> tuple[list[str], list[Any]]:
        engine = FakeEngine()
        await engine.start()
        live = LiveScheduler(engine, LiveConfig(), clock=lambda: clock[0], wall=lambda: 5000.0 + clock[0])
        try:
            e = live.register("t", "prompt", "x", predicted_cost=1e4)
            seen, records = [e.state], []
            gen = live.run(e, "r1", (1, 5, 6, 7), SamplingOptions(max_tokens=3, ignore_eos=True))
            await gen.__anext__()  # admitted, in the engine
            seen.append(e.state)
            records.append(live.record(e))
            async for _ in gen:
                pass
            seen.append(e.state)
            clock[0] += 2.5  # a tool call
            records.append(live.record(e))
            await one_request(live, e, "r2")
            seen.append(e.state)
            clock[0] += 1.0
            records.append(live.record(e))
            await live.finish(e)
            seen.append(e.state)
            records.append(live.record(e))
            return seen, records
        finally:
            await live.close()
            await engine.close()

    seen, (during, paused, again, ended) = asyncio.run(main())
    assert seen == ["queued", "running", "paused", "paused", "finished"]
    assert during.state == "running" and during.paused_at is None and during.paused_for_s is None
    assert paused.state == "paused" and paused.paused_at == pytest.approx(5100.0)
    assert paused.paused_for_s == pytest.approx(2.5)
    # its second pause began when its second request ended, 2.5 s later
    assert again.paused_at == pytest.approx(5102.5) and again.paused_for_s == pytest.approx(1.0)
    assert ended.state == "finished" and ended.paused_at is None and ended.paused_for_s is None


def test_an_agent_that_ends_with_a_request_in_flight_is_filed_under_its_own_context() -> None:
    """Its JCT / first ETA goes to the ETA record while the dispatcher still knows the agent:
    filed under the context it registered in and with the pauses its ETA expected, not as
    an agent of no context (which every context would read where its own are few)."""
    filed: list[tuple[int | None, bool]] = []

    async def body(live: LiveScheduler) -> int | None:
        calibration = live.dispatcher.etas.calibration
        observe = calibration.observe

        def spy(first_eta_s: float, jct_s: float, context: int | None = None, by_context: bool = True,
                pausing: bool = False, large: bool = False, deadline_eta_s: float | None = None) -> None:
            filed.append((context, by_context))
            observe(first_eta_s, jct_s, context, by_context, pausing, large, deadline_eta_s)

        calibration.observe = spy  # type: ignore[method-assign]
        e = live.register("t", "prompt", "x", predicted_cost=1e4)
        context = live.dispatcher.agents[e.id].promise_context
        gen = live.run(e, "r1", (1, 5, 6, 7), SamplingOptions(max_tokens=200, ignore_eos=True))
        await gen.__anext__()  # admitted, in the engine
        assert e.in_flight
        await live.finish(e)  # the agent's code returned without waiting for r1
        await gen.aclose()
        assert e.state == "finished" and e.id not in live.dispatcher.agents
        return context

    context = live_run(body)
    assert context is not None
    assert filed == [(context, True)]


def test_an_untagged_request_waits_in_its_eta_for_room_for_itself() -> None:
    """The one-request agent of an untagged request is registered with that request's shape:
    admission reserves its prompt and max_tokens for each of its n sequences, and its ETA
    waits until the running requests have freed that much (eta_estimator.request_need)."""
    from server.runtime.service import InferenceService, PreparedRequest

    async def main() -> list[tuple[int | None, float]]:
        engine = FakeEngine()
        await engine.start()
        live = LiveScheduler(engine, LiveConfig())
        service = InferenceService(engine, engine.model, live)
        try:
            seen = []
            for prompt, max_tokens, n in ((100, 50, 2), (3000, 900, 1)):
                sampling = SamplingOptions(max_tokens=max_tokens, n=n)
                request = PreparedRequest(f"r{prompt}", tuple(range(prompt)), sampling)
                agent = live.dispatcher.agents[service.agent_for(None, "x", request, "prompt").id]
                seen.append((agent.shape.first_request_tokens, live.dispatcher.etas.request_need(agent)))
            return seen
        finally:
            await live.close()
            await engine.close()

    assert asyncio.run(main()) == [(300, 300.0), (3900, 3900.0)]
