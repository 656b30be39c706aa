"""A server's scheduler and the caller's agents as a table: what `justitia status` shows.

Pure HTTP (the client's `scheduler()` and `list_agents()`), so it belongs to the SDK; the
command line (`justitia_cli.status`) parses the arguments and turns a `JustitiaError` into
its one-line error.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from justitia_sdk._client import AsyncClient
from justitia_sdk._models import AgentRecord
from justitia_sdk._render import STATE_STYLE


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def status_view(snapshot: dict[str, Any], agents: list[AgentRecord], url: str,
                show_all: bool) -> Group:
    """The scheduler's state on one line, then a table of the agents (unfinished only unless
    `show_all`)."""
    now = time.time()
    shown = [a for a in agents if show_all or not a.terminal]
    engine = snapshot.get("engine") or {}
    head = Text.assemble(
        (f"{url}", "bold"), "  policy ", (str(snapshot.get("policy", "?")), "cyan"),
        f"  M={snapshot.get('M', '?')} tokens  tau={_num(snapshot.get('tau'), '{:.4f}')} s"
        f"  backlog={snapshot.get('backlog', '?')}  pending={snapshot.get('pending_requests', '?')}"
        f"  running={snapshot.get('running_requests', '?')}"
        f"  KV use={_num(engine.get('kv_usage'), '{:.0%}')}",
    )
    table = Table(box=box.SIMPLE_HEAD, caption=f"{len(shown)} of {len(agents)} agents shown "
                  "(seconds since submission; deadline = fair + bound)" + ("" if show_all else "; --all for all"),
                  caption_justify="left")
    for col, justify in (("id", "left"), ("type", "left"), ("state", "left"), ("reqs", "right"),
                         ("age", "right"), ("ETA", "right"), ("fair", "right"),
                         ("bound", "right"), ("JCT", "right")):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for a in shown:
        age = (a.finished_at or now) - a.submitted_at if a.submitted_at else None
        table.add_row(a.id, a.type, Text(a.state, STATE_STYLE.get(a.state, "")),
                      f"{a.requests_done}/{a.requests_total}", _num(age), _num(a.eta_s),
                      _num(a.fair_finish_s), _num(a.delay_bound_s), _num(a.jct_s))
    return Group(head, table)


async def fetch_status(url: str | None, api_key: str | None, show_all: bool) -> Group:
    """`status_view` of the server at `url` (None: JUSTITIA_URL or the local default).

    Raises `JustitiaError` (e.g. `ServerUnavailableError`) when the server cannot answer.
    """
    async with AsyncClient(url, api_key=api_key, max_retries=1) as client:
        snapshot = await client.scheduler()
        agents = await client.list_agents()
        return status_view(snapshot, agents, client.base_url, show_all)


def show_status(url: str | None, api_key: str | None, show_all: bool, watch: bool) -> None:
    """Print the status once, or with `watch` refresh it every second until Ctrl-C
    (KeyboardInterrupt propagates)."""
    console = Console()
    if not console.is_terminal:
        # Piped or captured: do not squeeze the table into 80 columns.
        console = Console(width=140)
    view = anyio.run(fetch_status, url, api_key, show_all)
    if not watch:
        console.print(view)
        return
    with Live(view, console=console, auto_refresh=False) as live:
        while True:
            time.sleep(1.0)
            live.update(anyio.run(fetch_status, url, api_key, show_all), refresh=True)
