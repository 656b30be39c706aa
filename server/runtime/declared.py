"""What an agent declares of itself in its metadata, parsed once at registration.

`stages`, `critical_path_tokens`, `prefill_tokens`, `prefill_square_tokens`,
`first_request_tokens` and `stage_request_tokens` declare its structure (an `AgentShape`):
the delay bound covers its own critical path instead of a one-stage guess, its ETA counts
its prefill (prompts past the engine's step budget by their squares) and the wait for room
for its first stage's largest request, the ETAs of the agents behind it the wait for room
for its later stages' largest requests, re-prediction extrapolates over its stages. `batch` declares the
batch its client submits it with. The API has checked the ranges (server/api/agents_api.py);
a value of another type (a string, a boolean) is the caller's own and declares nothing.
"""

from __future__ import annotations

from typing import Any

from server.scheduler import AgentShape
from server.scheduler.declared import BatchDeclaration


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ints(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not value or any(_int(v) is None for v in value):
        return None
    return tuple(value)


def declared_shape(metadata: dict[str, Any]) -> AgentShape | None:
    """An agent may declare its structure (`stages`, `critical_path_tokens`, and for ETAs
    `prefill_tokens`, `first_request_tokens` and `stage_request_tokens`) in its metadata;
    the bound then covers its own critical path instead of a one-stage guess. Its first
    stage's entry of `stage_request_tokens` is its `first_request_tokens` where it declares
    only the list."""
    stages = _int(metadata.get("stages"))
    if stages is None or stages < 1:
        return None
    per_stage = _ints(metadata.get("stage_request_tokens"))
    first = _int(metadata.get("first_request_tokens"))
    return AgentShape(stages=stages, critical_path_tokens=_int(metadata.get("critical_path_tokens")),
                      prefill_tokens=_int(metadata.get("prefill_tokens")),
                      first_request_tokens=first if first is not None or per_stage is None else per_stage[0],
                      prefill_square_tokens=_int(metadata.get("prefill_square_tokens")),
                      stage_request_tokens=per_stage)


def declared_batch(metadata: dict[str, Any], tenant: str | None) -> BatchDeclaration | None:
    """The batch an agent's client declared it part of (`metadata["batch"]`: its `id`, its
    `size` and the agent's `index` in it, as the SDK sends), for the ETAs to expect the
    inputs the client still holds back; None where the declaration is missing or malformed."""
    batch = metadata.get("batch")
    if not isinstance(batch, dict):
        return None
    batch_id, size, index = batch.get("id"), batch.get("size"), batch.get("index")
    if not isinstance(batch_id, str) or not batch_id or type(size) is not int or size < 1:
        return None
    # by tenant: one tenant's declaration never counts toward another's batch of the same id
    return BatchDeclaration(f"{tenant}/{batch_id[:64]}", size,
                            index if type(index) is int and index >= 0 else None)
