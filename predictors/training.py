"""Training a per-type predictor: split, fit, validate against the baselines."""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cold_start import ColdStartEstimator
from .evaluation import LengthLinearBaseline, MeanBaseline, error_summary
from .features import NumericFeatures, as_record, estimate_tokens, numeric_feature_names
from .model import DEFAULT_ALPHA, CostPredictor, build_model, hidden_layers_for
from .samples import Sample, SampleError

#: Fewest samples of one agent type that training accepts (the paper profiles >= 100 runs).
MIN_SAMPLES = 20
#: Below this many samples the report warns that the model will be rough.
RECOMMENDED_SAMPLES = 100
VALIDATION_FRACTION = 0.2
#: Largest calibration shift in log space (a factor of exp(-0.7) ~ 0.5).
MAX_LOG_SHIFT = 0.7


@dataclass
class TrainResult:
    predictor: CostPredictor
    report: dict[str, Any] = field(default_factory=dict)
    #: The samples held out from training and validated on (kept with the model).
    heldout: list[Sample] = field(default_factory=list)


def split(samples: Sequence[Sample], fraction: float = VALIDATION_FRACTION, seed: int = 0):
    """Shuffled train / held-out split (at least one held-out sample)."""
    idx = np.random.default_rng(seed).permutation(len(samples))
    n_val = max(1, int(round(len(samples) * fraction)))
    val = [samples[i] for i in idx[:n_val]]
    train = [samples[i] for i in idx[n_val:]]
    return train, val


def log_residual_variance(records: Sequence[dict], y: np.ndarray, names: Sequence[str], ridge: float = 1e-2) -> float:
    """Leave-one-out residual variance of a log-linear ridge model on the numeric features.

    A cheap (closed-form, no refitting) estimate of how uncertain a log-cost prediction of
    this agent type is.
    """
    derive = NumericFeatures(tuple(names)).fit(records)
    Z = derive.transform(records)
    Z = np.hstack([np.ones((len(Z), 1)), (Z - Z.mean(0)) / np.where(Z.std(0) > 0, Z.std(0), 1.0)])
    t = np.log1p(y)
    R = ridge * np.eye(Z.shape[1])
    R[0, 0] = 0.0
    G = np.linalg.pinv(Z.T @ Z + R)
    h = np.einsum("ij,jk,ik->i", Z, G, Z)
    resid = t - Z @ (G @ (Z.T @ t))
    loo = resid / np.clip(1.0 - h, 1e-3, None)
    return float(np.mean(loo**2))


