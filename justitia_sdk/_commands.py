"""Client-side commands: `justitia demo` (the README's main job)."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any) -> None:
    from justitia_sdk.cli import formatter

    demo = commands.root.add_parser(
        "demo",
        help="Start the embedded server on the vLLM CPU engine and run requests through it.",
        description=(
            "The main job on the embedded default: start the bundled server (in-process "
            "vLLM engine, embedded tiny model), send work through it, print what came back, "
            "and stop the server."
        ),
        formatter_class=formatter,
    )
    demo.add_argument("--kv-tokens", type=int, default=8192, metavar="N",
                      help="KV cache capacity of the embedded engine in tokens")
    demo.add_argument("--prompt", default="Summarize: agents fire many requests in parallel.",
                      help="prompt of the completion")
    demo.add_argument("--max-tokens", type=int, default=24, metavar="N",
                      help="tokens to generate")
    demo.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.table import Table

    from server.launcher import EmbeddedServer

    console = Console()
    with console.status("starting the embedded server (vLLM CPU engine, ~30 s)..."):
        server = EmbeddedServer(["--kv-tokens", str(args.kv_tokens)]).start()
    try:
        console.print(f"server ready at {server.url}")
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": args.prompt, "max_tokens": args.max_tokens, "ignore_eos": True},
            timeout=120,
        )
        r.raise_for_status()
        body = r.json()
        table = Table(title="completion from the embedded engine")
        for col in ("prompt", "text (noise: random weights)", "prompt tokens", "output tokens"):
            table.add_column(col)
        table.add_row(args.prompt, repr(body["choices"][0]["text"]),
                      str(body["usage"]["prompt_tokens"]), str(body["usage"]["completion_tokens"]))
        console.print(table)
    finally:
        server.stop()
    return 0
