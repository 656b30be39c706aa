"""What the engine-timing benchmarks share (`shared_head_decode.py`, `attended_context.py`):
the embedded server they time, the completion they send, and the JSON they write.

Each times batches of completions on the embedded server (justitia, the vLLM CPU engine, the
tiny model) with `ignore_eos`, so that every request decodes exactly the tokens asked for.
"""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from server.launcher import EmbeddedServer
from server.sim.provenance import write_result

TOKENS = (100, 780)  # token ids inside the tiny model's vocabulary
TAIL = 16  # tokens after a head, so that no two prompts are the same

Complete = Callable[[list[int], int], Awaitable[None]]


@contextmanager
def embedded_server(kv_tokens: int, max_model_len: int, prefix: str) -> Iterator[str]:
    """The embedded server (policy justitia) in a fresh data folder; yields its URL."""
    home = tempfile.mkdtemp(prefix=prefix)
    args = ["--policy", "justitia", "--kv-tokens", str(kv_tokens), "--max-model-len", str(max_model_len),
            "--data-dir", home]
    with EmbeddedServer(args) as srv:
        yield srv.url


def completer(client: httpx.AsyncClient) -> Complete:
    """`complete(prompt, max_tokens)`: one completion of exactly `max_tokens` tokens."""

    async def complete(prompt: list[int], max_tokens: int) -> None:
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                       "ignore_eos": True, "temperature": 0.0})
        r.raise_for_status()

    return complete


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write the benchmark's result where --json asked (nothing without it)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_result(path, result, indent=1)
    print(f"wrote {path}")
