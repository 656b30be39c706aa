"""A measured prior checked against the engine's warm-up steps (server/runtime/prior_check.py)."""

from __future__ import annotations

import pytest

from server.runtime.prior_check import MIN_STEPS, TOLERANCE, WarmUpSteps, check_prior
from server.shared.step_time import StepSample, TimeModel

PRIOR = TimeModel(0.0025, 5e-5, 2e-5, 2e-7, source="prior: here profile",
                  prefill_chunk_tokens=2048, per_chunked_prefill_s=5e-9)


def warm_up(engine: TimeModel, n: int = 60) -> list[StepSample]:
    """Steps of the warm-up's kind (a prefill of the batch, then its decodes shrinking) on
    an engine that runs as `engine` predicts."""
    shapes = [(0, 2100, 0)] + [(6 - k // 20, 0, 2100 + 6 * k) for k in range(n - 1)]
    return [StepSample(engine.step_s(*shape), *shape) for shape in shapes]


def times(model: TimeModel, factor: float) -> TimeModel:
    return TimeModel(*(c * factor for c in model.coefficients))


def test_a_prior_of_a_host_four_times_faster_is_scaled_to_the_warm_up() -> None:
    steps = warm_up(times(PRIOR, 4.0))
    checked, check = check_prior(PRIOR, steps)
    assert check.scaled and check.steps == len(steps) and check.ratio == pytest.approx(4.0)
    for step in steps:  # it now predicts the steps the engine ran
        assert checked.predict(step) == pytest.approx(step.seconds)
    assert checked.chunked_prefill_s(4096) == pytest.approx(4 * PRIOR.chunked_prefill_s(4096))
    assert checked.prefill_chunk_tokens == 2048
    assert checked.source == f"prior: here profile, scaled x4.00 to {len(steps)} warm-up steps"
    faster, check = check_prior(PRIOR, warm_up(times(PRIOR, 0.25)))  # a faster host: shorter steps
    assert check.scaled and faster.base_s == pytest.approx(PRIOR.base_s / 4)


def test_a_prior_within_the_tolerance_is_kept_as_it_is() -> None:
    for factor in (1 / TOLERANCE * 1.05, 1.0, TOLERANCE * 0.95):
        checked, check = check_prior(PRIOR, warm_up(times(PRIOR, factor)))
        assert checked is PRIOR and not check.scaled and check.ratio == pytest.approx(factor)


def test_a_delayed_step_is_left_out() -> None:
    """A step the host's scheduler held up (another process on the core) moves nothing."""
    steps = warm_up(PRIOR)
    steps[5] = StepSample(steps[5].seconds * 50, steps[5].decode_seqs, steps[5].prefill_tokens, steps[5].kv_tokens)
    checked, check = check_prior(PRIOR, steps)
    assert checked is PRIOR and check.ratio == pytest.approx(1.0) and check.steps == len(steps) - 1


def test_the_steps_summed_weigh_a_prefill_by_its_length() -> None:
    """An ETA is a sum of steps: a host whose prefill is 4x the prior's and decodes 2x is
    told by the time the warm-up took, not by its median (decode) step."""
    engine = TimeModel(PRIOR.base_s * 2, PRIOR.per_seq_s * 2, PRIOR.per_prefill_token_s * 4, PRIOR.per_kv_token_s * 2)
    steps = warm_up(engine)
    checked, check = check_prior(PRIOR, steps)
    assert check.scaled and 2.0 < check.ratio < 4.0
    assert check.ratio == pytest.approx(sum(s.seconds for s in steps) / sum(PRIOR.predict(s) for s in steps))
    assert sum(checked.predict(s) for s in steps) == pytest.approx(sum(s.seconds for s in steps))


def test_the_tolerance_is_the_servers_to_set() -> None:
    steps = warm_up(times(PRIOR, 1.3))
    assert not check_prior(PRIOR, steps)[1].scaled
    assert check_prior(PRIOR, steps, tolerance=1.2)[1].scaled


def test_too_few_steps_say_nothing() -> None:
    """An engine that reports no steps (or a warm-up of a handful) leaves the prior alone."""
    for steps in ([], warm_up(times(PRIOR, 4.0), MIN_STEPS - 1)):
        checked, check = check_prior(PRIOR, steps)
        assert checked is PRIOR and check.ratio is None and not check.scaled
    empty = StepSample(0.0, 0, 0, 0)  # predicted 0 by a prior of no base: not comparable
    zero = TimeModel(0.0, 0.0, 0.0, 0.0)
    assert check_prior(zero, [empty] * 40)[1].steps == 0


def test_the_warm_up_keeps_its_last_round_only_until_closed() -> None:
    steps = WarmUpSteps()
    first, last = StepSample(0.5, 1, 0, 10), StepSample(0.004, 1, 0, 10)
    steps.observe("local", first)
    steps.next_round()
    steps.observe("local", last)
    assert steps.close() == (last,)
    steps.observe("local", last)  # the engine still calls it: nothing is kept
    assert steps.close() == ()