def fit_predictor(samples: Sequence[Sample], agent_type: str, alpha: float = DEFAULT_ALPHA,
                  seed: int = 0, calibrate: bool = True,
                  extra_metadata: dict[str, Any] | None = None) -> CostPredictor:
    """Fit the model on ``samples`` (no validation) and wrap it as a predictor.

    With ``calibrate``, predictions are multiplied by ``exp(-s2)``, ``s2`` the log-cost
    residual variance (:func:`log_residual_variance`, capped at :data:`MAX_LOG_SHIFT`): under
    log-normal noise this turns the model's geometric-mean prediction into the value that
    minimises the expected relative error ``|pred - actual| / actual``.
    """
    records = [s.record() for s in samples]
    y = np.array([s.cost for s in samples], dtype=float)
    names = numeric_feature_names(records)
    avg_tokens = float(np.mean([estimate_tokens(s.prompt) for s in samples]))
    s2 = log_residual_variance(records, y, names) if calibrate else 0.0
    shift = -min(MAX_LOG_SHIFT, s2)
    model = build_model(names, avg_tokens, len(samples), alpha=alpha, random_state=seed, log_shift=shift)
    t0 = time.perf_counter()
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    # Tiny matrices: BLAS threads only add contention (7x slower on a busy 2-core machine).
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit([as_record(r["prompt"], r["features"]) for r in records], y)
    train_seconds = time.perf_counter() - t0
    tfidf = model.regressor_.named_steps["features"].transformer_list[0][1].named_steps["tfidf"]
    meta = {
        "agent_type": agent_type,
        "kind": "mlp",
        "feature_set": {
            "text": "tfidf(sublinear_tf, l2, lowercase, unigrams)",
            "vocabulary_size": len(tfidf.vocabulary_),
            "text_features": ["prompt_tokens", "prompt_words", "prompt_lines"],
            "numeric_features": names,
            "transform": "log1p then standard scaling",
        },
        "target": "log1p(cost), cost = sum over requests of p*d + d*(d+1)/2",
        "hidden_layers": list(hidden_layers_for(avg_tokens)),
        "alpha": alpha,
        "calibration": {"log_residual_variance": s2, "log_shift": shift, "factor": float(np.exp(shift))},
        "avg_prompt_tokens": avg_tokens,
        "train_count": len(samples),
        "sample_count": len(samples),
        "train_seconds": train_seconds,
        "seed": seed,
        "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    meta.update(extra_metadata or {})
    return CostPredictor(model, meta)


def _score(predict, samples: Sequence[Sample]) -> dict[str, float]:
    return error_summary([predict(s.prompt, s.features) for s in samples], [s.cost for s in samples])


def train_predictor(samples: Sequence[Sample], agent_type: str, *, alpha: float = DEFAULT_ALPHA,
                    seed: int = 0, validation_fraction: float = VALIDATION_FRACTION,
                    global_baseline: bool = True, calibrate: bool = True) -> TrainResult:
    """Train the predictor of ``agent_type`` on its samples and validate it on a held-out 20%.

    ``samples`` may hold several agent types: the predictor uses only ``agent_type``'s; the
    others (if any) feed the "one global model" baseline. The returned report holds the
    held-out errors of the MLP, of the baselines (training mean, global model, length-only
    linear) and of the cold start fed with the training samples.
    """
    own = [s for s in samples if s.agent_type == agent_type]
    if not own:
        types = sorted({s.agent_type for s in samples})
        raise SampleError(f"no samples of agent type {agent_type!r}; types present: {', '.join(types) or 'none'}")
    if len(own) < MIN_SAMPLES:
        raise SampleError(
            f"only {len(own)} samples of agent type {agent_type!r}; training needs at least {MIN_SAMPLES} "
            f"(>= {RECOMMENDED_SAMPLES} recommended): profile more runs"
        )
    train, val = split(own, validation_fraction, seed)
    predictor = fit_predictor(train, agent_type, alpha=alpha, seed=seed, calibrate=calibrate)
    train_seconds = predictor.metadata["train_seconds"]

    mlp = _score(predictor.predict, val)
    baselines: dict[str, dict[str, float] | None] = {}
    baselines["mean"] = _score(MeanBaseline().fit(train).predict, val)
    baselines["length_linear"] = _score(LengthLinearBaseline().fit(train).predict, val)
    others = [s for s in samples if s.agent_type != agent_type]
    if global_baseline and others:
        # One model for all types: same architecture, trained on every type's samples
        # except this type's held-out ones, blind to the agent type.
        glob = fit_predictor(train + others, "*", alpha=alpha, seed=seed, calibrate=calibrate)
        baselines["global"] = _score(glob.predict, val)
    else:
        baselines["global"] = None
    cold = ColdStartEstimator()
    for s in train:
        cold.observe(agent_type, s.prompt, s.cost, s.features)
    cold_start = _score(lambda p, f: cold.predict(agent_type, p, f), val)

    validation = {"count": len(val), **mlp}
    predictor.metadata.update(
        sample_count=len(own),
        train_count=len(train),
        validation_count=len(val),
        validation=validation,
        baselines=baselines,
        cold_start=cold_start,
    )
    report = {
        "agent_type": agent_type,
        "samples": len(own),
        "train": len(train),
        "validation": len(val),
        "train_seconds": train_seconds,
        "mlp": mlp,
        "baselines": baselines,
        "cold_start": cold_start,
        "hidden_layers": predictor.metadata["hidden_layers"],
        "warning": None,
    }
    warnings_ = []
    if len(own) < RECOMMENDED_SAMPLES:
        warnings_.append(f"only {len(own)} samples; >= {RECOMMENDED_SAMPLES} recommended")
    beaten = [k for k, v in {**baselines, "cold_start": cold_start}.items()
              if v is not None and v["mean_relative_error"] < mlp["mean_relative_error"]]
    if beaten:
        warnings_.append(
            f"on these {len(val)} held-out runs the MLP's mean error is above that of: {', '.join(beaten)} "
            "(costs of this type may follow the prompt length closely, or the held-out set is small); "
            "profile more runs"
        )
    report["warning"] = "; ".join(warnings_) or None
    return TrainResult(predictor, report, heldout=list(val))
