"""Online estimate of tau, the iteration time behind the GPS rate R = M / tau.

R must be the KV token-time the engine *actually* serves per second with its memory in use,
not M divided by the raw step time: reserved-but-not-yet-used memory and prefill-heavy steps
make the real rate lower, and a too-high R lets V run ahead of the engine until every tag lies
behind V and the order degenerates to agent FCFS (docs/concepts.md, "Which tau").

Each engine step with `kv_in_use` tokens of KV cache serves `kv_in_use` units. What fills the
cache under load is `fill`: the dispatcher's reservations (`kv_reserved`, footprint policies)
or the memory in use itself (policies that let the engine fill and preempt). A step that took
`duration` with a fraction `fill / M` of the cache filled would, with the cache full and the
same use per filled token, serve `kv_in_use * M / fill` units in about the same time, so it
is worth a tau sample of `duration * fill / kv_in_use` (the raw step time when the cache is
used as full as it is filled). Steps with `fill` under `min_fill * M` are skipped (a nearly
empty cache mostly measures fixed per-step overheads). Samples are averaged with exponential
decay over `half_life_s` seconds of busy time, weighted by step duration.

    est = TauEstimator(kv_capacity_tokens=45_000, initial_tau_s=0.040)
    est.observe_step(duration_s, kv_in_use=usage * M, kv_reserved=dispatcher.reserved_kv)
    dispatcher.set_iteration_time(est.tau_s, now)          # e.g. once a second
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TauEstimator:
    kv_capacity_tokens: int
    initial_tau_s: float
    half_life_s: float = 30.0
    min_fill: float = 0.5
    _weight: float = 0.0  # decayed busy seconds observed
    _weighted_tau: float = 0.0

    def observe_step(self, duration_s: float, kv_in_use: float, kv_reserved: float | None = None) -> None:
        """Record one engine step: its duration, the KV tokens it held and, for footprint
        policies, the KV tokens the dispatcher had reserved."""
        fill = kv_in_use if kv_reserved is None else max(kv_reserved, kv_in_use)
        if duration_s <= 0 or kv_in_use <= 0 or fill < self.min_fill * self.kv_capacity_tokens:
            return
        sample = duration_s * fill / kv_in_use
        decay = 0.5 ** (duration_s / self.half_life_s)
        self._weight = self._weight * decay + duration_s
        self._weighted_tau = self._weighted_tau * decay + duration_s * sample

    def set_kv_capacity(self, kv_capacity_tokens: int) -> None:
        """Replicas changed: samples already taken stay valid (they are per full cache)."""
        self.kv_capacity_tokens = int(kv_capacity_tokens)

    @property
    def tau_s(self) -> float:
        """The current estimate (the initial value until a step with a full-enough cache)."""
        if self._weight <= 0:
            return self.initial_tau_s
        return self._weighted_tau / self._weight
