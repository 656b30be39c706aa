"""OpenAI-compatible request and response bodies (the subset the server implements).

Unknown fields are accepted and ignored, as OpenAI-compatible servers do, so that clients
written for other servers keep working.
"""

from __future__ import annotations

import time
import itertools
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, description="Tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description="Only n=1 is supported.")
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # Justitia: the agent this request belongs to (or header X-Justitia-Agent).
    agent_id: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if isinstance(v, str):
            return [v]
        return v

    def stop_tuple(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(description="Text, or a list of token ids.")
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


_ID_PREFIX = secrets.token_hex(6)  # differs per server process: ids stay unique across restarts
_id_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """A request id: unique, not secret (agent ids, not request ids, name what a caller owns)."""
    return f"{prefix}-{_ID_PREFIX}{next(_id_counter):010x}"


def now_s() -> int:
    return int(time.time())
