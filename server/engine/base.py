"""The engine interface: what the server needs from an inference engine.

Like httpx's transports, backends are swappable behind one small interface: the in-process
vLLM engine (`LocalVLLMEngine`) and, for scale-out, remote vLLM OpenAI servers. The server
never talks to vLLM directly; it hands an `EngineRequest` to `Engine.generate` and reads
`EngineOutput`s until one is `finished`.

Cancellation contract: when the consumer of `generate` stops iterating (the client went
away, the agent was cancelled, a sibling task failed), the backend aborts the request in
the engine so that its KV cache is freed. `abort` does the same explicitly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class EngineError(Exception):
    """The engine failed or is not running; requests fail with a clear message."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (too long, bad sampling parameters).

    `param` names the request field at fault when one is (OpenAI's error body carries it).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Sequences sampled from the one prompt (OpenAI's `n`).
    n: int = 1
    # Log probabilities of each sampled token and of the `logprobs` most likely ones
    # (0: the sampled token's only); None: none returned.
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Structured output (vLLM's structured outputs, xgrammar): any JSON object, or JSON
    # matching `json_schema` (the schema as JSON text, so that the options stay hashable).
    json_object: bool = False
    json_schema: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token with its log probability and the most likely alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class SequenceOutput:
    """Cumulative state of one of a request's `n` sequences."""

    index: int
    text: str
    output_tokens: int
    finish_reason: str | None = None
    delta_text: str = ""
    # The tokens added since the previous output (only when logprobs were asked for).
    delta_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    # vLLM's priority scheduling: lower runs first; a Python int (a float hangs vLLM).
    priority: int = 0


@dataclass(frozen=True)
class EngineOutput:
    """Cumulative state of one request after an engine step.

    `text`, `delta_text` and `finish_reason` are those of the first sequence;
    `output_tokens` counts the tokens of all `n` sequences (what the request cost), and
    `sequences` has each one (empty: the one sequence the fields above describe).
    """

    request_id: str
    text: str
    prompt_tokens: int
    output_tokens: int
    finished: bool
    finish_reason: str | None = None
    num_preemptions: int = 0
    delta_text: str = ""
    sequences: tuple[SequenceOutput, ...] = ()

    def each(self) -> tuple[SequenceOutput, ...]:
        """The request's sequences, one at least."""
        if self.sequences:
            return self.sequences
        return (SequenceOutput(0, self.text, self.output_tokens, self.finish_reason,
                               self.delta_text),)


@dataclass(frozen=True)
class EngineInfo:
    model: str
    kv_capacity_tokens: int
    block_size: int
    max_model_len: int
    # Token ids a prompt may hold are 0 .. vocab_size - 1; None: the engine checks itself.
    vocab_size: int | None = None
    # The most `logprobs` a request may ask for (vLLM's max_logprobs, 20 by default).
    max_logprobs: int = 20


@dataclass(frozen=True)
class EngineStats:
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    running: int = 0
    waiting: int = 0
    preemptions_total: int = 0
    iteration_time_s: float | None = None  # moving average while busy
    steps_total: int = 0


@runtime_checkable
class Engine(Protocol):
    """What every engine backend provides."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def healthy(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def tokenize(self, text: str) -> list[int]: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def add_step_listener(self, listener: Callable[[float, float], None]) -> None:
        """Call `listener(step_seconds, kv_tokens_in_use)` after every busy engine step
        (the scheduler measures its service rate from these)."""
        ...
