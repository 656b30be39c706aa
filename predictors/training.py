"""Training a per-type predictor: split, fit, validate against the baselines."""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cold_start import ColdStartEstimator
from .evaluation import LengthLinearBaseline, MeanBaseline, MedianBaseline, coverage, error_summary
from .features import TEXT_FEATURES, NumericFeatures, as_record, estimate_tokens, numeric_feature_names
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


@dataclass(frozen=True)
class Candidate:
    """One regressor configuration cross-validation may choose (see :data:`CANDIDATES`)."""

    kind: str
    alpha: float = DEFAULT_ALPHA
    width: float = 1.0
    words: bool = True  # TF-IDF of the prompt's words besides the numeric features

    @property
    def name(self) -> str:
        if self.kind == "median":
            return "median"
        if self.kind == "ridge":
            return f"ridge(alpha={self.alpha:g}{'' if self.words else ', numeric only'})"
        return f"mlp(alpha={self.alpha:g}, width={self.width:g})"


#: What cross-validation chooses from, simplest first: the median, ridges on the numeric
#: features alone and with the prompt's words (two penalties each), two MLP capacities (a
#: narrow, strongly penalised one and the paper's width).
CANDIDATES = (
    Candidate("median"),
    Candidate("ridge", alpha=3.0, words=False),
    Candidate("ridge", alpha=0.3, words=False),
    Candidate("ridge", alpha=10.0),
    Candidate("ridge", alpha=1.0),
    Candidate("mlp", alpha=10.0, width=0.5),
    Candidate("mlp", alpha=DEFAULT_ALPHA, width=1.0),
)
#: Fewest training samples with which MLPs are candidates: with fewer, an MLP of thousands of
#: weights fits noise, and cross-validating it costs seconds (the online retraining's budget).
MIN_MLP_SAMPLES = 50
#: A more complex candidate must cut the cross-validated mean relative error by this much
#: (relative) to be chosen over a simpler one: on a few dozen samples smaller wins are noise.
COMPLEXITY_MARGIN = 0.03
#: ... and by this many standard errors of the paired per-sample difference: the best of
#: several candidates scored on the same hundred samples wins by luck more often than a
#: one-standard-error rule allows for (about two standard errors make a 5% test).
SELECTION_Z = 2.0
CV_FOLDS = 5
#: Quantiles of the out-of-fold log residuals that make the interval.
INTERVAL_QUANTILES = (0.5, 0.9)
_SHIFTS = np.linspace(-MAX_LOG_SHIFT, MAX_LOG_SHIFT, 141)


def _fit(candidate: Candidate, records: list[dict[str, Any]], y: np.ndarray, names: Sequence[str],
         avg_tokens: float, seed: int, log_shift: float = 0.0):
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    model = build_model(names, avg_tokens, len(records), alpha=candidate.alpha, random_state=seed,
                        log_shift=log_shift, kind=candidate.kind, width=candidate.width, words=candidate.words)
    # Tiny matrices: BLAS threads only add contention (7x slower on a busy 2-core machine).
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit([as_record(r["prompt"], r["features"]) for r in records], y)
    return model


def _raw_log_outputs(model, records: list[dict[str, Any]]) -> np.ndarray:
    """The regressor's outputs (``log1p`` cost, before calibration) for ``records``."""
    return np.asarray(model.regressor_.predict(records), dtype=float).ravel()


