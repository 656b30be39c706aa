"""The live view of a batch: a rich table refreshed in place, in a terminal or in Jupyter.

In a terminal it is a `rich.live.Live`. In Jupyter it is an HTML rendering of the same table
in a display updated by id (`IPython.display`), which needs no widget extension and keeps
the final table in the saved notebook.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import anyio
from rich.console import Console
from rich.table import Table

from justitia_sdk._batch import Batch
from justitia_sdk._render import to_html


def in_jupyter() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class LiveView:
    """`async with LiveView(batch):` shows the batch's table, refreshed, until the block ends."""

    def __init__(self, batch: Batch, *, refresh_s: float = 0.5, max_rows: int = 30,
                 console: Console | None = None) -> None:
        self.batch = batch
        self.refresh_s = refresh_s
        self.max_rows = max_rows
        self.console = console
        self._stack = AsyncExitStack()

    def _live_table(self) -> Table:
        return self.batch.table(live=True, max_rows=self.max_rows)

    async def __aenter__(self) -> LiveView:
        await self._stack.__aenter__()
        if in_jupyter():
            from IPython.display import HTML, display

            handle = display(HTML(to_html(self._live_table())), display_id=True)

            async def refresh() -> None:
                while True:
                    await anyio.sleep(self.refresh_s)
                    try:
                        handle.update(HTML(to_html(self._live_table())))
                    except Exception:  # noqa: BLE001 - a display hiccup must not stop the batch
                        pass

            def final() -> None:
                handle.update(HTML(to_html(self.batch.table(max_rows=200))))
        else:
            from rich.live import Live

            live = Live(get_renderable=self._live_table, console=self.console or Console(),
                        refresh_per_second=1 / self.refresh_s, transient=True)
            live.start()
            refresh = None  # type: ignore[assignment]

            def final() -> None:
                live.stop()
                live.console.print(self.batch.table(max_rows=200))

        self._stack.callback(final)
        if refresh is not None:
            tg = await self._stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(refresh)
            self._stack.callback(tg.cancel_scope.cancel)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._stack.__aexit__(*exc)
