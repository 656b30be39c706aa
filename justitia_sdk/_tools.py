"""`tool()`: tell the server an agent is in a tool call, so that the scheduler knows the pause.

Between two LLM calls an agent waits on a tool (a search, code execution, another agent). The
server sees such a pause anyway (the agent has nothing in flight), but not what it is: wrapped
in `tool()`, the call's start and end reach the server with the tool's name and, optionally,
how long it is expected to take. The scheduler learns each tool's calls per agent type and
judges the rest of the pause from them (or from the declared length): the agent's ETA counts
it, and the server keeps the agent's context in the engine through the pause when the pause
is short enough for that to pay (docs/retention.md).

The hint is advisory: outside an agent it does nothing, and a server that cannot be told
(unreachable, an older server without the call) never fails the tool call itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from justitia_sdk._api import current_client
from justitia_sdk._context import current_run
from justitia_sdk._errors import JustitiaError

log = logging.getLogger("justitia_sdk")


@asynccontextmanager
async def tool(name: str = "tool", *, expected_s: float | None = None) -> AsyncIterator[None]:
    """Mark a tool call of the current agent (a context manager, or a decorator of an async
    function):

    ```python
    async with tool("search", expected_s=0.5):
        hits = await search(query)

    @tool("run_code")
    async def run_code(src: str) -> str: ...
    ```

    `name`: the tool (letters, digits, `_.:-`); its calls are learned per agent type and
    tool. `expected_s`: how long the call is expected to take, when the caller knows better
    than the server's history (a timeout, a fixed wait)."""
    run, client = current_run.get(), current_client.get()
    told = False
    if run is not None and client is not None:
        try:
            await client.pause_agent(run.id, name, expected_s=expected_s)
            told = True
        except JustitiaError as exc:  # a hint: the tool call goes on without it
            log.debug("could not announce tool call %s of agent %s: %s", name, run.id, exc)
    try:
        yield
    finally:
        if told and run is not None and client is not None:
            try:
                await client.resume_agent(run.id)
            except JustitiaError as exc:
                log.debug("could not announce the end of tool call %s of agent %s: %s", name, run.id, exc)
