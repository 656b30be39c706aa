"""Cost predictors: per-agent-type models of an agent's total KV token-time cost (median,
ridge or TF-IDF + MLP, chosen by cross-validation, with a p50/p90 interval), the cold start,
and the server's online retraining (``predictors.online``).

Public surface::

    from predictors import load_predictor, PredictorRegistry, ColdStartEstimator
    p = load_predictor("models/mapreduce_summary")
    p.predict(prompt, {"n_items": 4})   # -> float, token-time units
    p.predict_interval(prompt, {"n_items": 4})   # -> (p50, p90)
    p.agent_type, p.metadata

Importing this package is cheap; scikit-learn loads with the first model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "load_predictor",
    "save_predictor",
    "PredictorLoadError",
    "PredictorRegistry",
    "ColdStartEstimator",
    "ColdStartPredictor",
    "CostPredictor",
    "Sample",
    "SampleError",
    "read_samples",
    "train_predictor",
    "evaluate",
    "estimate_tokens",
]

_WHERE = {
    "load_predictor": "persistence",
    "save_predictor": "persistence",
    "PredictorLoadError": "persistence",
    "PredictorRegistry": "registry",
    "ColdStartEstimator": "cold_start",
    "ColdStartPredictor": "cold_start",
    "CostPredictor": "model",
    "Sample": "samples",
    "SampleError": "samples",
    "read_samples": "samples",
    "train_predictor": "training",
    "evaluate": "evaluation",
    "estimate_tokens": "prompt_features",
}

if TYPE_CHECKING:  # pragma: no cover
    from .cold_start import ColdStartEstimator, ColdStartPredictor
    from .evaluation import evaluate
    from .model import CostPredictor
    from .persistence import PredictorLoadError, load_predictor, save_predictor
    from .prompt_features import estimate_tokens
    from .registry import PredictorRegistry
    from .samples import Sample, SampleError, read_samples
    from .training import train_predictor


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'predictors' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
