"""A prompt longer than the engine's token budget per step is prefilled in chunks, each
attending over the ones before it: it costs more than its tokens' linear prefill
(`EngineProfile.chunked_prefill_s`). ETAs count that extra for an agent whose shape says how
long its prompts are (`AgentShape.prefill_square_tokens`), from the time model's term."""

from __future__ import annotations

from dataclasses import replace

import pytest

from server.scheduler import AgentShape, Dispatcher
from server.scheduler.time_model import TimeModel, TimeModelFitter
from server.shared.profiles import EngineProfile
from server.shared.step_time import StepSample
from server.sim.simulator import simulate
from server.sim.workload import AgentSpec

M = 8192
CHUNK = 2048
PER_CHUNKED = 1e-8
LINEAR = TimeModel(base_s=0.003, per_seq_s=5e-5, per_prefill_token_s=2.5e-5, per_kv_token_s=0.0)
CHUNKED = replace(LINEAR, prefill_chunk_tokens=CHUNK, per_chunked_prefill_s=PER_CHUNKED)
# three prompts of 4,000 tokens, each 1,952 tokens past the budget
PROMPTS = [4000, 4000, 4000]
EXTRA_S = sum(PER_CHUNKED * (p - CHUNK) * p for p in PROMPTS)


def _eta(model: TimeModel, square: int | None, fast_pass: bool) -> float:
    d = Dispatcher("justitia", M, 0.02, time_model=model)
    shape = AgentShape(1, 20, sum(PROMPTS), prefill_square_tokens=square)
    d.register_agent("a", 1e5, 0.0, shape=shape)
    if fast_pass:
        d.refresh_etas(0.0)
    return d.eta_time("a", 0.0)


@pytest.mark.parametrize("fast_pass", [False, True])
def test_the_eta_counts_the_chunked_prefill_of_long_prompts(fast_pass: bool) -> None:
    square = sum(p * p for p in PROMPTS)
    counted = _eta(CHUNKED, square, fast_pass) - _eta(CHUNKED, None, fast_pass)
    # alone at the head of the queue: its critical path, prefill included, is its ETA
    assert counted == pytest.approx(EXTRA_S, rel=0.02)
    # a model without the term, or prompts within the budget, count nothing more
    assert _eta(LINEAR, square, fast_pass) == _eta(LINEAR, None, fast_pass)
    within = AgentShape(1, 20, 6000, prefill_square_tokens=3 * 2000**2)
    assert Dispatcher("justitia", M, 0.02, time_model=CHUNKED).etas.prefill_of(within) == 6000


def test_prompts_of_several_lengths_are_never_counted_past_their_own_extra() -> None:
    """The shape's two sums stand for prompts of one length: exact for those, and no more
    than the extra of the prompts themselves otherwise (a short prompt costs none)."""
    d = Dispatcher("justitia", M, 0.02, time_model=CHUNKED)
    token_s = d.etas.prefill_token_s()
    for prompts in ([4000, 4000], [4000, 100, 100, 100], [3000, 1000], [5000, 2100, 500]):
        shape = AgentShape(1, 20, sum(prompts), prefill_square_tokens=sum(p * p for p in prompts))
        counted_s = (d.etas.prefill_of(shape) - sum(prompts)) * token_s  # type: ignore[operator]
        own_s = sum(CHUNKED.chunked_prefill_s(p) for p in prompts)
        assert 0.0 < counted_s <= own_s * (1 + 1e-9), prompts
    # a declaration of prompts longer than all of them together is capped at that
    shape = AgentShape(1, 20, 4000, prefill_square_tokens=10**18)
    capped = AgentShape(1, 20, 4000, prefill_square_tokens=4000**2)
    assert d.etas.prefill_of(shape) == d.etas.prefill_of(capped)


def test_the_online_fit_keeps_the_calibrated_chunked_term() -> None:
    """A step's statistics do not say how long the prompts it prefilled were: the fitted
    coefficients are the steps', the chunked term the calibration's."""
    fitter = TimeModelFitter(CHUNKED, refit_every=8)
    for i in range(64):
        fitter.observe(StepSample(seconds=0.004 + 1e-4 * (i % 8), decode_seqs=i % 8, prefill_tokens=0, kv_tokens=0))
    model = fitter.refit()
    assert model.samples == 64 and model.base_s != CHUNKED.base_s
    assert (model.prefill_chunk_tokens, model.per_chunked_prefill_s) == (CHUNK, PER_CHUNKED)
    assert TimeModel.from_dict(model.as_dict()) == model
    with pytest.raises(ValueError):
        TimeModel.from_dict({**model.as_dict(), "per_chunked_prefill_s": -1.0})
    with pytest.raises(ValueError):
        TimeModel.from_dict({**model.as_dict(), "prefill_chunk_tokens": 1.5})


def test_in_the_simulator_an_agent_of_long_prompts_is_told_the_time_they_take() -> None:
    """Alone on an engine that charges the chunked prefill, an agent of long prompts takes
    the extra; its first ETA counts it (without the shape's squares it was told 0.58 s of
    1.11 s)."""
    profile = EngineProfile("chunked", kv_tokens=M, max_num_seqs=256, max_model_len=M,
                            base_s=LINEAR.base_s, per_seq_s=LINEAR.per_seq_s,
                            per_prefill_token_s=LINEAR.per_prefill_token_s, per_kv_token_s=0.0,
                            prefill_chunk_tokens=CHUNK, per_chunked_prefill_s=PER_CHUNKED)
    agent = AgentSpec("long", "t", 0.0, [[(p, 20) for p in PROMPTS], [(6000, 20)]])
    # the rate measured from the engine's steps, as the live server measures it
    [result] = simulate([agent], "justitia", profile, tau="measured").agents
    assert result.first_eta_s is not None
    extra = sum(profile.chunked_prefill_s(p) for p in [*PROMPTS, 6000])
    assert extra > 0.2 * result.jct_s  # the term matters here
    assert abs(result.first_eta_s - result.jct_s) < 0.1 * result.jct_s
