"""The per-agent delay bound, in seconds (derivation: docs/concepts.md).

Under Justitia, agent j finishes by

    f_j <= F^gps_j + delay_bound_j

    delay_bound_j = (2 c_max + C_max) / R          lag of tag-order service behind GPS
                  + S_j (d_max + 1) tau            one non-preemptive wait per stage release
                  + tau * sum_s (d_s + 1)          agent j's own critical path

with R = M / tau the full-memory service rate, c_max / C_max the largest request / agent
cost (KV token-time), d_max the longest decode (output tokens) of any request, S_j the
number of stages of agent j and d_s the longest decode in its stage s. The first term is the
paper's Theorem B.1 converted to seconds; the other two are the effects the fluid model
ignores (a request decodes one token per iteration whatever memory it is given; a stage
released while memory is held by running requests waits for them to drain). Assumptions:
footprints are known (oracle output lengths or max_tokens), so Justitia never preempts;
iterations take tau; the long-run load is below the rate the engine actually sustains.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BoundLimits:
    """Workload limits the bound is stated against (declared by the operator, or observed).

    max_request_cost: c_max, KV token-time of the largest single request.
    max_agent_cost: C_max, KV token-time of the largest agent.
    max_output_tokens: d_max, the longest decode of any request (iterations).
    """

    max_request_cost: float
    max_agent_cost: float
    max_output_tokens: int


@dataclass(frozen=True)
class AgentShape:
    """What is known of an agent's structure when it is admitted.

    stages: number of sequential stages; critical_path_tokens: sum over stages of the longest
    output of the stage; prefill_tokens: the prompt tokens its requests compute (those the
    prefix cache does not serve), whose prefill lies on its path too: a stage's requests
    decode only once their prompts are in (None: unknown, ETAs count no prefill);
    first_request_tokens: the memory its first stage's largest request reserves (its prompt
    and output): an agent that has not started waits until that much is free, which a mean
    request of the mix can understate by most of the cache (None: unknown);
    prefill_square_tokens: the sum of the squares of those prompts, which says how far they
    run past the engine's token budget per step, where a prompt's chunked prefill costs more
    than its tokens' linear prefill (None: unknown, ETAs count none);
    stage_request_tokens: the memory each stage's largest request reserves, stage by stage:
    admission takes the queue in order, so while an agent's next stage waits for room for a
    request of most of the cache, the agents ordered after it wait too (None: unknown, only
    a request already queued is known to hold them back). The live server
    uses what the agent declared, else its type's typical shape
    (server/runtime/type_shapes.py), else this default: one stage whose longest decode is d_max.
    """

    stages: int = 1
    critical_path_tokens: int | None = None
    prefill_tokens: int | None = None
    first_request_tokens: int | None = None
    prefill_square_tokens: int | None = None
    stage_request_tokens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DelayBound:
    """The bound and its three terms, in seconds."""

    lag_s: float
    blocking_s: float
    critical_path_s: float

    @property
    def total_s(self) -> float:
        return self.lag_s + self.blocking_s + self.critical_path_s

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}


def delay_bound(limits: BoundLimits, shape: AgentShape, kv_capacity: int, tau: float,
                iteration_s: float | None = None) -> DelayBound:
    """delay_bound_j in seconds for an agent of `shape` (see the module docstring).

    `tau` sets the rate R = M / tau of term (i); `iteration_s` (default: tau) is the duration
    of one engine iteration in terms (ii) and (iii). The live server passes pessimistic
    values for both (a high percentile of recent steps), so that the bound holds on an
    engine whose steps vary."""
    rate = kv_capacity / tau
    tau = tau if iteration_s is None else iteration_s
    stages = max(1, shape.stages)
    cp_tokens = shape.critical_path_tokens
    if cp_tokens is None:
        cp_tokens = limits.max_output_tokens * stages
    return DelayBound(
        lag_s=(2.0 * limits.max_request_cost + limits.max_agent_cost) / rate,
        blocking_s=stages * (limits.max_output_tokens + 1) * tau,
        critical_path_s=(cp_tokens + stages) * tau,
    )
