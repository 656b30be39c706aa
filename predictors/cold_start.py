"""Cost estimates for agent types that have no trained predictor yet.

**The prior** of a type never seen is built from the agent itself, never from other types:
its requests are its declared ``stages`` times ``fan_out`` (1 each when not declared), each
with the agent's prompt (``P`` estimated tokens) and ``d`` output tokens, so the cost is
``requests * (P*d + d*(d+1)/2)``. ``d`` is the declared ``max_tokens`` feature, else the
declared ``critical_path_tokens / stages``, else ``default_output_tokens`` (256). Agents of
other types never move it: otherwise three 8-token agents of one type would set ``d`` for
every type not seen yet, and an agent that goes on to cost 100,000 would be predicted 200.

**Observations of the type** (:meth:`ColdStartEstimator.observe`) feed a per-type log-log
ridge regression ``log cost = a + b * log(1 + P)`` whose slope is pulled towards 1 (cost
proportional to prompt size) with ``prior_strength`` pseudo-observations; six running sums
per type, so ``observe`` and ``estimate`` are O(1) (a few microseconds). The estimate blends
the regression into the prior gradually, in log space, with weight ``n^2 / (n^2 + k^2)`` for
``n`` observations (``k = blend_observations``, 3: weights 0.1, 0.31, 0.5, 0.64 after 1-4
agents, 0.92 after 10, 0.98 after 20): a few agents, perhaps unrepresentative, do not
decide a type's cost by themselves.

:meth:`ColdStartPredictor.predict_interval` (``estimator.for_type(t)``) gives ``(p50, p90)``:
the estimate, and the estimate times ``exp(1.28 sigma)``. ``sigma`` combines the spread of the type's agents about
their regression (shrunk towards the prior's) with the uncertainty of the estimate's level:
the prior's share of it while the prior weighs, the regression's standard error as
observations come in. Before any observation ``sigma`` is ``prior_log_sigma`` (1.0: a factor
of 3.6 between p50 and p90); it narrows as a type's agents show consistent costs, and stays
wide for a type whose costs scatter. The server's promises allow for the p90
(docs/concepts.md, "The deadline promised at registration").
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from .prompt_features import estimate_tokens

_Z90 = NormalDist().inv_cdf(0.9)


@dataclass
class _Stats:
    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y
        self.syy += y * y


class ColdStartEstimator:
    """Online per-type cost estimates from the agent's prompt, its declared shape and the
    observed costs of its type."""

    def __init__(self, default_output_tokens: float = 256.0, prior_strength: float = 2.0,
                 max_log_slope: float = 3.0, prior_log_sigma: float = 1.0,
                 blend_observations: float = 3.0):
        self.default_output_tokens = float(default_output_tokens)
        self.prior_strength = float(prior_strength)
        self.max_log_slope = float(max_log_slope)
        self.prior_log_sigma = float(prior_log_sigma)
        self.blend_observations = float(blend_observations)
        self._stats: dict[str, _Stats] = {}
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------------
    def observations(self, agent_type: str) -> int:
        """How many completed agents of ``agent_type`` have been observed."""
        s = self._stats.get(agent_type)
        return s.n if s else 0

    def observation_weight(self, n: int) -> float:
        """The weight of a type's own ``n`` observations against the prior: n^2/(n^2+k^2)."""
        k2 = self.blend_observations ** 2
        return n * n / (n * n + k2) if n > 0 else 0.0

    def prior(self, prompt: str, features: Mapping[str, Any] | None = None) -> float:
        """The cost of an agent of a type never seen: its declared requests (``stages`` x
        ``fan_out``, 1 each by default) of the prompt's tokens and ``d`` output tokens each
        (declared ``max_tokens``, else ``critical_path_tokens / stages``, else
        ``default_output_tokens``)."""
        tokens = _prompt_tokens(prompt, features)
        f = features or {}
        stages = _declared(f, "stages", 1.0)
        requests = stages * _declared(f, "fan_out", 1.0)
        d = _declared(f, "max_tokens", 0.0)
        if d <= 0:
            cp = _declared(f, "critical_path_tokens", 0.0)
            d = cp / stages if cp > 0 else self.default_output_tokens
        return max(1.0, requests * (tokens * d + d * (d + 1.0) / 2.0))

    def for_type(self, agent_type: str) -> ColdStartPredictor:
        """The estimates of ``agent_type`` as a :class:`~predictors.base.Predictor`."""
        return ColdStartPredictor(self, agent_type)

    def estimate(self, agent_type: str, prompt: str,
                 features: Mapping[str, Any] | None = None) -> tuple[float, float]:
        """The estimated total cost of an agent of ``agent_type`` with this prompt, and the
        uncertainty of that estimate (sigma of log cost; see the module)."""
        prior = math.log(self.prior(prompt, features))
        # The prior's uncertainty, split evenly between the spread of agents about a type's
        # typical cost and the uncertainty of where that typical cost lies.
        part = self.prior_log_sigma / math.sqrt(2.0)
        s = self._stats.get(agent_type)
        if s is None or s.n == 0:
            return math.exp(prior), self.prior_log_sigma
        x = math.log1p(_prompt_tokens(prompt, features))
        n = s.n
        mx, my = s.sx / n, s.sy / n
        cxx = s.sxx - n * mx * mx
        cxy = s.sxy - n * mx * my
        cyy = s.syy - n * my * my
        lam = self.prior_strength
        b = (cxy + lam * 1.0) / (cxx + lam)
        b = min(self.max_log_slope, max(0.0, b))
        # residuals about the fitted line; the intercept took one degree of freedom
        sse = max(0.0, cyy - 2.0 * b * cxy + b * b * cxx)
        spread = math.sqrt((lam * part ** 2 + sse) / (lam + n - 1))
        w = self.observation_weight(n)
        level = (1.0 - w) * part + w * spread / math.sqrt(n)
        estimate = w * (my + b * (x - mx)) + (1.0 - w) * prior
        return max(1.0, math.exp(estimate)), math.sqrt(spread ** 2 + level ** 2)

    # -- updates -------------------------------------------------------------------------
    def observe(self, agent_type: str, prompt: str, cost: float, features: Mapping[str, Any] | None = None) -> None:
        """Record a completed agent of ``agent_type`` whose real cost was ``cost``. It moves
        the estimates of its own type only."""
        if not (isinstance(cost, (int, float)) and math.isfinite(cost) and cost > 0):
            return
        x = math.log1p(_prompt_tokens(prompt, features))
        y = math.log(cost)
        with self._lock:
            self._stats.setdefault(agent_type, _Stats()).add(x, y)


