"""The engine interface: what the server needs from an inference engine.

Like httpx's transports, backends are swappable behind one small interface: the in-process
vLLM engine (`LocalVLLMEngine`), remote vLLM OpenAI servers (`RemoteVLLMEngine`) and the
test suite's `FakeEngine`. The server never talks to vLLM directly; it hands an
`EngineRequest` to `Engine.generate` and reads `EngineOutput`s until one is `finished`.

`Engine` is what every backend offers. What only some offer is a capability, each its own
small protocol (`StepStatistics`, `StepSamples`, `Placement`, `CapacityChanges`, `ReplicaList`, `Autoscaled`,
`Supervised`); `Capabilities.of(engine)` finds which an engine has, once, when the
scheduler and the application are built, so that no other code probes engines with
`getattr`.

Cancellation contract: when the consumer of `generate` stops iterating (the client went
away, the agent was cancelled, a sibling task failed), the backend aborts the request in
the engine so that its KV cache is freed. `abort` does the same explicitly. That is why
`generate` is an async generator: closing it (`aclose`) runs the backend's cleanup at once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from server.shared.step_time import StepSample


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
    # The ids of the tokens generated, once the sequence has finished (empty before, and
    # from engines that do not say): what a client resends to hit the prefix cache.
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    # vLLM's priority scheduling: lower runs first; a Python int (a float hangs vLLM).
    priority: int = 0


@dataclass(frozen=True)
class EngineTimes:
    """Where one request's time went inside the engine, from the engine's own clocks (vLLM's
    per-request stats), in seconds: from the server's hand-off to the engine's queue
    (`to_engine_s`: the request's way to the engine core), waiting there for a step
    (`queued_s`), from its first step to its first token (`prefill_s`), to its last token
    (`decode_s`), and from its last token to the server's hand (`from_engine_s`: the output's
    way back). What a request's time in the engine holds beyond these is the server's own."""

    to_engine_s: float
    queued_s: float
    prefill_s: float
    decode_s: float
    from_engine_s: float


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
    # Prompt tokens the engine served from its prefix cache (vLLM's num_cached_tokens);
    # None when the engine does not say.
    cached_tokens: int | None = None
    # A finished request's time inside the engine, when the engine reports it.
    times: EngineTimes | None = None

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
    # The name the engine serves the model under (a remote replica's `id` in /v1/models);
    # empty: the server names it (`--served-model-name`, or `model`).
    served_name: str = ""
    # The dtype the engine computes in, as vLLM resolved it ("float32", "bfloat16"; empty
    # where unknown, e.g. a remote replica). A profile measured in another dtype measures
    # another engine: on a CPU without native bfloat16, prefill at twice the cost.
    dtype: str = ""
    # The most tokens one step computes (vLLM's max_num_batched_tokens; 0: unknown): a longer
    # prompt is prefilled in chunks over several steps, each attending over the ones before.
    max_num_batched_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    running: int = 0
    waiting: int = 0
    preemptions_total: int = 0
    iteration_time_s: float | None = None  # moving average while busy
    steps_total: int = 0


# The messages of a chat request: dicts with "role" and "content" (and, for tool calling,
# an assistant's "tool_calls" and a tool answer's "tool_call_id").
ChatMessages = Sequence[dict[str, Any]]
# `listener(step_seconds, kv_tokens_in_use)`, after every busy engine step.
StepListener = Callable[[float, float], None]
# `listener(engine_name, sample)`, after every busy engine step: its duration and batch shape.
SampleListener = Callable[[str, "StepSample"], None]
# `listener(state, detail)`, on every change of a supervised engine's state.
StateListener = Callable[[str, str], None]
# `listener(kv_capacity_tokens)`, after every change of the engine's KV capacity M.
CapacityListener = Callable[[int], None]


@runtime_checkable
class Engine(Protocol):
    """What every engine backend provides."""

    @property
    def info(self) -> EngineInfo:
        """The model and the engine's limits; EngineError before `start`."""
        ...

    @property
    def healthy(self) -> bool:
        """Requests can run now."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids of `text` (BOS included, as vLLM would add it)."""
        ...

    def apply_chat_template(self, messages: ChatMessages,
                            tools: Sequence[dict[str, Any]] | None = None) -> str | None:
        """The prompt the model's chat template makes of `messages` (and of the `tools` it
        may call, OpenAI's `{"type": "function", "function": ...}` objects); None when the
        model has no template (the server then writes a plain transcript).
        InvalidRequestError when the template refuses the messages."""
        ...

    def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """The request's cumulative outputs, the last one `finished` (see the module's
        cancellation contract)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...


# -- optional capabilities ------------------------------------------------------------------
# Each one is checked with isinstance (they are runtime-checkable) by `Capabilities.of`.
# None of their members may raise when read: Python 3.11's isinstance reads them.


@runtime_checkable
class StepStatistics(Protocol):
    """The engine reports its busy steps (the scheduler measures its service rate tau)."""

    def add_step_listener(self, listener: StepListener) -> None: ...


@runtime_checkable
class StepSamples(Protocol):
    """The engine reports each busy step's duration and batch shape (the input of the
    scheduler's time model, server/scheduler/time_model.py)."""

    def add_sample_listener(self, listener: SampleListener) -> None: ...


