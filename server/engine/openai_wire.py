"""The wire format of the remote engine: vLLM's OpenAI completions API, streamed.

Requests go out as streaming completions of token ids with `stream_options.include_usage`;
vLLM streams one chunk per generated token and choice. This module turns `SamplingOptions`
into the request's fields and the streamed chunks back into `EngineOutput`s; it does no
I/O of its own beyond reading the response it is given.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from server.engine.base import EngineOutput, SamplingOptions, SequenceOutput, TokenLogprob


def sampling_body(s: SamplingOptions) -> dict[str, Any]:
    """The sampling fields of a vLLM OpenAI completions request."""
    body: dict[str, Any] = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "top_k": s.top_k, "seed": s.seed, "stop": list(s.stop) or None,
            "ignore_eos": s.ignore_eos, "min_tokens": s.min_tokens, "n": s.n,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty}
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
    if s.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "schema",
                                                   "schema": json.loads(s.json_schema)}}
    elif s.json_object:
        body["response_format"] = {"type": "json_object"}
    return body


@dataclass
class _ChoiceUpdate:
    """What one network read added to one choice (sequence) of a streamed completion."""

    text: str = ""
    tokens: int = 0
    finish: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Usage:
    """A streamed completion's usage: vLLM's output token count and, when the replica runs
    with `--enable-prompt-tokens-details`, the prompt tokens it served from its prefix cache."""

    completion_tokens: int
    cached_tokens: int | None = None


class RemoteSequences:
    """Each sequence's text and token count so far, from the replica's streamed choices."""

    def __init__(self, n: int) -> None:
        self.text = [""] * n
        self.tokens = [0] * n
        self.finish: list[str | None] = [None] * n
        self.total: int | None = None  # vLLM's own count (usage), once it is sent
        self.cached: int | None = None  # prompt tokens from its prefix cache (usage), if sent
        self.last: dict[int, _ChoiceUpdate] = {}

    def update(self, choices: dict[int, _ChoiceUpdate], usage: Usage | None) -> bool:
        """Take one read's updates; True when some sequence got new tokens."""
        self.last = {i: c for i, c in choices.items() if 0 <= i < len(self.text)}
        for i, c in self.last.items():
            self.text[i] += c.text
            self.tokens[i] += c.tokens
            self.finish[i] = c.finish or self.finish[i]
        if usage is not None:
            self.total = usage.completion_tokens
            self.cached = usage.cached_tokens
        return any(c.tokens for c in self.last.values())

    def abort(self) -> None:
        self.finish = [f or "abort" for f in self.finish]
        self.last = {}

    def output(self, request_id: str, prompt_tokens: int, finished: bool) -> EngineOutput:
        last = self.last if not finished else {}
        if finished and self.total is not None and len(self.tokens) == 1:
            self.tokens[0] = self.total  # vLLM's count: a last event may carry no token
        seqs = tuple(
            SequenceOutput(i, self.text[i], self.tokens[i],
                           (self.finish[i] or "abort") if finished else None,
                           last[i].text if i in last else "",
                           tuple(last[i].logprobs) if i in last else ())
            for i in range(len(self.text)))
        total = self.total if finished and self.total is not None else sum(self.tokens)
        return EngineOutput(request_id, seqs[0].text, prompt_tokens, total, finished,
                            seqs[0].finish_reason, delta_text=seqs[0].delta_text,
                            sequences=seqs, cached_tokens=self.cached if finished else None)


async def read_stream(
    resp: aiohttp.ClientResponse, k: int = 0,
) -> AsyncGenerator[tuple[dict[int, _ChoiceUpdate], Usage | None], None]:
    """(what each choice added, the usage once it is sent) once per network read; `k`: the
    alternatives per token asked for (logprobs).

    vLLM sends one SSE event per token and choice. Everything already buffered is folded
    into one update, and the loop is given a turn after each read: a consumer that fell
    behind catches up in one step instead of replaying thousands of events without yielding
    to the event loop (which starved every other request and delayed aborts by seconds).
    """
    pending = b""
    async for data in resp.content.iter_any():
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        choices: dict[int, _ChoiceUpdate] = {}
        usage = None
        for raw in lines:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                c = choices.setdefault(int(choice.get("index", 0)), _ChoiceUpdate())
                c.tokens += 1
                c.text += choice.get("text") or ""
                c.finish = choice.get("finish_reason") or c.finish
                c.logprobs.extend(_logprobs(choice.get("logprobs"), k))
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens")
                usage = Usage(int(chunk["usage"]["completion_tokens"]),
                              int(cached) if cached is not None else None)
        yield choices, usage
        await asyncio.sleep(0)


def _logprobs(lp: dict[str, Any] | None, k: int) -> list[TokenLogprob]:
    """vLLM's completions logprobs (parallel lists) as TokenLogprobs; its per-token top dict
    also holds the sampled token when that is not among the k most likely, so it is cut to
    the k most likely."""
    if not lp:
        return []
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    return [TokenLogprob(tok, float(v) if v is not None else float("-inf"),
                         tuple(sorted((top or {}).items(), key=lambda kv: -kv[1])[:k]))
            for tok, v, top in zip(tokens, values, tops, strict=False)]
