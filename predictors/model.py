"""The per-agent-type cost model: TF-IDF + numeric features -> a regressor on log-cost.

The regressor is one of three *kinds*, chosen per agent type by cross-validation
(:mod:`predictors.training`): ``mlp`` (below), ``ridge`` (a linear model on the same
features) or ``median`` (a constant: the type's median cost, the fallback when neither
model beats it). All three share the feature pipeline and the fast path.

::

    TransformedTargetRegressor(func=log1p, inverse_func=expm1,
      regressor=Pipeline([
        ("features", FeatureUnion([
            ("text",    Pipeline([("select", PromptText()), ("tfidf", TfidfVectorizer(...))])),
            ("numeric", Pipeline([("derive", NumericFeatures(names)), ("scale", StandardScaler())])),
        ])),
        ("mlp", MLPRegressor(hidden_layer_sizes=(h1, h1/2, h1/4), alpha=L2, solver="lbfgs")),
      ]))

Three hidden layers plus the output layer: the paper's 4-layer MLP. The first layer's width
scales with the agent type's average input size (see :func:`hidden_layers_for`). MSE on
``log1p(cost)`` with an L2 penalty ``alpha``: errors are relative, not absolute, so a handful
of huge agents does not dominate the fit.

:class:`CostPredictor` wraps the fitted estimator. Its :meth:`CostPredictor.predict` runs a
NumPy fast path (vocabulary lookup, idf, scaler, the MLP's matrices) compiled from the fitted
pipeline at load time; it computes the same number as the scikit-learn pipeline (tests check
this) without scikit-learn's per-call validation, so one prediction takes tens of
microseconds instead of about a millisecond.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.compose import TransformedTargetRegressor
from sklearn.dummy import DummyRegressor
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge
from sklearn.neural_network import MLPRegressor
from sklearn.pipeline import FeatureUnion, Pipeline
from sklearn.preprocessing import StandardScaler

from .features import NumericFeatures, PromptText, as_record

#: Default L2 penalty of the MLP.
DEFAULT_ALPHA = 3.0
#: Vocabulary cap of the TF-IDF (most frequent terms). It also bounds the MLP's first weight
#: matrix, hence the training time of L-BFGS.
MAX_TFIDF_FEATURES = 300
#: The regressors a type's model may use (see the module docstring).
KINDS = ("median", "ridge", "mlp")


def hidden_layers_for(avg_prompt_tokens: float, width: float = 1.0) -> tuple[int, int, int]:
    """Hidden layer widths for an agent type whose prompts average ``avg_prompt_tokens``.

    The first layer grows with the logarithm of the input size, 12 units per doubling
    (clipped to 32..192); the next two halve it: 100-token prompts give (80, 40, 20),
    10k-token prompts (159, 79, 39).
    ``width`` scales the first layer (the capacity that cross-validation chooses).
    """
    h1 = int(round(12 * width * math.log2(1.0 + max(avg_prompt_tokens, 0.0))))
    h1 = min(192, max(16 if width < 1.0 else 32, h1))
    return (h1, max(16, h1 // 2), max(8, h1 // 4))


def shifted_expm1(y, shift: float = 0.0):
    """Inverse of the log1p target with a log-space shift (the relative-error calibration)."""
    return np.expm1(np.asarray(y) + shift)


def build_model(
    numeric_names: Sequence[str],
    avg_prompt_tokens: float,
    n_samples: int,
    alpha: float = DEFAULT_ALPHA,
    random_state: int = 0,
    max_iter: int = 200,
    max_features: int = MAX_TFIDF_FEATURES,
    log_shift: float = 0.0,
    kind: str = "mlp",
    width: float = 1.0,
    words: bool = True,
) -> TransformedTargetRegressor:
    """An unfitted cost model of ``kind`` (see the module docstring); ``alpha`` is the L2
    penalty of the MLP or the ridge, ``width`` the MLP's capacity; without ``words``, no
    TF-IDF: the numeric features only (on a hundred samples, a vocabulary of hundreds of
    words can be more noise than signal)."""
    tfidf = TfidfVectorizer(
        sublinear_tf=True,
        min_df=2 if n_samples >= 40 else 1,
        max_features=max_features,
        lowercase=True,
        dtype=np.float64,
    )
    text: Any = Pipeline([("select", PromptText()), ("tfidf", tfidf)]) if words else "drop"
    features = FeatureUnion(
        [
            ("text", text),
            (
                "numeric",
                Pipeline([("derive", NumericFeatures(tuple(numeric_names))), ("scale", StandardScaler())]),
            ),
        ]
    )
    regressor: Any
    if kind == "mlp":
        regressor = MLPRegressor(
            hidden_layer_sizes=hidden_layers_for(avg_prompt_tokens, width),
            activation="relu",
            solver="lbfgs",
            alpha=alpha,
            max_iter=max_iter,
            random_state=random_state,
        )
    elif kind == "ridge":
        regressor = Ridge(alpha=alpha)
    elif kind == "median":
        regressor = DummyRegressor(strategy="median")
    else:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(KINDS)}")
    # The last step is named "mlp" whatever its kind: predictors saved before other kinds
    # existed are read by the same code.
    return TransformedTargetRegressor(
        regressor=Pipeline([("features", features), ("mlp", regressor)]),
        func=np.log1p,
        inverse_func=functools.partial(shifted_expm1, shift=log_shift),
        check_inverse=False,
    )


class _FastPath:
    """The fitted pipeline's arithmetic in plain NumPy, for one record at a time."""

    def __init__(self, model: TransformedTargetRegressor):
        pipe: Pipeline = model.regressor_
        union: FeatureUnion = pipe.named_steps["features"]
        text_pipe = dict(union.transformer_list)["text"]
        num_pipe = dict(union.transformer_list)["numeric"]
        self.analyzer: Any
        self.vocab: dict[str, int]
        if text_pipe == "drop":  # numeric features only: an empty vocabulary
            self.analyzer, self.vocab, self.idf = _no_words, {}, np.zeros(0)
            self.sublinear, self.norm, self.n_text = False, "l2", 0
        else:
            tfidf: TfidfVectorizer = text_pipe.named_steps["tfidf"]
            self.analyzer = tfidf.build_analyzer()
            self.vocab = tfidf.vocabulary_
            self.idf = tfidf.idf_
            self.sublinear = tfidf.sublinear_tf
            self.norm = tfidf.norm
            self.n_text = len(tfidf.vocabulary_)
        self.derive: NumericFeatures = num_pipe.named_steps["derive"]
        scaler: StandardScaler = num_pipe.named_steps["scale"]
        self.mean = scaler.mean_
        self.scale = scaler.scale_
        if self.norm != "l2":
            raise ValueError("fast path supports l2-normalised TF-IDF only")
        W0, self.b0, self.layers = _layers(pipe.named_steps["mlp"], self.n_text + len(self.mean))
        self.W0_text = W0[: self.n_text]
        self.W0_num = np.ascontiguousarray(W0[self.n_text :])
        self.inverse = model.inverse_func

    def __call__(self, prompt: str, features: Mapping[str, Any] | None) -> float:
        return float(self.inverse(self.log_cost(prompt, features)))

    def log_cost(self, prompt: str, features: Mapping[str, Any] | None) -> float:
        """The regressor's output: ``log1p`` of the cost, before calibration."""
        vocab = self.vocab
        idx_l, tf_l = [], []
        for term, c in Counter(self.analyzer(prompt)).items():
            j = vocab.get(term)
            if j is not None:
                idx_l.append(j)
                tf_l.append(c)
        h = self.b0.copy()
        if idx_l:
            idx = np.array(idx_l, dtype=np.intp)
            tf = np.array(tf_l, dtype=float)
            if self.sublinear:
                tf = 1.0 + np.log(tf)
            w = tf * self.idf[idx]
            w /= math.sqrt(float(w @ w))
            h += w @ self.W0_text[idx]
        x = np.asarray(self.derive.row(prompt, features), dtype=float)
        x = np.sign(x) * np.log1p(np.abs(x))
        x = (x - self.mean) / self.scale
        h += x @ self.W0_num
        for W, b in self.layers:
            np.maximum(h, 0.0, out=h)
            h = h @ W + b
        return float(h[0])


