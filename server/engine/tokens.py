"""Counting prompt tokens on the server's event loop, cheaply.

The scheduler must know a prompt's length before it admits the request, so every text prompt
is tokenized in the API process. Through a Hugging Face tokenizer's Python layer (and vLLM's
thread-safe wrapper around it) that costs about 40 us plus lock and copy overhead per call, on
the one event loop that also serves every other request. The Rust tokenizer behind a "fast"
tokenizer does the same encoding in about 15 us (measured with the embedded model).

It is used only where it is *exactly* the tokenizer's own encoding: special tokens (BOS)
come from the Rust post-processor, which some tokenizers configure differently from their
Python layer, so the two are compared on sample texts first and the Python layer is kept on
any difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.engine.base import NOT_STARTED, ChatMessages, EngineError, EngineInfo, InvalidRequestError

SAMPLES = (
    "Justitia schedules agents fairly.",
    "hello",
    "  leading spaces,\ttabs\nand newlines ",
    "ünïcödé, 日本語, emoji 🙂, digits 0123456789",
    "word " * 40,
    "",
)


def _backend(tokenizer: Any) -> Any | None:
    for obj in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        backend = getattr(obj, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode"):
            return backend
    return None


def fast_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """`tokenizer.encode`, or an exact equivalent through its Rust backend."""

    def slow(text: str) -> list[int]:
        return list(tokenizer.encode(text))

    backend = _backend(tokenizer)
    if backend is None:
        return slow

    def fast(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=True).ids

    try:
        same = all(fast(s) == slow(s) for s in SAMPLES)
    except Exception:
        same = False
    return fast if same else slow


class TokenizerEngine:
    """What the engines that load the model's Hugging Face tokenizer share: `info`,
    `tokenize` and the chat template, each refused with one message before `start`.

    A subclass sets `_info`, `_tokenizer` and `_encode` (see `fast_encoder`) when it starts.
    """

    _info: EngineInfo | None = None
    _tokenizer: Any = None
    _encode: Callable[[str], list[int]] | None = None
    tokenizer_name: str | None = None  # `--tokenizer`: in place of the served model's own

    def _load_tokenizer(self, model: str) -> Any:
        """The Hugging Face tokenizer of `model` (or `tokenizer_name`), loaded in this
        process: the scheduler counts a prompt's tokens before it admits the request. It
        must be available here (a folder, or a hub id already in the local cache)."""
        from transformers import AutoTokenizer

        name = self.tokenizer_name or model
        try:
            return AutoTokenizer.from_pretrained(name)
        except Exception as exc:
            raise EngineError(
                f"cannot load the tokenizer {name!r} in the scheduler's process (it counts tokens "
                f"before admitting a request): {exc}; pass --tokenizer PATH") from exc

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError(NOT_STARTED)
        return self._info

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (None before start); vLLM's tool-call parsers
        read a model's call format with it."""
        return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        if self._encode is None:
            raise EngineError(NOT_STARTED)
        return self._encode(text)

    def apply_chat_template(self, messages: ChatMessages,
                            tools: Sequence[dict[str, Any]] | None = None) -> str | None:
        # Before start, or a model without a template (the embedded tiny one): None.
        if not getattr(self._tokenizer, "chat_template", None):
            return None
        try:
            return str(self._tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=True))
        except Exception as exc:  # a template refuses some conversations (roles out of order)
            raise InvalidRequestError(
                f"the model's chat template refuses these messages: {exc}") from exc
