"""Run code written for OpenAI-compatible APIs under Justitia's scheduling.

`openai_client()` returns an `openai.AsyncOpenAI` (or `OpenAI`) pointed at the Justitia
server whose every request carries the agent tag: the id of the agent the calling code runs
in (read from the contextvar when the request is sent, so one client serves many agents), or
a fixed `agent_id`. The `openai` package is optional; `tagged_http_client()` gives the same
tagging on a plain httpx client.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from justitia_sdk._api import AGENT_HEADER, default_url
from justitia_sdk._context import current_agent_id


def _hooks(agent_id: str | None) -> tuple[Any, Any]:
    def tag(request: httpx.Request) -> None:
        aid = agent_id or current_agent_id()
        if aid and AGENT_HEADER not in request.headers:
            request.headers[AGENT_HEADER] = aid

    async def atag(request: httpx.Request) -> None:
        tag(request)

    return tag, atag


def tagged_http_client(
    *, agent_id: str | None = None, sync: bool = False, **kwargs: Any
) -> httpx.AsyncClient | httpx.Client:
    """An httpx client that adds `X-Justitia-Agent` to each request made inside an agent."""
    tag, atag = _hooks(agent_id)
    kwargs.setdefault("timeout", httpx.Timeout(30.0, read=900.0))
    if sync:
        return httpx.Client(event_hooks={"request": [tag]}, **kwargs)
    return httpx.AsyncClient(event_hooks={"request": [atag]}, **kwargs)


def openai_client(
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    agent_id: str | None = None,
    sync: bool = False,
    **kwargs: Any,
) -> Any:
    """An `openai.AsyncOpenAI` (`sync=True`: `openai.OpenAI`) for the Justitia server.

    ```python
    oa = openai_client()

    @agent
    async def answer(q: str) -> str:
        r = await oa.completions.create(model="tiny", prompt=q, max_tokens=32)
        return r.choices[0].text
    ```
    Requests made inside an agent carry its id; `model` may be any name the server serves
    (see `GET /v1/models`). Extra keywords go to the OpenAI constructor.
    """
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "openai_client() needs the `openai` package: pip install openai"
        ) from exc
    url = (base_url or default_url()).rstrip("/")
    key = api_key or os.environ.get("JUSTITIA_API_KEY") or "justitia-no-key"
    http = tagged_http_client(agent_id=agent_id, sync=sync)
    cls = openai.OpenAI if sync else openai.AsyncOpenAI
    # openai's annotations name httpx2's client classes (its vendored fork of httpx); at run time
    # it drives any httpx-compatible client, which tests/engine/test_openai_compat.py checks with this one.
    return cls(base_url=url + "/v1", api_key=key, http_client=http, **kwargs)  # type: ignore[arg-type]
