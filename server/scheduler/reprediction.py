"""Re-predicting an agent's total cost as it runs (docs/predictors.md, "Re-prediction").

At registration the predictor gives a point prediction P (the value of least expected
relative error) and, when it has one, an interval: p50 and p90 of the total cost C. As the
agent runs, the server knows what it has consumed (c, the real cost of its finished
requests) and how many stages it has completed (k; the agent may have declared S). After
each finished request it re-estimates C:

* **from the interval**: C is taken as log-normal with median p50 and 90th percentile p90
  (sigma = ln(p90/p50) / 1.2816; a predictor without an interval gets sigma =
  :data:`DEFAULT_LOG_SIGMA` around P). Knowing C > c, the conditional median is
  ``exp(mu + sigma * inv_cdf((1 + cdf(z)) / 2))`` with ``z = (ln c - mu) / sigma``. It
  equals p50 while c is small and grows with c once the agent runs past what was expected.
  The estimate keeps P's calibration on what remains: ``c + (conditional median - c) * P /
  p50`` (P itself before anything is consumed).
* **from the stages**, when the agent declared S > k stages: c * S / k (the stages done so
  far, extrapolated). The two are combined by their geometric mean.

The estimate is never below c. It moves ETAs (the remaining work of the agent and of those
queued behind it); it never moves the agent's virtual finish tag, which only the over-run
rule changes (charged work that exceeds the prediction is charged as it becomes visible).
So an agent cannot gain by declaring little: a small estimate never lowers its tag below
what it was charged, and a large consumption is charged whatever the estimate says.
"""

from __future__ import annotations

import math
from statistics import NormalDist

#: Spread (sigma of ln C) assumed when the predictor gives no interval (the cold start): a
#: factor of about 3.6 between p50 and p90.
DEFAULT_LOG_SIGMA = 1.0
_Z90 = NormalDist().inv_cdf(0.9)
#: p90 / p50 of a cost with that spread: what a promise allows for on a guess with no interval.
DEFAULT_P90_RATIO = math.exp(_Z90 * DEFAULT_LOG_SIGMA)
_STD = NormalDist()


def conditional_median(consumed: float, p50: float, sigma: float) -> float:
    """Median of a log-normal total (median ``p50``, log spread ``sigma``) given that it
    exceeds ``consumed``."""
    if consumed <= 0.0 or sigma <= 0.0:
        return max(p50, consumed)
    mu = math.log(p50)
    q = _STD.cdf((math.log(consumed) - mu) / sigma)
    q = min(q, 1.0 - 1e-12)  # far beyond the interval: the median of the tail
    return math.exp(mu + sigma * _STD.inv_cdf((1.0 + q) / 2.0))


def expected_total(predicted: float, consumed: float, *, p50: float | None = None, p90: float | None = None,
                   stages_done: int = 0, stages: int | None = None) -> float:
    """The re-estimated total cost of an agent predicted at ``predicted`` (see the module
    docstring); same units as the arguments."""
    predicted = max(predicted, 1.0)
    if p50 is not None and p90 is not None and p50 > 0.0 and p90 > p50:
        median, sigma = p50, math.log(p90 / p50) / _Z90
    else:
        median, sigma = predicted, DEFAULT_LOG_SIGMA
    # P's calibration (P / p50) scales what remains beyond the consumption, not the whole
    consumed = max(consumed, 0.0)
    estimate = consumed + (conditional_median(consumed, median, sigma) - consumed) * predicted / median
    if stages is not None and 0 < stages_done < stages and consumed > 0.0:
        estimate = math.sqrt(estimate * consumed * stages / stages_done)
    return max(estimate, consumed)
