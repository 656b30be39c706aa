"""The engine's iteration-time model, and its online fitter.

One engine iteration (step) runs every running request one token and prefills the prompt
tokens scheduled in it. Its duration is modelled as

    step_s = base_s + per_seq_s * decode_seqs + per_prefill_token_s * prefill_tokens
             + per_kv_token_s * kv_tokens_attended

(the simulator's profile form, server/shared/profiles.py). `kv_tokens_attended` is the
running requests' contexts summed: each request's whole prompt and output, a shared prefix
once per request that reads it. The cache holds that prefix once, but attention reads it
per sequence: on the CPU engine 16 requests over one shared 2,048-token head step 5.4 ms
slower than 16 over 16-token heads, where the blocks held differ by 2,048 tokens
(docs/benchmarks.md). Without shared prefixes the two counts are the same. `prefill_tokens` are the prompt
tokens the step *computes*: tokens served from the prefix cache cost no prefill, so every
user of the model counts uncached tokens only (prefix.py's `uncached_prompt`): the live
server takes vLLM's computed-token count per step, the simulator's engine its uncached
prompt, and the dispatcher's ETAs the prompt net of what running requests (or, once it
reports them, the engine) have cached. `TimeModel` is plain frozen data:
the simulator's engine, the dispatcher and the server all take it as a value.

`TimeModelFitter` learns the coefficients from the engine's own per-step statistics
(`StepSample`s the server passes in; nothing here reads a clock or does I/O):

* recency-weighted least squares: the design matrix's sufficient statistics (X'X, X'y) are
  decayed by `decay` per sample, so the fit follows an engine whose speed changes (another
  process taking the cores, a replica restarted on other hardware) with a memory of about
  1 / (1 - decay) steps;
* a ridge towards the prior (a profile's coefficients): with few samples, or a feature the
  engine has not exercised yet (no prefill seen), the fit stays at the prior instead of
  jumping to whatever explains three samples;
* non-negative: every coefficient is a cost, and a negative one (which noise readily
  produces when two features are correlated, as batch size and KV held are) would make a
  large batch predict a shorter step than a small one. The constrained problem has four
  variables, so it is solved exactly by trying every subset of free coefficients (16 small
  solves) and keeping the best feasible one, on the normal equations;
* absolute (not relative) squared error: the server and the simulator need the total time
  of many steps right, and with the constant term free the residuals of a least-squares fit
  sum to zero, so the fitted model reproduces the measured busy time. Relative errors would
  be dominated by the near-zero intervals the stat logger reports when outputs queue up.

Its recent error (`error_p50`, `error_p90`) is the relative error of each step's prediction
made *before* the step was learned from, over the last `window` steps, and `total_error` the
relative error of the predicted sum of those steps (what the simulator's accuracy hangs on).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from server.shared.step_time import FEATURES, StepSample, TimeModel

__all__ = ["FEATURES", "StepSample", "TimeModel", "DEFAULT_PRIOR", "TimeModelFitter", "TimeModelBank",
           "fit_samples"]

# Typical magnitude of each feature (constant, decode sequences, prefill tokens, KV tokens
# held): the ridge towards the prior is scaled by them, so its strength is counted in steps.
FEATURE_SCALES = (1.0, 16.0, 256.0, 4096.0)


# The embedded tiny model on the vLLM CPU engine (the cpu-tiny profile's coefficients):
# the server's prior when it is told nothing better.
DEFAULT_PRIOR = TimeModel(0.00252, 0.0000569, 0.0000193, 0.0, source="prior: cpu-tiny profile")


class TimeModelFitter:
    """Recency-weighted, non-negative least squares with a ridge towards a prior."""

    def __init__(self, prior: TimeModel = DEFAULT_PRIOR, *, decay: float = 0.999,
                 prior_weight: float = 20.0, refit_every: int = 32, window: int = 512) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.prior = prior
        self.decay = decay
        self.prior_weight = prior_weight  # the prior counts as this many typical steps
        self.refit_every = max(1, refit_every)
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self._n = 0
        self._since_fit = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)  # (predicted, actual)
        self.model = replace(prior, samples=0)

    def observe(self, sample: StepSample) -> None:
        """Learn from one step (its prediction error is recorded first)."""
        if not (sample.seconds >= 0.0 and math.isfinite(sample.seconds)):
            return
        self._recent.append((self.model.predict(sample), sample.seconds))
        x = sample.features()
        d = self.decay
        for i in range(4):
            self._xty[i] = d * self._xty[i] + x[i] * sample.seconds
            row = self._xtx[i]
            for j in range(4):
                row[j] = d * row[j] + x[i] * x[j]
        self._n += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.refit()

    def observe_all(self, samples: Iterable[StepSample]) -> TimeModel:
        for s in samples:
            self.observe(s)
        return self.refit()

    def refit(self) -> TimeModel:
        self._since_fit = 0
        coef = self._solve()
        p50, p90, total = self._errors()
        # the chunked prefill's term is the prior's: a step's statistics do not say how long
        # the prompts it prefilled were
        self.model = replace(self.prior, base_s=coef[0], per_seq_s=coef[1], per_prefill_token_s=coef[2],
                             per_kv_token_s=coef[3], samples=self._n, error_p50=p50, error_p90=p90,
                             total_error=total, source=self.prior.source if self._n == 0 else
                             f"fitted online to {self._n} engine steps")
        return self.model

    def _solve(self) -> tuple[float, float, float, float]:
        # In units of each feature's typical magnitude, so that the normal equations are
        # well conditioned and the ridge weighs every coefficient alike.
        sc = FEATURE_SCALES
        prior = [c * s for c, s in zip(self.prior.coefficients, sc, strict=True)]
        lam = self.prior_weight
        a = [[self._xtx[i][j] / (sc[i] * sc[j]) + (lam if i == j else 0.0) for j in range(4)]
             for i in range(4)]
        b = [self._xty[i] / sc[i] + lam * prior[i] for i in range(4)]
        best: tuple[float, list[float]] | None = None
        # Every subset of free coefficients (the rest pinned at 0): the best feasible
        # stationary point of the (convex) objective is the constrained optimum.
        for free in itertools.chain.from_iterable(itertools.combinations(range(4), k) for k in range(5)):
            theta = [0.0] * 4
            if free:
                sol = _solve_linear([[a[i][j] for j in free] for i in free], [b[i] for i in free])
                if sol is None or min(sol) < 0.0:
                    continue
                for i, v in zip(free, sol, strict=True):
                    theta[i] = v
            # objective up to a constant: theta' A theta - 2 b' theta
            obj = sum(theta[i] * a[i][j] * theta[j] for i in range(4) for j in range(4)) \
                - 2.0 * sum(b[i] * theta[i] for i in range(4))
            if best is None or obj < best[0] - 1e-15 * max(1.0, abs(best[0])):
                best = (obj, theta)
        assert best is not None  # the empty subset is always feasible
        return tuple(t / s for t, s in zip(best[1], sc, strict=True))  # type: ignore[return-value]

    def _errors(self) -> tuple[float | None, float | None, float | None]:
        pairs = [(p, y) for p, y in self._recent if y > 0]
        if not pairs:
            return None, None, None
        errs = sorted(abs(p - y) / y for p, y in pairs)
        total_y = sum(y for _, y in pairs)
        total = (sum(p for p, _ in pairs) - total_y) / total_y
        return _quantile(errs, 0.5), _quantile(errs, 0.9), total


class TimeModelBank:
    """One fitter per engine (replica), keyed by the engine's name; and per engine a second
    one without decay, fitted to every step since the server started (`since_start`).

    The server's ETAs use the recency-weighted model: the engine as it runs now. A record
    of a whole run needs the other: the recency-weighted model at the end of a run is the
    engine of its last thousand steps, and a simulation with it reads the engine's drift
    within the run as the simulator's error."""

    def __init__(self, prior: TimeModel = DEFAULT_PRIOR, **fitter_options: float) -> None:
        self.prior = prior
        self._options = fitter_options
        self.fitters: dict[str, TimeModelFitter] = {}
        self.since_start: dict[str, TimeModelFitter] = {}

    def observe(self, engine: str, sample: StepSample) -> None:
        fitter = self.fitters.get(engine)
        if fitter is None:
            fitter = self.fitters[engine] = TimeModelFitter(self.prior, **self._options)  # type: ignore[arg-type]
            self.since_start[engine] = TimeModelFitter(self.prior, **{**self._options, "decay": 1.0})  # type: ignore[arg-type]
        fitter.observe(sample)
        self.since_start[engine].observe(sample)

    def models(self) -> dict[str, TimeModel]:
        return {name: f.model for name, f in self.fitters.items()}

    def describe(self) -> dict[str, Any]:
        return {"prior": self.prior.as_dict(),
                "engines": {name: m.as_dict() for name, m in self.models().items()},
                "since_start": {name: f.model.as_dict() for name, f in self.since_start.items()}}


def fit_samples(samples: Iterable[StepSample], prior: TimeModel = DEFAULT_PRIOR,
                prior_weight: float = 1.0) -> TimeModel:
    """A one-off fit (no decay): what `bench calibrate` does with its measured steps."""
    samples = list(samples)
    fitter = TimeModelFitter(prior, decay=1.0, prior_weight=prior_weight, refit_every=10**9,
                             window=10**9)
    model = fitter.observe_all(samples)
    # The online errors are those of each step's prediction before it was learned (mostly
    # the prior's here): a one-off fit reports the fitted model's own error instead.
    fitter._recent.clear()
    fitter._recent.extend((model.predict(s), s.seconds) for s in samples)
    p50, p90, total = fitter._errors()
    return replace(model, error_p50=p50, error_p90=p90, total_error=total,
                   source=f"fitted to {len(samples)} engine steps")


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0) or 1.0
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) <= 1e-14 * scale:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def _quantile(sorted_xs: list[float], q: float) -> float:
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)
