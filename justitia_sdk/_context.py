"""The ambient state of an agent run, carried by contextvars.

A contextvar set when an agent starts is visible in every coroutine it awaits, and in every
task it spawns (asyncio and anyio copy the context into new tasks), so `llm()` called from a
nested helper or from inside `parallel_map` tags its request with the right agent without
the id being passed around. Each agent run sets its own value in its own task, so concurrent
agents never see each other's.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import anyio

from justitia_sdk._models import AgentRecord, Usage


@dataclass
class AgentRun:
    """One running agent: its server-side id and what its requests have used so far."""

    id: str
    type: str
    prompt: str
    record: AgentRecord
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    kv_cost: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None
    reregistrations: int = 0  # times the server forgot the agent (a restart) and it re-registered
    former_ids: set[str] = field(default_factory=set)  # the ids the server forgot
    #: Called with the run each time it registers again under a new id (a batch's handle
    #: follows its agent to the new id).
    on_reregister: Callable[[AgentRun], None] | None = field(default=None, repr=False)
    _reregister_lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False)

    def add_usage(self, usage: Usage) -> None:
        self.requests += 1
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.kv_cost += usage.kv_cost


current_run: ContextVar[AgentRun | None] = ContextVar("justitia_agent_run", default=None)


def current_agent() -> AgentRun | None:
    """The agent run this code executes in, or None outside any agent."""
    return current_run.get()


def current_agent_id() -> str | None:
    """The id of the agent this code executes in (what its requests are tagged with)."""
    run = current_run.get()
    return run.id if run is not None else None
