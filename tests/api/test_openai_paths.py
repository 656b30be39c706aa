"""The OpenAI routes' two ways of serving a request (the parsed-JSON fast path and FastAPI's
own) refuse bad input with the same answers; the app runs in process, no engine needed."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute, request_response
from fastapi.testclient import TestClient


def _routes_without_fast_paths(app) -> None:
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.path in ("/v1/completions", "/v1/chat/completions"):
            route.app = request_response(route.get_route_handler())


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "best_of": 3}),
    ("/v1/completions", {"prompt": "x", "logprobs": 10**6}),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 3, "max_completion_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "grammar"}}),
])
def test_fast_path_and_fastapi_path_give_the_same_errors(path: str, body: dict) -> None:
    # The refusals are the models' own checks, so both ways of serving a route give them
    # alike. (Type errors may be worded apart: the fast path validates JSON directly, where
    # pydantic says "array" for what FastAPI's Python-mode validation calls a "list".)
    from server.api.app import create_app
    from server.api.config import ServerConfig

    fast = create_app(ServerConfig())
    plain = create_app(ServerConfig())
    _routes_without_fast_paths(plain)
    answers = [TestClient(app).post(path, json=body) for app in (fast, plain)]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].json() == answers[1].json()
