"""The `justitia` command line: its one host.

Each command lives beside the code it drives (`server/cli/`, `justitia_cli/bench/`,
`predictors/cli.py`, and here the client-side `demo` and `status`): this module builds the
top-level parser, asks every command module to register its subcommands, and holds what they
share (`CommandError`, `formatter`). The SDK (`justitia_sdk`) is not a host: it talks HTTP
only and imports nothing of `server` or `predictors`.

Command modules import nothing heavy at module level (vLLM, torch, scikit-learn load only
when a command runs), so that `justitia --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from dataclasses import dataclass

# Modules that own commands. Each has `register(commands: Commands) -> None`.
COMMAND_MODULES = (
    "server.cli",
    "justitia_cli.bench.commands",
    "justitia_cli.bench.family",
    "predictors.cli",
    "justitia_cli.demo",
    "justitia_cli.status",
)


@dataclass
class Commands:
    """The subcommand groups a command module may add to."""

    root: argparse._SubParsersAction
    model: argparse._SubParsersAction
    bench: argparse._SubParsersAction
    predictor: argparse._SubParsersAction


class CommandError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it says something (not None/False, not already named)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action) or ""

    def _split_lines(self, text: str, width: int) -> list[str]:
        # never inside a name: "justitia-noretain" stays one word (copyable from the help)
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return _HelpFormatter(prog, max_help_position=32)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="justitia",
        description=(
            "Justitia: fair and fast scheduling of task-parallel LLM agents. "
            "Serve agents on vLLM, benchmark schedulers, train cost predictors."
        ),
        formatter_class=_formatter,
    )
    root = parser.add_subparsers(title="commands", metavar="COMMAND")

    def group(name: str, help_text: str) -> argparse._SubParsersAction:
        p = root.add_parser(name, help=help_text, description=help_text, formatter_class=_formatter)
        p.set_defaults(handler=lambda args, p=p: p.print_help() or 2)
        return p.add_subparsers(title="subcommands", metavar="SUBCOMMAND")

    commands = Commands(
        root=root,
        model=group("model", "Create and inspect local models (no downloads)."),
        bench=group("bench", "Build workloads and compare scheduling policies (simulated or live)."),
        predictor=group("predictor", "Evaluate trained cost predictors."),
    )
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only our own missing command modules are tolerated (work in progress);
            # a missing dependency inside one is a real error.
            if exc.name != name:
                raise
            continue
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except CommandError as exc:
        print(f"justitia: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("justitia: interrupted", file=sys.stderr)
        return 130


def formatter(prog: str) -> argparse.HelpFormatter:
    """The help formatter every command uses (shows defaults)."""
    return _formatter(prog)
