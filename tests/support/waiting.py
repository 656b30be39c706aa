"""Polling helper shared by the tests that wait on a live server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], limit_s: float = 60.0, every_s: float = 0.05,
               show: Callable[[], Any] | None = None) -> T:
    """The first truthy value of `predicate()`, polled every `every_s`; an AssertionError
    (with `show()`'s state, if given) when `limit_s` passes first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"condition not reached; state: {show() if show else None}")


def all_agents(client: Any, **params: Any) -> list[dict]:
    """Every agent `GET /v1/agents` lists for this client (all pages)."""
    out: list[dict] = []
    cursor = None
    while True:
        query = {**params, "limit": 1000, **({"cursor": cursor} if cursor else {})}
        body = client.get("/v1/agents", params=query).json()
        out.extend(body["agents"])
        cursor = body.get("next_cursor")
        if not cursor:
            return out
