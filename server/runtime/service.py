"""The path of one inference request: validate, tokenize, run it on the engine.

The HTTP layer (openai_api.py, agents_api.py) stays thin and calls this module; the
scheduler sits between `InferenceService.stream` and the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.to_thread

from server.engine.base import (
    Engine,
    EngineOutput,
    InvalidRequestError,
    SamplingOptions,
    check_context,
    check_min_tokens,
    check_vocabulary,
)
from server.runtime.agents import DEFAULT_AGENT_TYPE
from server.scheduler import AgentShape, kv_cost

if TYPE_CHECKING:
    from server.runtime.agents import AgentEntry, SessionRef
    from server.runtime.live import LiveScheduler

T = TypeVar("T")

#: No tokenizer here makes a token of more characters: a longer prompt cannot fit the context,
#: and is refused before it is tokenized (a 4 MB prompt took 8 s of the event loop).
MAX_CHARS_PER_TOKEN = 128
#: A prompt of over twice this many characters per token of context has its head of this
#: many characters per token tokenized first, and is refused if that alone cannot fit.
PROBE_CHARS_PER_TOKEN = 8
PROBE_SLACK_TOKENS = 64
#: Prompts longer than this are tokenized in a worker thread, off the event loop.
OFF_LOOP_CHARS = 32 * 1024


async def off_loop_if(heavy: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, in a worker thread when `heavy` (the event loop serves every
    client; seconds of parsing or tokenizing on it stall them all)."""
    if not heavy:
        return fn(*args, **kwargs)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions


def render_chat(messages: Sequence[dict[str, Any]], engine: Engine,
                tools: Sequence[dict[str, Any]] | None = None) -> str:
    """The model's chat template when it has one; a plain role-prefixed transcript if not
    (the embedded tiny model has none), which lists the `tools` (OpenAI's `{"type":
    "function", "function": ...}` objects) and in which a tool call reads
    `assistant (tool call ID): NAME(ARGUMENTS)` and its answer `tool (ID): RESULT`."""
    templated = engine.apply_chat_template(messages, tools=tools)
    if templated is not None:
        return templated
    lines = [f"tools: {json.dumps([t['function'] for t in tools])}"] if tools else []
    for m in messages:
        if m.get("content") or not m.get("tool_calls"):
            who = f"tool ({m['tool_call_id']})" if m.get("tool_call_id") else m["role"]
            lines.append(f"{who}: {m.get('content') or ''}")
        for call in m.get("tool_calls") or ():
            args = call["function"]["arguments"]
            text = args if isinstance(args, str) else json.dumps(args)
            lines.append(f"{m['role']} (tool call {call['id']}): {call['function']['name']}({text})")
    return "\n".join(lines) + "\nassistant:"


