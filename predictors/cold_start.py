"""Cost estimates for agent types that have no trained predictor yet.

Before any agent of a type has finished, the estimate treats the agent as one request whose
prompt is the agent's prompt text (``P`` estimated tokens) and whose output is ``d0`` tokens:
``P*d0 + d0*(d0+1)/2``. ``d0`` is the mean output length per request that the server has
reported so far over all types (``features["output_tokens"] / features["requests"]`` passed
to :meth:`ColdStartEstimator.observe`), or ``default_output_tokens`` before any report.

As agents of the type complete, :meth:`ColdStartEstimator.observe` adds ``(P, cost)`` to a
per-type log-log ridge regression ``log cost = a + b * log(1 + P)`` whose slope is pulled
towards 1 (cost proportional to prompt size) with ``prior_strength`` pseudo-observations. One
observation gives a pure ratio (cost proportional to the prompt); more observations learn how
cost grows with the prompt. The regression keeps six running sums per type: ``observe`` and
``predict`` are O(1) and take a few microseconds.

:meth:`ColdStartEstimator.predict_interval` gives ``(p50, p90)``: the estimate, and the
estimate times ``exp(1.28 sigma)``, with ``sigma`` the spread of ``log cost`` about the
regression, shrunk towards ``prior_log_sigma`` (1.0: a factor of 3.6 between p50 and p90)
with ``prior_strength`` pseudo-observations. A type never seen has the prior's spread: the
server's promises allow for the p90 (docs/concepts.md, "The deadline promised at
registration"), and a guess of one request of ``d0`` tokens can be that far off.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from .features import estimate_tokens

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
    """Online per-type cost estimates from prompt token counts and observed costs."""

    def __init__(self, default_output_tokens: float = 256.0, prior_strength: float = 2.0,
                 max_log_slope: float = 3.0, prior_log_sigma: float = 1.0):
        self.default_output_tokens = float(default_output_tokens)
        self.prior_strength = float(prior_strength)
        self.max_log_slope = float(max_log_slope)
        self.prior_log_sigma = float(prior_log_sigma)
        self._stats: dict[str, _Stats] = {}
        self._out_tokens = 0.0
        self._out_requests = 0.0
        self._lock = threading.Lock()

    # -- queries -------------------------------------------------------------------------
    def observations(self, agent_type: str) -> int:
        """How many completed agents of ``agent_type`` have been observed."""
        s = self._stats.get(agent_type)
        return s.n if s else 0

    def output_tokens_per_request(self) -> float:
        if self._out_requests > 0:
            return self._out_tokens / self._out_requests
        return self.default_output_tokens

    def predict(self, agent_type: str, prompt: str, features: Mapping[str, Any] | None = None) -> float:
        """Estimated total cost of an agent of ``agent_type`` with this prompt."""
        return self._fit(agent_type, prompt, features)[0]

    def predict_interval(self, agent_type: str, prompt: str,
                         features: Mapping[str, Any] | None = None) -> tuple[float, float]:
        """``(p50, p90)`` of the agent's total cost: the estimate, and the estimate times
        the spread the type's costs have shown about it (the prior's before any)."""
        estimate, sigma = self._fit(agent_type, prompt, features)
        return estimate, estimate * math.exp(_Z90 * sigma)

    def _fit(self, agent_type: str, prompt: str, features: Mapping[str, Any] | None) -> tuple[float, float]:
        """The estimate and the spread (sigma of log cost) around it."""
        tokens = _prompt_tokens(prompt, features)
        s = self._stats.get(agent_type)
        if s is None or s.n == 0:
            d0 = self.output_tokens_per_request()
            return max(1.0, tokens * d0 + d0 * (d0 + 1.0) / 2.0), self.prior_log_sigma
        x = math.log1p(tokens)
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
        sigma = math.sqrt((lam * self.prior_log_sigma ** 2 + sse) / (lam + n - 1))
        return max(1.0, math.exp(my + b * (x - mx))), sigma

    # -- updates -------------------------------------------------------------------------
    def observe(self, agent_type: str, prompt: str, cost: float, features: Mapping[str, Any] | None = None) -> None:
        """Record a completed agent of ``agent_type`` whose real cost was ``cost``.

        ``features`` may carry ``output_tokens`` (total output tokens of the agent) and
        ``requests`` (or ``n_requests``, its number of requests), as the SDK's profiler and
        the server record them; they refine the output length assumed for types never seen.
        """
        if not (isinstance(cost, (int, float)) and math.isfinite(cost) and cost > 0):
            return
        x = math.log1p(_prompt_tokens(prompt, features))
        y = math.log(cost)
        with self._lock:
            self._stats.setdefault(agent_type, _Stats()).add(x, y)
            if features:
                out = features.get("output_tokens")
                nreq = features.get("n_requests", features.get("requests"))
                if isinstance(out, (int, float)) and isinstance(nreq, (int, float)) and \
                        _positive(out) and _positive(nreq):
                    self._out_tokens += float(out)
                    self._out_requests += float(nreq)


class ColdStartPredictor:
    """``predict(prompt, features)`` for one agent type, backed by a :class:`ColdStartEstimator`."""

    is_cold_start = True

    def __init__(self, estimator: ColdStartEstimator, agent_type: str):
        self.estimator = estimator
        self.agent_type = agent_type

    @property
    def metadata(self) -> dict[str, Any]:
        return {"agent_type": self.agent_type, "kind": "cold_start",
                "observations": self.estimator.observations(self.agent_type)}

    def predict(self, prompt: str, features: Mapping[str, Any] | None = None) -> float:
        return self.estimator.predict(self.agent_type, prompt, features)

    def predict_interval(self, prompt: str, features: Mapping[str, Any] | None = None) -> tuple[float, float]:
        return self.estimator.predict_interval(self.agent_type, prompt, features)

    def observe(self, prompt: str, cost: float, features: Mapping[str, Any] | None = None) -> None:
        self.estimator.observe(self.agent_type, prompt, cost, features)


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _prompt_tokens(prompt: str, features: Mapping[str, Any] | None) -> float:
    # Always the text's own estimate: features["prompt_tokens"], where the server or the
    # profiler records it, is the sum over the agent's requests, known only afterwards.
    return float(estimate_tokens(prompt or ""))
