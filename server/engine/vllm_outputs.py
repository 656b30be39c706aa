"""vLLM's side of one request: our sampling options as its SamplingParams, its outputs as
our sequences (text, token ids, logprobs, finish reasons), its prefix-cache hits."""

from __future__ import annotations

from typing import Any

from server.engine.base import (
    EngineTimes,
    SamplingOptions,
    SequenceOutput,
    TokenLogprob,
)


def sampling_params(s: SamplingOptions) -> Any:
    from vllm import SamplingParams

    structured = None
    if s.json_object or s.json_schema is not None:
        from vllm.sampling_params import StructuredOutputsParams

        structured = (StructuredOutputsParams(json=s.json_schema) if s.json_schema is not None
                      else StructuredOutputsParams(json_object=True))
    return SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=list(s.stop) or None,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        structured_outputs=structured,
    )


class Sequences:
    """The latest state of each of a request's sequences, and what is new in each.

    vLLM's outputs are cumulative (the whole text and token list so far); an output may carry
    only some of the `n` sequences, so the last state of each is kept here.
    """

    def __init__(self, tokenizer: Any, logprobs: int | None) -> None:
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._state: dict[int, SequenceOutput] = {}

    def update(self, completions: list[Any]) -> tuple[SequenceOutput, ...]:
        for c in completions:
            prev = self._state.get(c.index)
            sent_text = len(prev.text) if prev else 0
            sent_tokens = prev.output_tokens if prev else 0
            self._state[c.index] = SequenceOutput(
                index=c.index,
                text=c.text,
                output_tokens=len(c.token_ids),
                finish_reason=c.finish_reason,
                delta_text=c.text[sent_text:],
                delta_logprobs=self._new_logprobs(c, sent_tokens),
                token_ids=tuple(c.token_ids) if c.finish_reason is not None else (),
            )
        return tuple(self._state[i] for i in sorted(self._state))

    def _new_logprobs(self, c: Any, sent: int) -> tuple[TokenLogprob, ...]:
        if self._logprobs is None or not c.logprobs:
            return ()
        return tuple(_token_logprob(tid, step, self._logprobs, self._tokenizer)
                     for tid, step in zip(c.token_ids[sent:], c.logprobs[sent:], strict=True))


def _token_logprob(token_id: int, step: dict[int, Any], k: int, tokenizer: Any) -> TokenLogprob:
    """vLLM's per-step dict (token id -> Logprob, the sampled token always included) in the
    order OpenAI gives: the sampled token, then the alternatives by rank."""

    def text(tid: int, lp: Any) -> str:
        return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])

    sampled = step[token_id]
    # vLLM adds the sampled token to the k most likely when it is not among them; OpenAI's
    # top list holds the k most likely only (ranks 1..k).
    ranked = sorted((lp.rank, tid, lp) for tid, lp in step.items() if lp.rank <= k)
    top = tuple((text(tid, lp), float(lp.logprob)) for _, tid, lp in ranked)
    return TokenLogprob(text(token_id, sampled), float(sampled.logprob), top)


def cached_tokens(out: Any) -> int | None:
    """Prompt tokens vLLM found in its prefix cache for this request (None: not reported)."""
    cached = getattr(out, "num_cached_tokens", None)
    return int(cached) if isinstance(cached, int) and cached >= 0 else None


def engine_times(metrics: Any, sent_at: float, now: float) -> EngineTimes | None:
    """A finished request's time inside the engine from vLLM's per-request stats
    (`RequestOutput.metrics`: the engine core's monotonic timestamps of its queueing, first
    step, first and last token), with `sent_at` (when the server handed it over) and `now`
    (when its last output reached the server), both `time.monotonic()`: the engine core is a
    process of this host, and Linux's monotonic clock is one for all its processes. None when
    vLLM recorded no step for it (stats off, or aborted before one)."""
    queued = float(getattr(metrics, "queued_ts", 0.0) or 0.0)
    scheduled = float(getattr(metrics, "scheduled_ts", 0.0) or 0.0)
    first = float(getattr(metrics, "first_token_ts", 0.0) or 0.0)
    last = float(getattr(metrics, "last_token_ts", 0.0) or 0.0)
    if not 0.0 < queued <= scheduled <= first <= last:
        return None
    return EngineTimes(to_engine_s=queued - sent_at, queued_s=scheduled - queued, prefill_s=first - scheduled,
                       decode_s=last - first, from_engine_s=now - last)
