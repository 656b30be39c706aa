"""Online Bayesian tuning over a small grid: Thompson sampling with a Gaussian-process posterior.

EWSJF tunes its score and partition parameters from the performance it measures while it
runs. The parameter space is a handful of values per parameter, so the tuner works on a
finite grid: after each epoch it is told the score the current grid point achieved (lower is
better), fits a Gaussian process to the last `memory` (point, score) pairs, draws one sample
of the score function over the whole grid from the posterior, and proposes the point where
that sample is smallest (Thompson sampling). Points never tried keep a wide posterior, so they
are explored; points that scored well are sampled low, so they are exploited.

Deterministic given its seed (numpy's PCG64), and cheap: with 45 grid points and at most 48
observations, one proposal is two small Cholesky factorisations (well under a millisecond).
numpy is imported here, not by the dispatcher, so that policies that do not tune never load it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import cast

import numpy as np


class GridThompsonTuner:
    """Thompson sampling over the points of a grid, with an RBF-kernel GP on [0, 1]^k."""

    def __init__(
        self,
        grid: Sequence[Sequence[float]],
        seed: int = 0,
        *,
        start: int = 0,
        length_scale: float = 0.35,
        noise: float = 0.5,
        memory: int = 48,
    ) -> None:
        pts = np.asarray(grid, dtype=float)
        if pts.ndim != 2 or len(pts) == 0:
            raise ValueError("grid must be a non-empty list of points")
        lo, hi = pts.min(axis=0), pts.max(axis=0)
        # Each parameter is rescaled to [0, 1] so that one length scale fits all of them.
        self._unit = (pts - lo) / np.where(hi > lo, hi - lo, 1.0)
        self.grid = [tuple(float(v) for v in p) for p in pts]
        self.current = int(start)
        self._rng = np.random.default_rng(seed)
        self._ls2 = 2.0 * length_scale**2
        self._noise = noise  # observation noise, in units of the scores' standard deviation
        self._obs: deque[tuple[int, float]] = deque(maxlen=memory)
        self._k_grid = self._kernel(self._unit, self._unit)

    def _kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2)
        # d2 is an array of a's rows by b's, so exp of it is one too (numpy types it as Any)
        return cast(np.ndarray, np.exp(-d2 / self._ls2))

    @property
    def observations(self) -> list[tuple[int, float]]:
        """The (grid index, score) pairs the posterior is fitted on, oldest first."""
        return list(self._obs)

    def observe(self, index: int, score: float) -> None:
        """The score (lower is better) measured with grid point `index` during one epoch."""
        if np.isfinite(score):
            self._obs.append((int(index), float(score)))

    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and covariance of the (standardised) score over the grid."""
        n = len(self._unit)
        if not self._obs:
            return np.zeros(n), self._k_grid.copy()
        idx = np.fromiter((i for i, _ in self._obs), dtype=int)
        y = np.fromiter((s for _, s in self._obs), dtype=float)
        sd = y.std()
        y = (y - y.mean()) / (sd if sd > 1e-12 else 1.0)
        k_xx = self._k_grid[np.ix_(idx, idx)] + self._noise**2 * np.eye(len(idx))
        k_sx = self._k_grid[:, idx]
        chol = np.linalg.cholesky(k_xx)
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, y))
        v = np.linalg.solve(chol, k_sx.T)
        return k_sx @ alpha, self._k_grid - v.T @ v

    def suggest(self) -> int:
        """The next grid point to run: the minimum of one posterior sample."""
        if not self._obs:
            return self.current
        mean, cov = self.posterior()
        z = self._rng.standard_normal(len(mean))
        try:
            root = np.linalg.cholesky(cov + 1e-6 * np.eye(len(mean)))
        except np.linalg.LinAlgError:  # rounding made the covariance slightly indefinite
            w, q = np.linalg.eigh(cov)
            root = q * np.sqrt(np.clip(w, 0.0, None))
        sample = mean + root @ z
        self.current = int(np.argmin(sample))
        return self.current

    def best(self) -> int:
        """The grid point with the lowest posterior mean (what the tuner believes is best)."""
        if not self._obs:
            return self.current
        return int(np.argmin(self.posterior()[0]))
