"""Justitia SDK: write task-parallel LLM agents; the Justitia server schedules them fairly.

```python
from justitia_sdk import agent, llm, parallel_map, AsyncClient

@agent
async def summarize(chunks: list[str]) -> str:
    parts = await parallel_map(lambda c: llm(f"Summarize: {c}", max_tokens=64), chunks)
    return await llm("Combine: " + " ".join(parts), max_tokens=128)

async with AsyncClient() as client:          # JUSTITIA_URL, JUSTITIA_API_KEY
    batch = await client.submit_many(summarize, [chunks_a, chunks_b])
```
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from justitia_sdk._agent import (
        Agent,
        agent,
        chat,
        complete,
        current_record,
        default_prompt,
        get_agent,
        llm,
        registered_agents,
    )
    from justitia_sdk._api import default_url
    from justitia_sdk._batch import Batch, BatchStats
    from justitia_sdk._client import AsyncClient
    from justitia_sdk._context import AgentRun, current_agent, current_agent_id
    from justitia_sdk._errors import (
        AgentClosedError,
        AgentNotFoundError,
        APIError,
        AuthenticationError,
        JustitiaError,
        NotJustitiaError,
        ServerGoneError,
        ServerUnavailableError,
        is_retryable,
    )
    from justitia_sdk._handle import AgentHandle
    from justitia_sdk._models import AgentRecord, Completion, Usage
    from justitia_sdk._names import AGENT_TYPE_MAX_LENGTH, AGENT_TYPE_PATTERN, check_agent_type
    from justitia_sdk._openai import openai_client, tagged_http_client
    from justitia_sdk._parallel import parallel_map, run_sync
    from justitia_sdk._profile import profile_agent, samples_of
    from justitia_sdk._sync import Client
    from justitia_sdk._tools import tool

# Where each public name lives. The package imports lazily, so that importing it (the command
# line `justitia_cli` does, for `justitia --help`) does not pay for httpx, pydantic and rich.
_EXPORTS = {
    "Agent": "_agent", "agent": "_agent", "chat": "_agent", "complete": "_agent",
    "current_record": "_agent", "default_prompt": "_agent", "llm": "_agent",
    "get_agent": "_agent", "registered_agents": "_agent",
    "profile_agent": "_profile", "samples_of": "_profile",
    "AgentHandle": "_handle", "Batch": "_batch", "BatchStats": "_batch",
    "AsyncClient": "_client", "Client": "_sync", "default_url": "_api",
    "AgentRun": "_context", "current_agent": "_context", "current_agent_id": "_context",
    "AgentClosedError": "_errors", "AgentNotFoundError": "_errors", "APIError": "_errors",
    "AuthenticationError": "_errors", "JustitiaError": "_errors", "NotJustitiaError": "_errors",
    "ServerGoneError": "_errors", "ServerUnavailableError": "_errors", "is_retryable": "_errors",
    "AgentRecord": "_models", "Completion": "_models", "Usage": "_models",
    "openai_client": "_openai", "tagged_http_client": "_openai",
    "parallel_map": "_parallel", "run_sync": "_parallel",
    "AGENT_TYPE_MAX_LENGTH": "_names", "AGENT_TYPE_PATTERN": "_names",
    "check_agent_type": "_names", "tool": "_tools",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'justitia_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"justitia_sdk.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "AGENT_TYPE_MAX_LENGTH",
    "AGENT_TYPE_PATTERN",
    "APIError",
    "Agent",
    "AgentClosedError",
    "AgentHandle",
    "AgentNotFoundError",
    "AgentRecord",
    "AgentRun",
    "AsyncClient",
    "AuthenticationError",
    "Batch",
    "BatchStats",
    "Client",
    "Completion",
    "JustitiaError",
    "NotJustitiaError",
    "ServerGoneError",
    "ServerUnavailableError",
    "Usage",
    "agent",
    "chat",
    "check_agent_type",
    "complete",
    "current_agent",
    "current_agent_id",
    "current_record",
    "default_prompt",
    "default_url",
    "get_agent",
    "is_retryable",
    "llm",
    "openai_client",
    "parallel_map",
    "profile_agent",
    "registered_agents",
    "run_sync",
    "samples_of",
    "tagged_http_client",
    "tool",
]
