"""The command line shared by the examples: run an agent over its inputs file.

    python examples/mapreduce_summary.py                 # embedded server, all inputs
    python examples/mapreduce_summary.py --url http://127.0.0.1:8000 --limit 2
    python examples/mapreduce_summary.py --samples out.jsonl   # profile for train-predictor

Without --url (or JUSTITIA_URL) it starts the embedded server (vLLM CPU engine, tiny model
with random weights: the text is noise, the scheduling is real) and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio

from justitia_sdk import Agent, AsyncClient, Batch, samples_of

HERE = Path(__file__).resolve().parent


def inputs_path(name: str) -> Path:
    return HERE / "inputs" / f"{name}.jsonl"


def load_inputs(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The agent's arguments, one JSON object (keyword arguments) per line."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{n}: not JSON: {exc}") from None
    return rows[:limit] if limit else rows


@contextmanager
def server_url(url: str | None, kv_tokens: int) -> Iterator[str]:
    url = url or os.environ.get("JUSTITIA_URL")
    if url:
        yield url
        return
    import httpx
    from rich.console import Console

    from server import EmbeddedServer

    with Console().status("starting the embedded server (vLLM CPU engine, ~30 s)..."):
        srv = EmbeddedServer(["--kv-tokens", str(kv_tokens)]).start()
        # The engine's first step is slow (warm-up): keep it out of the agents' timings.
        httpx.post(srv.url + "/v1/completions", timeout=120,
                   json={"prompt": "Warm up the engine before the agents run.", "max_tokens": 8})
    try:
        yield srv.url
    finally:
        srv.stop()


def _short(value: Any, width: int = 100) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def main(agent: Agent[..., Any], default_inputs: Path, argv: list[str] | None = None) -> Batch:
    parser = argparse.ArgumentParser(description=f"Run the {agent.name!r} example agent.")
    parser.add_argument("--url", help="a running Justitia server (default: JUSTITIA_URL, "
                                      "else start the embedded one)")
    parser.add_argument("--inputs", default=str(default_inputs), help="JSON Lines of arguments")
    parser.add_argument("--limit", type=int, help="run only the first N inputs")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="embedded server KV tokens")
    parser.add_argument("--samples", help="write training samples (JSON Lines) here")
    parser.add_argument("--no-progress", action="store_true", help="no live table")
    args = parser.parse_args(argv)
    inputs = load_inputs(args.inputs, args.limit)

    async def go(url: str) -> Batch:
        async with AsyncClient(url) as client:
            return await client.submit_many(agent, inputs, progress=not args.no_progress)

    with server_url(args.url, args.kv_tokens) as url:
        batch = anyio.run(go, url)
    for h in batch:
        shown = f"error: {h.error!r}" if h.error else _short(h.result)
        print(f"#{h.index} {h.status}: {shown}")
    if args.samples:
        rows = samples_of(batch)
        Path(args.samples).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{len(rows)} samples written to {args.samples}")
    if batch.errors:
        raise SystemExit(1)
    return batch
