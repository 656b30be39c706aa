"""What a request costs in the policy's units: estimated when it is submitted, real when it
finishes.

A request's footprint is what it reserves in the engine (prompt + expected output, rounded
up to whole blocks, times its `n` sequences). Its cost is the policy's (KV token-time or
compute tokens, cost.py). A request naming shared prompt prefixes (prefix-aware policies,
one sequence) reserves its private footprint plus the part of the chain no running request
holds, and under a KV-cost policy is charged its private KV token-time plus what its hold
adds to its agent's (`PrefixLedger`); with `n` > 1 the engine gives every sequence its own
copy of the prompt, so nothing is shared.

The mix of the requests submitted so far converts between the cost models
(`compute_per_kv`). Pure: no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cost import COMPUTE, KV, compute_cost, cost_function, kv_cost, kv_footprint
from .prefix import PrefixLedger, private_kv_cost, segments, shared_tokens
from .state import AgentState, CostMix, RequestSpec, RequestState


class RequestCosts:
    """Estimated and real costs of requests under one policy's cost model."""

    def __init__(self, cost_model: str, block_size: int, prefix_aware: bool) -> None:
        self.cost_model = cost_model
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self._cost = cost_function(cost_model)
        self.mix = CostMix()

    @property
    def compute_per_kv(self) -> float:
        """Compute tokens (p + 2d) per unit of KV token-time over the requests submitted so
        far (`CostMix`): converts one cost model into the other."""
        return self.mix.compute_per_kv

    @property
    def kv_unit(self) -> float:
        """Policy cost units per unit of KV token-time (1 unless the policy charges compute)."""
        return self.compute_per_kv if self.cost_model == COMPUTE else 1.0

    def agent_charge(self, predicted_cost: float, predicted_compute_cost: float | None) -> float:
        """What an agent of this predicted KV cost is charged in policy units."""
        if self.cost_model != COMPUTE:
            return predicted_cost
        if predicted_compute_cost is None:
            predicted_compute_cost = predicted_cost * self.compute_per_kv
        return max(0.0, float(predicted_compute_cost))

    def estimate(self, spec: RequestSpec, agent: AgentState, seq: int, now: float) -> RequestState:
        """A submitted request with its footprint and estimated costs; counted in the mix."""
        p, d, n = int(spec.prompt_tokens), spec.expected_tokens, spec.n
        block = self.block_size
        footprint = n * (-(-kv_footprint(p, d) // block) * block)
        req = RequestState(
            spec=spec,
            seq=seq,
            submitted_at=now,
            footprint=footprint,
            est_cost=n * self._cost(p, d),
            est_kv_cost=n * kv_cost(p, d),
            private_footprint=footprint,
        )
        if spec.prefix and n == 1 and self.prefix_aware:
            self._share(agent, req, p, d)
        self.mix.compute += n * compute_cost(p, d)
        self.mix.kv += req.est_kv_cost
        return req

    def _share(self, agent: AgentState, req: RequestState, p: int, d: int) -> None:
        """A request naming shared prefixes: its segments, private footprint and charge."""
        segs = segments(req.spec.prefix, self.block_size)
        if not segs:
            return
        shared = shared_tokens(segs)
        req.segments = segs
        req.private_footprint = req.footprint - shared
        if self.cost_model == KV:
            if agent.prefixes is None:
                agent.prefixes = PrefixLedger()
            req.shared_charge = agent.prefixes.charge(segs, d)
            req.est_cost = private_kv_cost(p, d, shared) + req.shared_charge

    def unshare(self, agent: AgentState, req: RequestState) -> None:
        """The request is gone: its agent's prefix charges forget its hold."""
        if req.segments and agent.prefixes is not None:
            agent.prefixes.release(req.segments)

    def real(self, req: RequestState, prompt_tokens: int, output_tokens: int,
             lengths: Sequence[int]) -> tuple[float, float]:
        """A finished request's (cost in policy units, KV cost): its private part at its true
        lengths (each sequence as one request), plus the charge of its shared prefixes
        (fixed at submission)."""
        real_kv = sum(kv_cost(prompt_tokens, d) for d in lengths)
        if req.segments and self.cost_model == KV:
            return private_kv_cost(prompt_tokens, output_tokens, shared_tokens(req.segments)) + req.shared_charge, \
                real_kv
        return sum(self._cost(prompt_tokens, d) for d in lengths), real_kv