def _no_words(text: str) -> list[str]:
    return []


def _layers(reg: Any, n_inputs: int) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The regressor as (first weight matrix, its bias, the relu layers after it): an MLP's
    own; a ridge is one linear layer; the median a layer of zero weights."""
    if isinstance(reg, MLPRegressor):
        if reg.activation != "relu":
            raise ValueError("fast path supports relu MLPs only")
        return reg.coefs_[0], reg.intercepts_[0], list(zip(reg.coefs_[1:], reg.intercepts_[1:], strict=True))
    if isinstance(reg, Ridge):
        coef = np.asarray(reg.coef_, dtype=float).reshape(-1, 1)
        return coef, np.atleast_1d(np.asarray(reg.intercept_, dtype=float)).copy(), []
    if isinstance(reg, DummyRegressor):
        const = float(np.asarray(reg.constant_).ravel()[0])
        return np.zeros((n_inputs, 1)), np.array([const]), []
    raise ValueError(f"fast path does not support {type(reg).__name__}")


class CostPredictor:
    """A trained predictor of one agent type's total KV token-time cost (a
    :class:`~predictors.base.Predictor`).

    ``predict(prompt, features)`` returns the predicted cost of one agent, in token-time
    units: the sum over its requests of ``p*d + d*(d+1)/2``.
    """

    is_cold_start = False

    def __init__(self, model: TransformedTargetRegressor, metadata: Mapping[str, Any]):
        self.model = model
        self.metadata = dict(metadata)
        self.agent_type: str = str(self.metadata.get("agent_type", ""))
        self._fast = _FastPath(model)

    @property
    def kind(self) -> str:
        """The regressor cross-validation chose: ``mlp``, ``ridge`` or ``median``."""
        return str(self.metadata.get("kind", "mlp"))

    def predict(self, prompt: str, features: Mapping[str, Any] | None = None) -> float:
        """Predicted cost of one agent with this prompt text and these numeric features."""
        return max(1.0, self._fast(prompt or "", features))

    def predict_interval(self, prompt: str, features: Mapping[str, Any] | None = None) -> tuple[float, float]:
        """``(p50, p90)``: the cost this agent stays under with probability 0.5 and 0.9,
        from the quantiles of the model's out-of-fold log residuals (metadata
        ``interval``). A predictor without them (trained before intervals existed) returns
        its point prediction twice."""
        interval = self.metadata.get("interval") or {}
        if "p50_log_offset" not in interval:
            point = self.predict(prompt, features)
            return point, point
        h = self._fast.log_cost(prompt or "", features)
        p50 = float(np.expm1(h + float(interval["p50_log_offset"])))
        p90 = float(np.expm1(h + float(interval["p90_log_offset"])))
        return max(1.0, p50), max(1.0, p50, p90)

    def predict_many(self, records: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Batch prediction through the scikit-learn pipeline (records: prompt + features)."""
        X = [as_record(r["prompt"], r.get("features")) for r in records]
        return np.maximum(1.0, self.model.predict(X))

    def __repr__(self) -> str:
        return f"CostPredictor(agent_type={self.agent_type!r}, samples={self.metadata.get('sample_count')})"
