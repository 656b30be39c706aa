"""The model's input transformers: a list of records (``{"prompt": str, "features": dict}``,
:mod:`predictors.prompt_features`) turned into numbers:

* :class:`PromptText` picks the prompt text (for TF-IDF);
* :class:`NumericFeatures` takes the text features of the prompt
  (:data:`~predictors.prompt_features.TEXT_FEATURES`) and adds the caller's numeric features
  (for instance ``n_items`` or ``fan_out``), each ``log1p``-scaled. Features missing from a
  record count as 0.

They live here, apart from the features themselves, because they need scikit-learn; saved
models refer to them by this module's name. The features are re-exported for the callers
that train models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin

from .prompt_features import (
    LEGACY_TEXT_FEATURES,
    METADATA_FEATURES,
    OUTCOME_FEATURES,
    TEXT_FEATURES,
    as_record,
    estimate_tokens,
    numeric_feature_names,
    submission_features,
    text_features,
)

__all__ = [
    "LEGACY_TEXT_FEATURES",
    "METADATA_FEATURES",
    "OUTCOME_FEATURES",
    "TEXT_FEATURES",
    "as_record",
    "estimate_tokens",
    "numeric_feature_names",
    "submission_features",
    "text_features",
    "NumericFeatures",
    "PromptText",
]


def _prompts(X: Sequence[Mapping[str, Any]]) -> list[str]:
    return [r["prompt"] for r in X]


class PromptText(BaseEstimator, TransformerMixin):
    """Selects the prompt text of every record (the input of the TF-IDF vectorizer)."""

    def fit(self, X, y=None):
        return self

    def transform(self, X):
        return _prompts(X)


class NumericFeatures(BaseEstimator, TransformerMixin):
    """Length features of the prompt plus the named caller features, ``log1p``-scaled.

    ``names`` is fixed at construction (the training samples' feature set), so a record with
    extra features is accepted and the extras are ignored; missing ones count as 0.
    """

    def __init__(self, names: Sequence[str] = ()):
        self.names = names

    def fit(self, X, y=None):
        self.text_names_ = list(TEXT_FEATURES)
        self.columns_ = self.text_names_ + list(self.names)
        return self

    def row(self, prompt: str, features: Mapping[str, Any] | None) -> list[float]:
        values = text_features(prompt)
        feats = features or {}
        out = [values[k] for k in getattr(self, "text_names_", LEGACY_TEXT_FEATURES)]
        for k in self.names:
            v = feats.get(k, 0.0)
            try:
                v = float(v)
            except (TypeError, ValueError):
                v = 0.0
            out.append(v if math.isfinite(v) else 0.0)
        return out

    def transform(self, X):
        arr = np.array([self.row(r["prompt"], r.get("features")) for r in X], dtype=float)
        return np.sign(arr) * np.log1p(np.abs(arr))

    def get_feature_names_out(self, input_features=None):
        return np.array(self.columns_, dtype=object)
