"""The Justitia server (`justitia serve`).

`EmbeddedServer` is the public way to start one from Python, a notebook or a script: it runs
`justitia serve` in a child process, waits until it is ready, and stops it (with its engine)
on exit::

    from server import EmbeddedServer

    with EmbeddedServer(["--kv-tokens", "8192"]) as srv:   # or srv = EmbeddedServer(...).start()
        ...  # srv.url: give it to justitia_sdk.AsyncClient(srv.url)

It imports lazily: `server.scheduler` and the command line do not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.launcher import EmbeddedServer, ServerStartError

__all__ = ["EmbeddedServer", "ServerStartError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from server import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