class InferenceService:
    def __init__(self, engine: Engine, model_name: str, scheduler: LiveScheduler) -> None:
        self.engine = engine
        self.model_name = model_name
        self.scheduler = scheduler

    def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling: SamplingOptions,
        *,
        fill_context: bool = False,
        token_cap: int | None = None,
    ) -> PreparedRequest:
        """Tokenize and check that prompt + output fit the model's context and the KV cache.

        `fill_context`: the caller gave no max_tokens; the output may fill the rest of the
        context (as vLLM's own server does), of the tenant's `token_cap` (prompt + output,
        --max-request-tokens) or of the KV cache when `n` sequences share it.
        """
        ids = self._token_ids(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty after tokenization")
        if fill_context:
            room = self._room(len(ids), sampling.n, token_cap)
            sampling = dataclasses.replace(sampling, max_tokens=max(1, room))
        self._check_fits(len(ids), sampling)
        check_min_tokens(sampling)
        info = self.engine.info
        if sampling.logprobs is not None and sampling.logprobs > info.max_logprobs:
            raise InvalidRequestError(
                f"logprobs: at most {info.max_logprobs} alternatives per token are served "
                f"here; {sampling.logprobs} were asked for", param="logprobs")
        return PreparedRequest(request_id, tuple(ids), sampling)

    async def prepare_async(self, request_id: str, prompt: str | list[int],
                            sampling: SamplingOptions, **kwargs: Any) -> PreparedRequest:
        """`prepare`, in a worker thread for a long prompt."""
        return await off_loop_if(len(prompt) > OFF_LOOP_CHARS, self.prepare, request_id,
                                 prompt, sampling, **kwargs)

    def _room(self, prompt_tokens: int, n: int, token_cap: int | None) -> int:
        """The most output tokens each of `n` sequences can have: the rest of the context
        (or of the tenant's cap), and for n > 1 the share of the KV cache that lets all n
        run at once."""
        info = self.engine.info
        room = min(info.max_model_len, token_cap or info.max_model_len) - prompt_tokens
        if n > 1:
            per_sequence = info.kv_capacity_tokens // n // info.block_size * info.block_size
            room = min(room, per_sequence - prompt_tokens)
        return room

    def _check_fits(self, p: int, sampling: SamplingOptions) -> None:
        info = self.engine.info
        check_context(p, sampling.max_tokens, info.max_model_len)
        # vLLM holds a copy of the prompt per sequence; the scheduler admits a request only
        # when all of it fits, so one that never can would wait forever.
        block = info.block_size
        need = sampling.n * (-(-(p + sampling.max_tokens) // block) * block)
        if sampling.n > 1 and need > info.kv_capacity_tokens:
            raise InvalidRequestError(
                f"n={sampling.n} sequences of {p} prompt + {sampling.max_tokens} output tokens "
                f"need {need} tokens of KV cache; this server has {info.kv_capacity_tokens}: "
                "lower n or max_tokens", param="n")

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        context = self.engine.info.max_model_len
        if len(prompt) > context * (MAX_CHARS_PER_TOKEN if isinstance(prompt, str) else 1):
            unit = "characters" if isinstance(prompt, str) else "token ids"
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} {unit}: it cannot fit the model's context of "
                f"{context} tokens")
        if isinstance(prompt, str):
            try:
                self._refuse_if_head_overflows(prompt, context)
                return self.engine.tokenize(prompt)
            except (TypeError, ValueError) as exc:  # text the tokenizer cannot take
                raise InvalidRequestError(f"the prompt cannot be tokenized: {exc}") from exc
        # Checked here, before the request queues: vLLM refuses such ids only once the
        # request reaches it, where its refusal would surface as a 500.
        check_vocabulary(prompt, self.engine.info.vocab_size)
        return list(prompt)

    def _refuse_if_head_overflows(self, prompt: str, context: int) -> None:
        """A long prompt's head is tokenized first: when it alone cannot fit, the rest is
        not tokenized (262k characters of CJK text are ~262k tokens, seconds of work, for a
        context of 2,048)."""
        head_chars = context * PROBE_CHARS_PER_TOKEN
        if len(prompt) <= 2 * head_chars:
            return
        head = len(self.engine.tokenize(prompt[:head_chars]))
        # a token split at the cut can only add a few tokens to the head's count
        if head > context + PROBE_SLACK_TOKENS:
            raise InvalidRequestError(
                f"the prompt cannot fit the model's context of {context} tokens: its first "
                f"{head_chars} of {len(prompt)} characters alone are {head} tokens")

    def agent_for(
        self, agent_id: str | None, tenant: str, prepared: PreparedRequest, prompt_text: str,
        session: SessionRef | None = None,
    ) -> AgentEntry:
        """The agent a request belongs to: the tagged one; else its session's implicit agent
        (server/api/sessions.py); else a one-request agent of type `default`, charged exactly
        what the request can cost, so that any OpenAI client is scheduled fairly without
        knowing about agents; its ETA waits for room for the request (admission reserves its
        prompt and max_tokens for each of its `n` sequences). The agent tag wins over a
        session header."""
        if agent_id is not None:
            entry = self.scheduler.get(agent_id, tenant)
            self.scheduler.require_live(entry)
            return entry
        if session is not None:
            return self.scheduler.session_agent(tenant, session.session_id, session.agent_type, prompt_text)
        p, d = len(prepared.prompt_token_ids), prepared.sampling.max_tokens
        return self.scheduler.register(
            DEFAULT_AGENT_TYPE, prompt_text, tenant,
            predicted_cost=prepared.sampling.n * kv_cost(p, d), auto=True,
            shape=AgentShape(stages=1, first_request_tokens=prepared.sampling.n * (p + d)),
        )

    async def stream(self, prepared: PreparedRequest, agent: AgentEntry) -> AsyncIterator[EngineOutput]:
        """The request's outputs, after the scheduler admits it."""
        run = self.scheduler.run(agent, prepared.request_id, prepared.prompt_token_ids,
                                 prepared.sampling)
        # aclosing: if our consumer stops early, the scheduler's generator is closed now
        # (aborting the engine request) rather than whenever it is garbage collected.
        async with contextlib.aclosing(run) as outputs:
            async for out in outputs:
                yield out
