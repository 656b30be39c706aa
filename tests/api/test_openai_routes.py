"""The OpenAI routes, a contract suite: completions, chat, streaming and bad input, on the
fake engine and on vLLM (the `server` fixture's two parameters). What the fake's exact
tokenizer lets a test check to the token is in test_api.py."""

from __future__ import annotations

import json

import httpx

from tests.support.servers import ENGINE_MAX_MODEL_LEN


def test_health_ready_and_models(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready"
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [ready["model"]]
    assert data[0]["max_model_len"] == ENGINE_MAX_MODEL_LEN


def test_completion_returns_exactly_max_tokens_with_ignore_eos(client: httpx.Client) -> None:
    for n in (1, 7, 40):
        r = client.post("/v1/completions",
                        json={"prompt": "Summarize: the river flows", "max_tokens": n,
                              "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        usage = body["usage"]
        assert usage["completion_tokens"] == n
        assert usage["total_tokens"] == usage["prompt_tokens"] + n
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["model"] == client.get("/readyz").json()["model"]


def test_prompt_tokens_come_from_the_engines_tokenizer(client: httpx.Client) -> None:
    short = client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 1}).json()
    long = client.post("/v1/completions", json={"prompt": "a b " * 50, "max_tokens": 1}).json()
    assert long["usage"]["prompt_tokens"] > 10 * short["usage"]["prompt_tokens"] / 2
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2}).json()
    assert ids["usage"]["prompt_tokens"] == 4


def test_chat_completion(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
                          "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 5


def test_streaming_completion_ends_with_done_and_usage(client: httpx.Client) -> None:
    chunks = []
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "stream me", "max_tokens": 6, "ignore_eos": True,
                             "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: "):])
    assert chunks[-1] == "[DONE]"
    last = json.loads(chunks[-2])
    assert last["usage"]["completion_tokens"] == 6
    reasons = [c["finish_reason"] for chunk in chunks[:-1] for c in json.loads(chunk)["choices"]]
    assert reasons[-1] == "length" and not any(reasons[:-1])


def _assert_4xx(r: httpx.Response, status: int, *needles: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert isinstance(detail, str) and detail
    for needle in needles:
        assert needle in detail, detail


def test_bad_inference_input_is_400_with_a_message(client: httpx.Client) -> None:
    post = client.post
    _assert_4xx(post("/v1/completions", json={"prompt": "x", "max_tokens": -3}), 400, "max_tokens")
    _assert_4xx(post("/v1/completions", json={"max_tokens": 3}), 400, "prompt")
    _assert_4xx(post("/v1/completions", json={"prompt": "", "max_tokens": 3}), 400, "prompt")
    _assert_4xx(post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400, "temperature")
    _assert_4xx(post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_tokens": 5}),
                400, "min_tokens")
    _assert_4xx(post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    _assert_4xx(post("/v1/completions", json={"prompt": [5, 10**6], "max_tokens": 2}), 400,
                str(10**6), "vocabulary")
    _assert_4xx(post("/v1/completions", content=b'{"prompt": "unterminated',
                     headers={"content-type": "application/json"}), 400, "JSON")


def test_requests_over_the_context_are_400(client: httpx.Client) -> None:
    long = client.post("/v1/completions",
                       json={"prompt": "word " * (ENGINE_MAX_MODEL_LEN * 2), "max_tokens": 4})
    _assert_4xx(long, 400, "maximum context length", str(ENGINE_MAX_MODEL_LEN))
    over = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": ENGINE_MAX_MODEL_LEN})
    _assert_4xx(over, 400, "max_tokens")


def test_unknown_model_is_404_and_a_wrong_method_is_405(client: httpx.Client) -> None:
    _assert_4xx(client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404, "gpt-9")
    r = client.put("/v1/agents")
    _assert_4xx(r, 405, "GET", "POST")
    assert {m.strip() for m in r.headers["allow"].split(",")} >= {"GET", "POST"}
    _assert_4xx(client.get("/v1/no-such-route"), 404)


def test_oversized_body_is_413(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b"{" + b" " * (5 * 1024 * 1024) + b"}",
                    headers={"content-type": "application/json"})
    _assert_4xx(r, 413, "limit")
