"""Accuracy and latency of cost predictors, and the baselines they are compared with."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .base import Features, PointPredictor, Predictor
from .prompt_features import estimate_tokens
from .samples import Sample


def relative_errors(predicted: Sequence[float], actual: Sequence[float]) -> np.ndarray:
    """``|predicted - actual| / actual`` element-wise."""
    p = np.asarray(predicted, dtype=float)
    a = np.asarray(actual, dtype=float)
    return np.abs(p - a) / a


def error_summary(predicted: Sequence[float], actual: Sequence[float]) -> dict[str, float]:
    e = relative_errors(predicted, actual)
    return {
        "mean_relative_error": float(e.mean()),
        "median_relative_error": float(np.median(e)),
        "p90_relative_error": float(np.percentile(e, 90)),
    }


def measure_latency(predict: Callable[[str, Mapping[str, Any]], float], samples: Sequence[Sample],
                    min_calls: int = 300, max_seconds: float = 5.0) -> dict[str, float]:
    """Wall time of single predictions (one agent per call), in milliseconds.

    Cycles over ``samples`` after a warm-up pass until ``min_calls`` calls (or
    ``max_seconds``) have been timed.
    """
    for s in samples[: min(len(samples), 20)]:
        predict(s.prompt, s.features)
    times: list[float] = []
    deadline = time.perf_counter() + max_seconds
    i = 0
    while len(times) < max(min_calls, len(samples)) and time.perf_counter() < deadline:
        s = samples[i % len(samples)]
        t0 = time.perf_counter_ns()
        predict(s.prompt, s.features)
        times.append((time.perf_counter_ns() - t0) / 1e6)
        i += 1
    t = np.asarray(times)
    return {
        "p50_latency_ms": float(np.percentile(t, 50)),
        "p99_latency_ms": float(np.percentile(t, 99)),
        "mean_latency_ms": float(t.mean()),
        "latency_calls": int(t.size),
    }


def coverage(predictor: Predictor, samples: Sequence[Sample]) -> dict[str, float | None]:
    """Share of ``samples`` whose real cost is at most the predictor's p50 and p90
    (``None`` for a predictor whose interval is not its own: one without out-of-fold
    residuals in its metadata returns its point estimate twice)."""
    if not predictor.metadata.get("interval"):
        return {"p50_coverage": None, "p90_coverage": None}
    bounds = [predictor.predict_interval(s.prompt, s.features) for s in samples]
    costs = np.array([s.cost for s in samples])
    return {"p50_coverage": float(np.mean(costs <= np.array([b[0] for b in bounds]))),
            "p90_coverage": float(np.mean(costs <= np.array([b[1] for b in bounds])))}


def evaluate(predictor: Predictor, samples: Sequence[Sample], latency: bool = True) -> dict[str, Any]:
    """Relative error of ``predictor`` on ``samples``, its kind, the coverage of its p50 and
    p90 (the share of real costs at most each) and its per-call latency."""
    actual = [s.cost for s in samples]
    predicted = [predictor.predict(s.prompt, s.features) for s in samples]
    meta = predictor.metadata
    out: dict[str, Any] = {"n": len(samples), "kind": meta.get("kind", "mlp"), "model": meta.get("model"),
                           **error_summary(predicted, actual), **coverage(predictor, samples)}
    if latency:
        out.update(measure_latency(predictor.predict, samples))
    return out


# -- baselines ------------------------------------------------------------------------------

class MeanBaseline(PointPredictor):
    """Predicts the mean training cost for every agent."""

    name = "training mean"

    def fit(self, samples: Sequence[Sample]) -> MeanBaseline:
        self.mean_ = float(np.mean([s.cost for s in samples]))
        return self

    def predict(self, prompt: str, features: Features | None = None) -> float:
        return self.mean_


class MedianBaseline(PointPredictor):
    """Predicts the median training cost for every agent (what a per-type average gives
    when a few huge agents would skew the mean)."""

    name = "training median"

    def fit(self, samples: Sequence[Sample]) -> MedianBaseline:
        self.median_ = float(np.median([s.cost for s in samples]))
        return self

    def predict(self, prompt: str, features: Features | None = None) -> float:
        return self.median_


class LengthLinearBaseline(PointPredictor):
    """Least squares ``cost = a + b * prompt_tokens`` (estimated tokens of the prompt)."""

    name = "length-only linear"

    def fit(self, samples: Sequence[Sample]) -> LengthLinearBaseline:
        x = np.array([estimate_tokens(s.prompt) for s in samples], dtype=float)
        y = np.array([s.cost for s in samples], dtype=float)
        A = np.vstack([np.ones_like(x), x]).T
        (self.a_, self.b_), *_ = np.linalg.lstsq(A, y, rcond=None)
        self.floor_ = float(y.min())
        return self

    def predict(self, prompt: str, features: Features | None = None) -> float:
        # Clipped at the smallest training cost: a negative or zero prediction is meaningless.
        return max(self.floor_, float(self.a_ + self.b_ * estimate_tokens(prompt)))