class ColdStartPredictor:
    """The :class:`~predictors.base.Predictor` of one agent type, backed by a
    :class:`ColdStartEstimator`."""

    is_cold_start = True

    def __init__(self, estimator: ColdStartEstimator, agent_type: str):
        self.estimator = estimator
        self.agent_type = agent_type

    @property
    def metadata(self) -> dict[str, Any]:
        return {"agent_type": self.agent_type, "kind": "cold_start",
                "observations": self.estimator.observations(self.agent_type)}

    def predict(self, prompt: str, features: Mapping[str, Any] | None = None) -> float:
        """Estimated total cost of an agent of this type with this prompt."""
        return self.estimator.estimate(self.agent_type, prompt, features)[0]

    def predict_interval(self, prompt: str, features: Mapping[str, Any] | None = None) -> tuple[float, float]:
        """``(p50, p90)`` of the agent's total cost: the estimate, and the estimate times
        ``exp(1.28 sigma)``, ``sigma`` the uncertainty of the estimate (see the module)."""
        estimate, sigma = self.estimator.estimate(self.agent_type, prompt, features)
        return estimate, estimate * math.exp(_Z90 * sigma)

    def observe(self, prompt: str, cost: float, features: Mapping[str, Any] | None = None) -> None:
        self.estimator.observe(self.agent_type, prompt, cost, features)


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _declared(features: Mapping[str, Any], name: str, default: float) -> float:
    """A declared positive number of the agent's features (a bad value: the default)."""
    v = features.get(name)
    return float(v) if isinstance(v, (int, float)) and _positive(v) else default


def _prompt_tokens(prompt: str, features: Mapping[str, Any] | None) -> float:
    # Always the text's own estimate: features["prompt_tokens"], where the server or the
    # profiler records it, is the sum over the agent's requests, known only afterwards.
    return float(estimate_tokens(prompt or ""))
