"""OpenAI-compatible request and response bodies (the subset the server implements).

Fields OpenAI or vLLM define that would change the answer and that this server does not
implement (logit_bias, echo, ...) are refused with a 400 naming the field, never
ignored; their "off" value (null, false, an empty list) is accepted. Fields that change
nothing here (`user`, `metadata`, `store`, ...) are accepted, and so are fields no API
defines, as OpenAI-compatible servers do, so that clients written for other servers keep
working.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from server.api.validation import RequestBody

# 64-bit bounds for seed and top_k, as vLLM's own server has for seed: a value past 64 bits
# failed inside the engine (a 500) before these bounds existed.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

StopString = Annotated[str, Field(min_length=1)]  # vLLM refuses an empty stop string
TokenId = Annotated[int, Field(ge=0)]  # the upper bound is the vocabulary: checked at runtime


# Most sequences one request may sample (`n`): each holds its own copy of the prompt in the
# KV cache, and the scheduler admits a request only when all its sequences fit.
MAX_N = 16
# vLLM's default max_logprobs: the most alternatives per token a request may ask for.
MAX_LOGPROBS = 20

# Fields some OpenAI or vLLM API defines, which this server does not implement, with the
# values that mean "off" (accepted) and why the rest are refused.
_OFF: tuple[Any, ...] = (None, False, [], {}, "")
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (_OFF, "the deprecated functions field is not supported; send tools"),
    "function_call": ((*_OFF, "none"), "the deprecated function_call field is not supported; "
                      "send tool_choice"),
    "logit_bias": (_OFF, "logit_bias is not supported by this server"),
    "echo": (_OFF, "echo is not supported by this server"),
    "suffix": (_OFF, "suffix (insertion) is not supported by this server"),
    "audio": (_OFF, "audio output is not supported by this server"),
    "modalities": ((*_OFF, ["text"]), "only text output is supported"),
    "prediction": (_OFF, "predicted outputs are not supported by this server"),
    "reasoning_effort": (_OFF, "this model does not reason; reasoning_effort is not supported"),
    "verbosity": (_OFF, "verbosity is not supported by this server"),
    "web_search_options": (_OFF, "web search is not supported by this server"),
    # vLLM's own extensions that change the answer
    "priority": ((None, 0), "the priority is set by Justitia's scheduler, not by the request"),
    "use_beam_search": (_OFF, "beam search is not supported by this server"),
    "prompt_logprobs": (_OFF, "prompt_logprobs is not supported by this server"),
    "structured_outputs": (_OFF, "use response_format for structured output"),
    "guided_json": (_OFF, "use response_format for structured output"),
    "guided_regex": (_OFF, "regex-guided decoding is not supported by this server"),
    "guided_choice": (_OFF, "choice-guided decoding is not supported by this server"),
    "guided_grammar": (_OFF, "grammar-guided decoding is not supported by this server"),
    "repetition_penalty": ((*_OFF, 1, 1.0), "repetition_penalty is not supported by this "
                           "server; use presence_penalty or frequency_penalty"),
    "min_p": ((*_OFF, 0, 0.0), "min_p is not supported by this server"),
    "stop_token_ids": (_OFF, "stop_token_ids is not supported by this server; use stop"),
    "bad_words": (_OFF, "bad_words is not supported by this server"),
    "allowed_token_ids": (_OFF, "allowed_token_ids is not supported by this server"),
    "include_stop_str_in_output": (_OFF, "include_stop_str_in_output is not supported"),
    "truncate_prompt_tokens": (_OFF, "prompt truncation is not supported by this server"),
    "chat_template": (_OFF, "the model's own chat template is always used"),
    "chat_template_kwargs": (_OFF, "the model's own chat template is always used"),
}


def field_error(field: str, message: str, value: object = None) -> ValidationError:
    """A validation error located at `field`, so that the 400 names it (and `param`)."""
    return ValidationError.from_exception_data("request", [InitErrorDetails(
        type=PydanticCustomError("unsupported", message), loc=(field,), input=value)])


def _is_off(value: object, off: tuple[Any, ...]) -> bool:
    # `==` alone would take 0 for False and 1 for True
    return any(type(value) is type(o) and value == o for o in off)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The last chunk of a stream always carries `usage`; asking for it changes nothing.
    include_usage: bool | None = None


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: served by vLLM's structured outputs (xgrammar)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object holding the schema")
        return self


class SamplingFields(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(
        default=None, ge=1, description="Tokens to generate; unset: the rest of the context.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="OpenAI's newer name for max_tokens.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=INT64_MAX, description="-1 or 0: no top-k.")
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N, description=f"Sequences to sample (at most {MAX_N}).")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    # Accepted; they change nothing in the answer.
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    # Justitia: the agent this request belongs to (or header X-Justitia-Agent).
    agent_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (off, why) in _UNSUPPORTED.items():
                if name in data and not _is_off(data[name], off):
                    raise field_error(name, why, data[name])
        return data

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if isinstance(v, str):
            return [v]
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SamplingFields:
        given = self.model_fields_set
        if ("max_tokens" in given and self.max_tokens is not None
                and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise field_error("max_completion_tokens",
                              f"max_completion_tokens ({self.max_completion_tokens}) and "
                              f"max_tokens ({self.max_tokens}) differ; send one of them",
                              self.max_completion_tokens)
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options needs stream: true")
        return self

    def stop_tuple(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def output_limit(self) -> int | None:
        """The tokens to generate per sequence; None: the rest of the context."""
        return self.max_completion_tokens or self.max_tokens

    def logprobs_k(self) -> int | None:
        """Alternatives per token to return (0: the sampled token's only); None: none."""
        return None

    def json_schema_text(self) -> str | None:
        f = self.response_format
        if f is None or f.type != "json_schema" or f.json_schema is None:
            return None
        return json.dumps(f.json_schema.schema_)

    def json_object(self) -> bool:
        return self.response_format is not None and self.response_format.type == "json_object"


class CompletionRequest(SamplingFields):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]) = Field(
        description="Text, or a list of token ids.")
    max_tokens: int | None = Field(default=16, ge=1,
                                   description="Tokens to generate; null: the rest of the context.")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="Return the log probability of each token and of this many alternatives.")
    best_of: int | None = Field(default=None, ge=1, description="Only unset or equal to n.")
    return_token_ids: bool = Field(
        default=False, description="vLLM's extension: each choice carries the ids of the tokens it generated "
                                   "(`token_ids`), so that a client can resend them exactly.")

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        # Tool calling is a chat feature (OpenAI's too): a completion has no messages to
        # carry the calls and their answers.
        if isinstance(data, dict):
            for name in ("tools", "tool_choice", "parallel_tool_calls"):
                if name in data and not _is_off(data[name], (*_OFF, "none")):
                    raise field_error(name, "tool calling is served on /v1/chat/completions, not on "
                                            "/v1/completions", data[name])
        return data

    @field_validator("prompt", mode="before")
    @classmethod
    def _non_empty(cls, v: object) -> object:
        # Before the union's own checks, so that the answer is one sentence, not one per
        # member of the union.
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        # vLLM's engine samples n sequences and returns them all; picking the best n of more
        # (best_of > n) is not something it does any more.
        if self.best_of is not None and self.best_of != self.n:
            raise field_error("best_of", f"best_of ({self.best_of}) must be unset or equal to n "
                              f"({self.n}): choosing the best of more sequences is not supported",
                              self.best_of)
        return self

    def logprobs_k(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    """One part of a message's content given as a list (only text is served here)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


# OpenAI's rule for function names
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class CalledFunction(BaseModel):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """One message of the conversation. An assistant's turn that called tools carries
    `tool_calls` (its content may be null); each tool's answer is a `role: "tool"` message
    naming the call it answers."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message "
                             "with tool_calls may leave it null)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message may have tool_calls, not a {self.role} one")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id: the id of the call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)  # as vLLM's server joins them
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: content as text, a call's arguments as
        an object (the form Hugging Face templates expect, as vLLM passes them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls]
        return out


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template shows it as written


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(default=False, description="Return the log probability of each token.")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS,
        description="With logprobs: this many most likely alternatives per token.")
    tools: list[ToolDefinition] | None = Field(
        default=None, max_length=128, description="Functions the model may call (at most 128).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description='"auto" (the default with tools) needs --tool-call-parser.')
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs needs logprobs: true",
                              self.top_logprobs)
        return self

    @model_validator(mode="after")
    def _one_grammar(self) -> ChatCompletionRequest:
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise field_error("response_format", "a forced tool call (tool_choice required or named) "
                              "already fixes the answer's format; drop response_format")
        return self

    def functions(self) -> list[dict[str, Any]]:
        """The listed functions, as plain dicts."""
        return [t.function.model_dump(exclude_none=True) for t in self.tools or ()]

    def tool_choice_value(self) -> Any:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, NamedToolChoice) else c

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens the engine served from its prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# The answers, as documented in the OpenAPI schema (the routes build them as dicts).
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(default=None, description="With return_token_ids: the generated ids.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
