"""What the command parsers share: a subcommand made with the one help formatter, and the
options several commands take, each spelled once (flag, type, metavar); the help text is
the command's own where it says more than the default."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from justitia_cli import formatter

Handler = Callable[[argparse.Namespace], int]


def add_command(group: argparse._SubParsersAction, name: str, *, help: str, description: str,
                handler: Handler) -> argparse.ArgumentParser:
    """The subcommand `name` of `group`: `help` in the group's list, `description` on its own
    page, `handler` run with the parsed options."""
    parser: argparse.ArgumentParser = group.add_parser(name, help=help, description=description,
                                                       formatter_class=formatter)
    parser.set_defaults(handler=handler)
    return parser


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def kv_tokens_option(parser: argparse.ArgumentParser, help: str, *, default: int | None = None,
                     required: bool = False, metavar: str = "M") -> None:
    """--kv-tokens: the engine's KV cache capacity in tokens."""
    parser.add_argument("--kv-tokens", type=int, default=default, required=required,
                        metavar=metavar, help=help)


def max_model_len_option(parser: argparse.ArgumentParser, help: str) -> None:
    """--max-model-len: the engine's context length (longest prompt + output)."""
    parser.add_argument("--max-model-len", type=int, default=2048, metavar="N", help=help)


def json_option(parser: argparse.ArgumentParser, help: str = "write the results JSON here") -> None:
    """--json OUT: where the command writes its results as JSON."""
    parser.add_argument("--json", metavar="OUT", default=None, help=help)


def seed_option(parser: argparse.ArgumentParser, help: str) -> None:
    """--seed: what the command's randomness starts from (the same seed, the same run)."""
    parser.add_argument("--seed", type=int, default=0, help=help)


def quiet_option(parser: argparse.ArgumentParser, help: str = "no table on the terminal") -> None:
    parser.add_argument("--quiet", action="store_true", help=help)

