"""A prompt past the engine's step budget: the profile's chunked-prefill term, the simulated
engine charging it, `bench calibrate` fitting it, `family_resim.py` adding it to a run's
profile (server/shared/profiles.py, server/sim/engine.py, server/sim/calibrate.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from benchmarks.family_resim import profile_of
from server.shared.profiles import EngineProfile, load_profile
from server.sim.calibrate import GridPoint, fit_chunked_prefill, save_profile, simulate_point
from server.sim.engine import EngineModel, SimRequest

LINE = EngineProfile("line", kv_tokens=4096, max_num_seqs=16, max_model_len=4096,
                     base_s=0.002, per_seq_s=0.0, per_prefill_token_s=2e-5, per_kv_token_s=0.0)
CHUNKED = replace(LINE, prefill_chunk_tokens=2048, per_chunked_prefill_s=9e-9)


def finish_time(profile: EngineProfile, prompt: int, output: int) -> float:
    engine = EngineModel(profile, profile.kv_tokens, preempt_newest=True)
    engine.add(SimRequest("r", "a", prompt, output))
    now = 0.0
    while not engine.idle():
        engine.resume()
        now, _ = engine.step(now, math.inf)
    return now


def test_a_prompt_costs_more_than_the_line_only_past_the_step_budget() -> None:
    assert CHUNKED.chunked_prefill_s(2048) == 0.0
    assert CHUNKED.chunked_prefill_s(4000) == pytest.approx(9e-9 * (4000 - 2048) * 4000)
    assert LINE.chunked_prefill_s(4000) == 0.0  # no budget known: nothing modelled
    # the simulated engine charges it once, in the step that prefills the prompt
    assert finish_time(CHUNKED, 4000, 16) - finish_time(LINE, 4000, 16) == pytest.approx(9e-9 * 1952 * 4000)
    assert finish_time(CHUNKED, 2000, 16) == pytest.approx(finish_time(LINE, 2000, 16))


def test_a_workload_of_long_prompts_is_sized_for_the_slower_engine() -> None:
    long_prompts = [(3900, 32)] * 4
    assert CHUNKED.effective_tau_s(4096, long_prompts) > LINE.effective_tau_s(4096, long_prompts)
    short = [(500, 32)] * 4
    assert CHUNKED.effective_tau_s(4096, short) == pytest.approx(LINE.effective_tau_s(4096, short))


def test_calibration_fits_what_long_prompts_took_beyond_the_line() -> None:
    grid = [GridPoint(1, 32, 16), GridPoint(4, 512, 16), GridPoint(1, 2048, 16),
            GridPoint(1, 3968, 16), GridPoint(1, 3968, 128)]
    # an engine whose prompts past 2,048 tokens took 7e-9 s per (token past x token) more
    measured = [(pt, simulate_point(LINE, 4096, pt) + 7e-9 * pt.batch * max(0, pt.prompt - 2048) * pt.prompt)
                for pt in grid]
    fitted = fit_chunked_prefill(measured, LINE, 2048)
    assert fitted.prefill_chunk_tokens == 2048
    assert fitted.per_chunked_prefill_s == pytest.approx(7e-9, rel=1e-6)
    for pt, seconds in measured:  # and the simulator then times every point as measured
        assert simulate_point(fitted, 4096, pt) == pytest.approx(seconds, rel=1e-6)
    # no point past the budget (a short context): the budget is recorded, nothing is fitted
    short = fit_chunked_prefill(measured[:3], LINE, 2048)
    assert (short.prefill_chunk_tokens, short.per_chunked_prefill_s) == (2048, 0.0)
    # long prompts faster than the line: a cost is never negative
    quick = [(pt, simulate_point(LINE, 4096, pt) * 0.8) for pt in grid]
    assert fit_chunked_prefill(quick, LINE, 2048).per_chunked_prefill_s == 0.0


def test_profile_files_keep_the_term_and_older_ones_load_without_it(tmp_path) -> None:
    path = tmp_path / "p.json"
    save_profile(CHUNKED, path)
    assert load_profile(str(path)) == CHUNKED
    doc = json.loads(path.read_text())
    for key in ("prefill_chunk_tokens", "per_chunked_prefill_s"):
        del doc["profile"][key]
    path.write_text(json.dumps(doc))
    assert load_profile(str(path)) == LINE
    for key, bad in (("per_chunked_prefill_s", -1e-9), ("prefill_chunk_tokens", 1.5), ("prefill_chunk_tokens", -1)):
        doc["profile"][key] = bad
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=key):
            load_profile(str(path))
        del doc["profile"][key]


def test_a_scaled_profile_scales_the_term_too() -> None:
    slow = CHUNKED.scaled(1.5)
    assert slow.chunked_prefill_s(4000) == pytest.approx(1.5 * CHUNKED.chunked_prefill_s(4000))
    assert slow.iteration_s(8, 100, 2000) == pytest.approx(1.5 * CHUNKED.iteration_s(8, 100, 2000))


def test_resimulation_adds_the_term_fitted_to_the_runs_calibration() -> None:
    grid = [GridPoint(1, 2048, 16), GridPoint(1, 3968, 16)]
    calibration = {"fit": {"points": [
        {"batch": pt.batch, "prompt": pt.prompt, "output": pt.output,
         "seconds": simulate_point(LINE, 4096, pt) + 5e-9 * max(0, pt.prompt - 2048) * pt.prompt} for pt in grid]}}
    run = {"engine_fit": {"base_s": 0.004, "per_seq_s": 0.0, "per_prefill_token_s": 3e-5, "per_kv_token_s": 0.0}}
    _, as_run = profile_of("a=run", LINE, calibration, 2048)
    assert as_run(run) == LINE
    _, refit_chunked = profile_of("b=refit+chunked", LINE, calibration, 2048)
    prof = refit_chunked(run)
    assert (prof.base_s, prof.per_prefill_token_s) == (0.004, 3e-5)  # the run's own engine
    assert prof.prefill_chunk_tokens == 2048 and prof.per_chunked_prefill_s == pytest.approx(5e-9, rel=1e-6)
    with pytest.raises(SystemExit):
        profile_of("c=run+served", LINE, calibration, 2048)
    # the client's turnaround before each later stage: a fixed one, or the one each run measured
    _, fixed = profile_of("d=refit+chunked+turnaround=0.003", LINE, calibration, 2048)
    assert fixed(run).stage_turnaround_s == 0.003 and fixed(run).per_chunked_prefill_s > 0
    _, measured = profile_of("e=run+turnaround=run", LINE, calibration, 2048)
    assert measured({**run, "stage_turnaround_s": 0.0027}).stage_turnaround_s == 0.0027
    with pytest.raises(SystemExit, match="no turnaround"):
        measured({**run, "shape": "bursts", "seed": 1, "mode": "fresh"})  # a run from before it was recorded
    # a run whose every boundary was a pause measured none: the profile's stays
    assert measured({**run, "stage_turnaround_s": None}).stage_turnaround_s == LINE.stage_turnaround_s
    with pytest.raises(SystemExit, match="seconds or `run`"):
        profile_of("f=run+turnaround=soon", LINE, calibration, 2048)
