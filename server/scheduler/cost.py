"""Cost models: what one request costs the engine.

Justitia charges a request by the KV cache it occupies over time. A request with p prompt
tokens and d output tokens holds p + k tokens of KV cache during its k-th decode step, so its
memory-time cost is

    c = sum_{k=1..d} (p + k) = p*d + d*(d+1)/2          (KV token-time, "kv")

The unit is one token held for one engine iteration. An engine with a KV capacity of M
tokens delivers at most M such units per iteration, which is what makes the GPS rate
R = M / tau meaningful (see `virtual_clock`).

VTC's compute-token charge, c = p + 2d ("compute"), is kept for the Justitia/C ablation.

The footprint of a request is the peak KV it needs, p + d: what admission control reserves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

KV = "kv"
COMPUTE = "compute"
COST_MODELS = (KV, COMPUTE)


def kv_cost(prompt_tokens: int, output_tokens: int) -> float:
    """KV token-time of one request: p*d + d*(d+1)/2."""
    p, d = prompt_tokens, output_tokens
    return float(p * d + d * (d + 1) // 2)


def decode_for_kv_cost(prompt_tokens: int, cost: float) -> int:
    """The output length d at which one request of `prompt_tokens` costs `cost` (kv_cost's
    inverse, rounded): the decode a cost guessed as one request stands for."""
    b = 2 * max(0, prompt_tokens) + 1
    return max(0, round((math.sqrt(b * b + 8.0 * max(0.0, cost)) - b) / 2.0))


def compute_cost(prompt_tokens: int, output_tokens: int) -> float:
    """VTC's compute-token charge: p + 2d."""
    return float(prompt_tokens + 2 * output_tokens)


def kv_footprint(prompt_tokens: int, output_tokens: int) -> int:
    """Peak KV tokens a request holds: its prompt plus every output token."""
    return int(prompt_tokens + output_tokens)


def cost_function(model: str) -> Callable[[int, int], float]:
    """The request cost function of a cost model name ("kv" or "compute")."""
    if model == KV:
        return kv_cost
    if model == COMPUTE:
        return compute_cost
    raise ValueError(f"unknown cost model {model!r}; expected one of {COST_MODELS}")
