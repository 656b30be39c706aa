"""Profiling: run an agent over its inputs and turn each run into a predictor training sample.

A sample is what `justitia train-predictor` reads (predictors/samples.py): the agent type,
the prompt the server saw at submission, and the run's KV token-time cost, the sum over its
requests of p*d + d*(d+1)/2 (docs/concepts.md, "Cost model"), from the token counts the server reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from justitia_sdk._agent import Agent
from justitia_sdk._batch import Batch
from justitia_sdk._sync import Client


def samples_of(batch: Batch) -> list[dict[str, Any]]:
    """One sample per run of the batch that finished without error and used the engine."""
    out = []
    for h in batch:
        if h.ok and h.run is not None and h.run.kv_cost > 0:
            out.append({
                "agent_type": h.agent.name,
                "prompt": h.run.prompt or h.agent.name,
                "cost": h.run.kv_cost,
                "features": {"requests": h.run.requests,
                             "prompt_tokens": h.run.prompt_tokens,
                             "output_tokens": h.run.completion_tokens},
            })
    return out


def profile_agent(
    agent: Agent[..., Any] | Sequence[Agent[..., Any]],
    inputs: Iterable[Any],
    *,
    server: str | None = None,
    api_key: str | None = None,
    concurrency: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run `agent` once per input on a server and return the training samples.

    Inputs follow `submit_many` (a dict is keyword arguments). Failed runs are left out.
    `concurrency` limits the runs in flight (default 64, as `submit_many`); profiling one run at a
    time (`concurrency=1`) gives each run the whole engine, as in the paper's profiling.
    """
    with Client(server, api_key=api_key) as client:
        batch = client.submit_many(agent, list(inputs), concurrency=concurrency,
                                   progress=progress, title="profiling")
    return samples_of(batch)
