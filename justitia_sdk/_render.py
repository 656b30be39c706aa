"""A batch as a rich table: the live view's and the final one, in a terminal or as HTML."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any, Protocol

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from justitia_sdk._handle import AgentHandle


class TableSource(Protocol):
    """What a table is made of: a batch's title, summary line and handles."""

    title: str

    def summary(self) -> str: ...

    def __iter__(self) -> Iterator[AgentHandle]: ...


STATE_STYLE = {
    "pending": "dim",
    "queued": "yellow",
    "running": "cyan",
    "paused": "blue",
    "finished": "green",
    "cancelled": "magenta",
    "expired": "red",
    "failed": "bold red",
}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _state(h: AgentHandle) -> Text:
    return Text(h.status, style=STATE_STYLE.get(h.status, ""))


def batch_table(batch: TableSource, *, live: bool = False, max_rows: int | None = None) -> Table:
    """Live: state, requests, elapsed, ETA, fair finish, bound. After: the JCT, the first
    ETA and the first deadline (fair finish + bound as first given), and whether the JCT
    kept that deadline; with a `runs/regs` column when an input ran or registered more than
    once. Times are seconds since each input's first submission; the caption is the
    batch's summary (counts, promises kept, ETA error, the batch's ETA)."""
    summary = batch.summary()
    table = Table(title=f"{batch.title} - seconds since each input's first submission",
                  caption=summary, title_justify="left", caption_justify="left",
                  box=box.SIMPLE_HEAD)
    table.add_column("#", justify="right", style="dim")
    table.add_column("agent", no_wrap=True, overflow="ellipsis", max_width=22)
    table.add_column("state", no_wrap=True)
    tries = not live and any(h.retried for h in batch)
    numeric = (
        ["reqs", "elapsed", "ETA", "fair", "bound"] if live else
        ["JCT", "1st ETA", "1st deadline"]
    )
    for name in numeric:
        table.add_column(name, justify="right", no_wrap=True)
    if not live:
        table.add_column("kept", justify="center", no_wrap=True)
    if tries:
        table.add_column("runs/regs", justify="right", no_wrap=True)

    handles = list(batch)
    hidden = 0
    if max_rows is not None and len(handles) > max_rows:
        # Show what is still moving first; finished runs are summarized in the caption.
        handles.sort(key=lambda h: (h.done, h.index))
        hidden = len(handles) - max_rows
        handles = sorted(handles[:max_rows], key=lambda h: h.index)
    for h in handles:
        done, total = h.progress
        reqs = f"{done}/{total}" if h.record else "-"
        if live:
            cells = [reqs, _s(h.elapsed_s), _s(h.eta_s), _s(h.fair_finish_s), _s(h.delay_bound_s)]
        else:
            # "kept" says whether the JCT is within the first deadline, both beside it.
            cells = [_s(h.jct_s), _s(h.first_eta_s), _s(h.first_deadline_s)]
        row: list[Any] = [str(h.index), h.agent.name, _state(h), *cells]
        if not live:
            kept = h.kept_promise
            row.append(Text("yes", "green") if kept else Text("no", "red") if kept is False
                       else Text("-", "dim"))
        if tries:
            row.append(f"{h.attempts}/{h.registrations}" if h.retried else "")
        table.add_row(*row)
    if hidden:
        table.caption = f"{summary} ({hidden} more not shown)"
    return table


def to_html(renderable: Any, width: int = 120) -> str:
    console = Console(record=True, file=io.StringIO(), width=width, force_jupyter=False,
                      color_system="truecolor")
    console.print(renderable)
    return console.export_html(
        inline_styles=True,
        code_format='<pre style="font-family:monospace;line-height:1.2">{code}</pre>',
    )
