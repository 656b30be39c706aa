"""`justitia status`: the command-line face of the SDK's `justitia_sdk._status`.

Only argparse here at module level: the SDK (httpx, rich) loads when the command runs.
"""

from __future__ import annotations

import argparse

from justitia_cli import CommandError, Commands
from justitia_cli.options import add_command


def register(commands: Commands) -> None:
    status = add_command(
        commands.root,
        "status",
        help="Show a server's scheduler and agents (ETA, fair finish, bound).",
        description="A table of the caller's agents on a Justitia server, with the "
                    "scheduler's state.",
        handler=run_status,
    )
    status.add_argument("url", nargs="?", default=None,
                        help="server URL (default: JUSTITIA_URL, else http://127.0.0.1:8000)")
    status.add_argument("--api-key", default=None,
                        help="bearer key (default: JUSTITIA_API_KEY)")
    status.add_argument("--all", action="store_true",
                        help="include finished, cancelled and expired agents")
    status.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")


def run_status(args: argparse.Namespace) -> int:
    from justitia_sdk import JustitiaError
    from justitia_sdk._status import show_status

    try:
        show_status(args.url, args.api_key, args.all, args.watch)
    except JustitiaError as exc:
        raise CommandError(str(exc)) from None
    return 0
