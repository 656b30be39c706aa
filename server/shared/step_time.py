"""What one engine step took, and the step-time model's coefficients: plain data.

The engine reports `StepSample`s, the scheduler core fits a `TimeModel` to them
(server/scheduler/time_model.py) and takes it as a value, the simulator's engine steps by
one, and engine profiles (server/shared/profiles.py) carry one. Both types live here, below
the engine and the scheduler, so that neither imports the other for them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

FEATURES = ("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s")


@dataclass(frozen=True)
class StepSample:
    """One engine step as the engine's statistics report it."""

    seconds: float  # its duration
    decode_seqs: float  # requests that produced a token in it
    prefill_tokens: float  # prompt tokens computed in it
    # Context tokens of the running requests (their attention reads them: a shared prefix
    # once per request reading it, where the cache holds it once)
    kv_tokens: float

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.decode_seqs), float(self.prefill_tokens), float(self.kv_tokens))

    def scaled(self, factor: float) -> StepSample:
        """The same step with `factor` times its batch: one replica's step as the step of a
        fleet of `factor` such replicas stepping side by side. The scheduler sees engine
        replicas as one engine of M, their capacities summed, so a fit to scaled samples
        predicts a replica's step at its share of the fleet's batch."""
        return StepSample(self.seconds, self.decode_seqs * factor, self.prefill_tokens * factor,
                          self.kv_tokens * factor)


@dataclass(frozen=True)
class TimeModel:
    """Coefficients of the step-time model, with how well they fit (plain data)."""

    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_kv_token_s: float
    samples: int = 0  # steps learned from (0: the prior)
    error_p50: float | None = None  # recent relative error per step
    error_p90: float | None = None
    total_error: float | None = None  # recent relative error of the summed step time
    source: str = ""
    # A prompt past the engine's token budget per step costs more than the linear prefill
    # term (server/shared/profiles.py): a calibration measures it, the online fit keeps it.
    prefill_chunk_tokens: int = 0
    per_chunked_prefill_s: float = 0.0

    def step_s(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
        """Predicted duration of one step (seconds)."""
        return (self.base_s + self.per_seq_s * decode_seqs
                + self.per_prefill_token_s * prefill_tokens + self.per_kv_token_s * kv_tokens)

    def chunked_prefill_s(self, prompt_tokens: float) -> float:
        """What a prompt of `prompt_tokens` computed costs beyond the linear prefill term."""
        return chunked_prefill_s(self.prefill_chunk_tokens, self.per_chunked_prefill_s, prompt_tokens)

    def scaled(self, factor: float, why: str) -> TimeModel:
        """The model with every step predicted `factor` times as long; `why` joins its source."""
        return replace(self, base_s=self.base_s * factor, per_seq_s=self.per_seq_s * factor,
                       per_prefill_token_s=self.per_prefill_token_s * factor,
                       per_kv_token_s=self.per_kv_token_s * factor,
                       per_chunked_prefill_s=self.per_chunked_prefill_s * factor,
                       source=f"{self.source}, scaled {why}")

    def predict(self, sample: StepSample) -> float:
        return self.step_s(sample.decode_seqs, sample.prefill_tokens, sample.kv_tokens)

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return (self.base_s, self.per_seq_s, self.per_prefill_token_s, self.per_kv_token_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TimeModel:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        missing = [k for k in FEATURES if k not in known]
        if missing:
            raise ValueError(f"a time model needs {', '.join(missing)}")
        bad = [k for k in (*FEATURES, "per_chunked_prefill_s")
               if k in known and not (isinstance(known[k], (int, float)) and known[k] >= 0
                                      and math.isfinite(known[k]))]
        if bad:
            raise ValueError(f"time-model coefficients must be finite and >= 0: {', '.join(bad)}")
        chunk = known.get("prefill_chunk_tokens", 0)
        if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 0):
            raise ValueError(f"prefill_chunk_tokens must be an integer >= 0, not {chunk!r}")
        return cls(**known)


def chunked_prefill_s(chunk_tokens: int, per_chunked_prefill_s: float, prompt_tokens: float) -> float:
    """The chunked prefill's extra for a prompt of `prompt_tokens` computed on an engine of
    `chunk_tokens` a step: `per_chunked_prefill_s x (p - chunk) x p` past the budget (each
    later chunk attends over the ones before it), 0 within it or where no budget is modelled."""
    over = prompt_tokens - chunk_tokens
    if chunk_tokens <= 0 or over <= 0:
        return 0.0
    return per_chunked_prefill_s * over * prompt_tokens