def best_shift(h: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The log-space shift ``s`` minimising the mean of ``|expm1(h + s) - y| / y``, and
    that mean: the calibration that makes a geometric-mean prediction the one of least
    expected relative error (searched over +-``MAX_LOG_SHIFT``)."""
    shift, errors = _best_shift_and_errors(h, y)
    return shift, float(errors.mean())


def _best_shift_and_errors(h: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """`best_shift`'s shift and the per-sample relative errors it leaves."""
    errors = np.abs(np.expm1(h[None, :] + _SHIFTS[:, None]) - y[None, :]) / y[None, :]
    i = int(np.argmin(errors.mean(axis=1)))
    return float(_SHIFTS[i]), errors[i]


def cross_validate(records: list[dict[str, Any]], y: np.ndarray, names: Sequence[str], avg_tokens: float,
                   seed: int, candidates: Sequence[Candidate] = CANDIDATES) -> dict[str, dict[str, Any]]:
    """Out-of-fold log outputs of every candidate (``CV_FOLDS`` folds, fewer for a few
    samples), with the calibrated mean relative error each achieves."""
    folds = min(CV_FOLDS, max(2, len(records) // 8))
    order = np.random.default_rng(seed + 1).permutation(len(records))
    parts = np.array_split(order, folds)
    out: dict[str, dict[str, Any]] = {}
    for c in candidates:
        h = np.empty(len(records))
        for k in range(folds):
            test = parts[k]
            train = np.concatenate([parts[j] for j in range(folds) if j != k])
            model = _fit(c, [records[i] for i in train], y[train], names, avg_tokens, seed)
            h[test] = _raw_log_outputs(model, [records[i] for i in test])
        shift, errors = _best_shift_and_errors(h, y)
        out[c.name] = {"candidate": c, "oof": h, "shift": shift, "errors": errors,
                       "mean_relative_error": float(errors.mean())}
    return out


def _clearly_better(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """Whether ``new``'s cross-validated errors beat ``old``'s by :data:`COMPLEXITY_MARGIN`
    (relative) and by :data:`SELECTION_Z` standard errors of their per-sample difference
    (paired: both were scored on the same out-of-fold samples)."""
    gain = old["mean_relative_error"] - new["mean_relative_error"]
    if gain <= old["mean_relative_error"] * COMPLEXITY_MARGIN:
        return False
    diff = np.asarray(old["errors"]) - np.asarray(new["errors"])
    return bool(gain > SELECTION_Z * diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else True


def choose(cv: dict[str, dict[str, Any]]) -> str:
    """The candidate to use: the lowest cross-validated error, but a more complex one only
    where it is clearly better than every simpler one (`_clearly_better`). Of seven
    candidates scored on a hundred samples, one often wins by luck: a ridge on the prompt's
    words (pure noise for a fan-out agent, whose cost follows its declared width) won by
    0.02 on one training set in ten and scored 0.37 on fresh agents, where the numeric
    ridge scored 0.34 (docs/predictors.md)."""
    best = None
    for name, row in cv.items():  # simplest first
        if best is None or _clearly_better(row, cv[best]):
            best = name
    assert best is not None
    return best


def fit_predictor(samples: Sequence[Sample], agent_type: str, alpha: float | None = None,
                  seed: int = 0, calibrate: bool = True,
                  extra_metadata: dict[str, Any] | None = None,
                  candidate: Candidate | None = None) -> CostPredictor:
    """Fit a model on ``samples`` and wrap it as a predictor.

    Without ``candidate``, the regressor is chosen by cross-validation among
    :data:`CANDIDATES` (only MLPs of that penalty where ``alpha`` is given, plus the median
    and ridge fallbacks; no MLP below :data:`MIN_MLP_SAMPLES` samples); the chosen one's
    out-of-fold residuals give the calibration (the shift of least mean relative error,
    :func:`best_shift`) and the p50/p90 interval. With
    ``candidate`` (the global baseline), no cross-validation: the calibration is the
    closed-form one of :func:`log_residual_variance` and there is no interval.
    """
    records = [s.record() for s in samples]
    y = np.array([s.cost for s in samples], dtype=float)
    names = numeric_feature_names(records)
    avg_tokens = float(np.mean([estimate_tokens(s.prompt) for s in samples]))
    t0 = time.perf_counter()
    selection: dict[str, Any] | None = None
    interval: dict[str, Any] | None = None
    if candidate is None:
        grid = CANDIDATES if alpha is None else (
            *[c for c in CANDIDATES if c.kind != "mlp"], Candidate("mlp", alpha=alpha))
        if len(samples) < MIN_MLP_SAMPLES:
            grid = tuple(c for c in grid if c.kind != "mlp")
        cv = cross_validate(records, y, names, avg_tokens, seed, grid)
        chosen = choose(cv)
        candidate = cv[chosen]["candidate"]
        shift = cv[chosen]["shift"] if calibrate else 0.0
        residuals = np.log1p(y) - cv[chosen]["oof"]
        q50, q90 = (float(np.quantile(residuals, q)) for q in INTERVAL_QUANTILES)
        interval = {"p50_log_offset": q50, "p90_log_offset": q90, "from": "out-of-fold log residuals"}
        selection = {"chosen": chosen, "folds": min(CV_FOLDS, max(2, len(records) // 8)),
                     "cv_mean_relative_error": {k: v["mean_relative_error"] for k, v in cv.items()}}
        s2 = float(np.var(residuals))
    else:
        s2 = log_residual_variance(records, y, names) if calibrate else 0.0
        shift = -min(MAX_LOG_SHIFT, s2)
    model = _fit(candidate, records, y, names, avg_tokens, seed, log_shift=shift)
    train_seconds = time.perf_counter() - t0
    text = model.regressor_.named_steps["features"].transformer_list[0][1]
    vocabulary = 0 if text == "drop" else len(text.named_steps["tfidf"].vocabulary_)
    meta = {
        "agent_type": agent_type,
        "kind": candidate.kind,
        "model": candidate.name,
        "model_selection": selection,
        "feature_set": {
            "text": "tfidf(sublinear_tf, l2, lowercase, unigrams)" if candidate.words else None,
            "vocabulary_size": vocabulary,
            "text_features": list(TEXT_FEATURES),
            "numeric_features": names,
            "transform": "log1p then standard scaling",
        },
        "target": "log1p(cost), cost = sum over requests of p*d + d*(d+1)/2",
        "hidden_layers": list(hidden_layers_for(avg_tokens, candidate.width)) if candidate.kind == "mlp" else None,
        "alpha": candidate.alpha if candidate.kind != "median" else None,
        "calibration": {"log_residual_variance": s2, "log_shift": shift, "factor": float(np.exp(shift))},
        "interval": interval,
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


def train_predictor(samples: Sequence[Sample], agent_type: str, *, alpha: float | None = None,
                    seed: int = 0, validation_fraction: float = VALIDATION_FRACTION,
                    global_baseline: bool = True, calibrate: bool = True) -> TrainResult:
    """Train the predictor of ``agent_type`` on its samples and validate it on a held-out 20%.

    ``samples`` may hold several agent types: the predictor uses only ``agent_type``'s; the
    others (if any) feed the "one global model" baseline. The returned report holds the
    held-out errors of the chosen model (``model``; its kind in ``kind``) and its p50/p90
    coverage, of the baselines (training mean and median, global model, length-only
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

    model: dict[str, Any] = {**_score(predictor.predict, val), **coverage(predictor, val)}
    baselines: dict[str, dict[str, float] | None] = {}
    baselines["mean"] = _score(MeanBaseline().fit(train).predict, val)
    baselines["median"] = _score(MedianBaseline().fit(train).predict, val)
    baselines["length_linear"] = _score(LengthLinearBaseline().fit(train).predict, val)
    others = [s for s in samples if s.agent_type != agent_type]
    if global_baseline and others:
        # One model for all types: the paper's MLP, trained on every type's samples except
        # this type's held-out ones, blind to the agent type.
        glob = fit_predictor(train + others, "*", seed=seed, calibrate=calibrate,
                             candidate=Candidate("mlp", alpha=alpha or DEFAULT_ALPHA))
        baselines["global"] = _score(glob.predict, val)
    else:
        baselines["global"] = None
    cold = ColdStartEstimator()
    for s in train:
        cold.observe(agent_type, s.prompt, s.cost, s.features)
    cold_start = _score(cold.for_type(agent_type).predict, val)

    predictor.metadata.update(
        sample_count=len(own),
        train_count=len(train),
        validation_count=len(val),
        validation={"count": len(val), **model},
        baselines=baselines,
        cold_start=cold_start,
    )
    report = {
        "agent_type": agent_type,
        "samples": len(own),
        "train": len(train),
        "validation": len(val),
        "train_seconds": train_seconds,
        "kind": predictor.kind,
        "model_name": predictor.metadata["model"],
        "model_selection": predictor.metadata["model_selection"],
        "model": model,
        "baselines": baselines,
        "cold_start": cold_start,
        "hidden_layers": predictor.metadata["hidden_layers"],
        "warning": None,
    }
    report["warning"] = _warning(len(own), len(val), model, {**baselines, "cold_start": cold_start})
    return TrainResult(predictor, report, heldout=list(val))


def _warning(n: int, n_val: int, model: dict[str, Any], others: dict[str, dict[str, float] | None]) -> str | None:
    warnings_ = []
    if n < RECOMMENDED_SAMPLES:
        warnings_.append(f"only {n} samples; >= {RECOMMENDED_SAMPLES} recommended")
    beaten = [k for k, v in others.items()
              if v is not None and v["mean_relative_error"] < model["mean_relative_error"]]
    if beaten:
        warnings_.append(
            f"on these {n_val} held-out runs the model's mean error is above that of: {', '.join(beaten)} "
            "(costs of this type may follow the prompt length closely, or the held-out set is small); "
            "profile more runs"
        )
    return "; ".join(warnings_) or None
