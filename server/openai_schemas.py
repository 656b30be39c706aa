"""OpenAI-compatible request and response bodies (the subset the server implements).

Unknown fields are accepted and ignored, as OpenAI-compatible servers do, so that clients
written for other servers keep working.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.validation import RequestBody

# 64-bit bounds for seed and top_k, as vLLM's own server has for seed: a value past 64 bits
# failed inside the engine (a 500) before these bounds existed.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

StopString = Annotated[str, Field(min_length=1)]  # vLLM refuses an empty stop string
TokenId = Annotated[int, Field(ge=0)]  # the upper bound is the vocabulary: checked at runtime


class SamplingFields(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, description="Tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=INT64_MAX, description="-1 or 0: no top-k.")
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | list[StopString] | None = None
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
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]) = Field(
        description="Text, or a list of token ids.")
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _non_empty(cls, v: object) -> object:
        # Before the union's own checks, so that the answer is one sentence, not one per
        # member of the union.
        if isinstance(v, (str, list)) and len(v) == 0:
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


# The answers, as documented in the OpenAPI schema (the routes build them as dicts).
class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# One server-sent event (before OpenAPI 3.2 the `schema` of an event stream is per event).
SSE_EVENT: dict = {"type": "object", "required": ["data"],
                   "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def streamed_or(model: type[BaseModel], what: str) -> dict[int | str, dict]:
    """The 200 entry of a route that answers JSON, or server-sent events with `stream`."""
    return {200: {"model": model,
                  "description": f"{what}; with `stream: true`, server-sent events whose data "
                                 "are JSON chunks, ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


_ID_PREFIX = secrets.token_hex(6)  # differs per server process: ids stay unique across restarts
_id_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """A request id: unique, not secret (agent ids, not request ids, name what a caller owns)."""
    return f"{prefix}-{_ID_PREFIX}{next(_id_counter):010x}"


def now_s() -> int:
    return int(time.time())
