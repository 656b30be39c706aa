"""`justitia serve` and `justitia model ...`, one module a concern: the serve parser
(`serve_options`), its options read and checked (`serve_checks`), the server run
(`serving`), and the model commands (`model`). Heavy imports happen inside the handlers."""

from __future__ import annotations

from justitia_cli import Commands
from server.cli import model, serve_options


def register(commands: Commands) -> None:
    serve_options.register(commands)
    model.register(commands)