@runtime_checkable
class Placement(Protocol):
    """Requests need room on one part of the engine (a replica): the scheduler admits a
    request only once `place` reserved it; `release` drops a placement never used."""

    def place(self, request_id: str, agent_id: str, footprint: int) -> bool: ...

    def release(self, request_id: str) -> None: ...


@runtime_checkable
class CapacityChanges(Protocol):
    """The KV capacity M changes while serving (replicas added, removed, failed, back)."""

    def add_capacity_listener(self, listener: CapacityListener) -> None: ...


@runtime_checkable
class ReplicaList(Protocol):
    """The engine runs on replicas it can list (/v1/admin/replicas, the dashboard): each
    one's id, state, KV capacity, reserved tokens and requests in flight."""

    @property
    def capacity(self) -> int:
        """M: the KV tokens of the replicas serving now."""
        ...

    def describe_replicas(self) -> list[dict[str, Any]]: ...

    def capacity_changes(self) -> list[dict[str, Any]]:
        """Each M the scheduler was told: `{"at": unix time, "replicas": n, "M": tokens}`."""
        ...


@runtime_checkable
class Autoscaled(Protocol):
    """The engine scales its replicas on the scheduler's KV demand (tokens reserved by
    running requests plus the footprints of queued ones), which it reads through `demand`."""

    def set_demand_source(self, demand: Callable[[], int]) -> None: ...


@runtime_checkable
class Supervised(Protocol):
    """The engine is watched and restarted when it dies.

    `state`: stopped, starting, running, restarting or failed (dead for good).
    """

    state: str
    state_detail: str

    @property
    def recovering(self) -> bool:
        """Down now, but being brought back: hold requests rather than fail them."""
        ...

    def add_state_listener(self, listener: StateListener) -> None: ...


@dataclass(frozen=True)
class Capabilities:
    """The optional capabilities of one engine, found once; None where it has none."""

    step_statistics: StepStatistics | None = None
    step_samples: StepSamples | None = None
    placement: Placement | None = None
    capacity_changes: CapacityChanges | None = None
    replicas: ReplicaList | None = None
    autoscaled: Autoscaled | None = None
    supervision: Supervised | None = None

    @classmethod
    def of(cls, engine: object) -> Capabilities:
        return cls(
            step_statistics=engine if isinstance(engine, StepStatistics) else None,
            step_samples=engine if isinstance(engine, StepSamples) else None,
            placement=engine if isinstance(engine, Placement) else None,
            capacity_changes=engine if isinstance(engine, CapacityChanges) else None,
            replicas=engine if isinstance(engine, ReplicaList) else None,
            autoscaled=engine if isinstance(engine, Autoscaled) else None,
            supervision=engine if isinstance(engine, Supervised) else None,
        )

    @property
    def names(self) -> frozenset[str]:
        """The capabilities present, by field name (for logs and tests)."""
        return frozenset(k for k, v in vars(self).items() if v is not None)


# -- shared guards --------------------------------------------------------------------------

NOT_STARTED = "the engine has not started"
NOT_RUNNING = "the engine is not running"


def check_vocabulary(ids: Sequence[int], vocab_size: int | None) -> None:
    """Every id is in the model's vocabulary (vocab_size None: the engine checks)."""
    if vocab_size is not None and ids and not (0 <= min(ids) and max(ids) < vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise InvalidRequestError(
            f"token id {bad} is not in the model's vocabulary (0 to {vocab_size - 1})")


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Prompt plus output fit the model's context."""
    if prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens asks for {max_tokens} more: "
            "shorten the prompt or lower max_tokens", param="max_tokens"
        )


def check_min_tokens(sampling: SamplingOptions) -> None:
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens "
            f"({sampling.max_tokens})", param="min_tokens"
        )


def check_request(request: EngineRequest, info: EngineInfo) -> None:
    """What vLLM refuses when a request reaches it, refused here the same way."""
    s, ids = request.sampling, request.prompt_token_ids
    if s.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {s.max_tokens}",
                                  param="max_tokens")
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    check_vocabulary(ids, info.vocab_size)
    check_context(len(ids), s.max_tokens, info.max_model_len)
    check_min_tokens(s)
