"""`justitia model init-tiny`: the embedded tiny model written to a folder."""

from __future__ import annotations

import argparse

from justitia_cli import CommandError, Commands
from justitia_cli.options import add_command


def register(commands: Commands) -> None:
    init_tiny = add_command(
        commands.model,
        "init-tiny",
        help="Write the embedded tiny model (config + tokenizer, no weights) to DIR.",
        description=(
            "Write a tiny Llama model folder (config.json, tokenizer.json, "
            "tokenizer_config.json) that vLLM runs with random weights and no downloads."
        ),
        handler=run_init_tiny,
    )
    init_tiny.add_argument("dir", metavar="DIR", help="folder to create")
    init_tiny.add_argument("--force", action="store_true", help="overwrite DIR's contents")


def run_init_tiny(args: argparse.Namespace) -> int:
    from server.engine.tiny_model import init_tiny

    try:
        path = init_tiny(args.dir, overwrite=args.force)
    except FileExistsError as exc:
        raise CommandError(f"{exc} (or pass --force)") from None
    print(f"tiny model written to {path}")
    return 0
