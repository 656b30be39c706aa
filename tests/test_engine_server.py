"""The bundled server on the real vLLM CPU engine: completions and bad input."""

from __future__ import annotations

import json

import httpx

from tests.conftest import ENGINE_MAX_MODEL_LEN


def test_health_and_ready(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready"


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["justitia-tiny-llama"]
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


def test_generated_token_ids_resent_hit_the_prefix_cache(client: httpx.Client) -> None:
    """return_token_ids gives the ids the engine generated; a conversation resent with them
    is served from vLLM's prefix cache (usage.prompt_tokens_details.cached_tokens)."""
    prompt = [11 + (7 * k) % 600 for k in range(200)]
    first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                                                  "return_token_ids": True}).json()
    ids = first["choices"][0]["token_ids"]
    assert len(ids) == 40 and all(isinstance(t, int) for t in ids)
    again = client.post("/v1/completions", json={"prompt": prompt + ids + [5, 6, 7], "max_tokens": 1}).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    block = client.get("/v1/scheduler").json()["block_size"]
    assert cached >= (len(prompt) + len(ids) - 1) // block * block - block
    assert "token_ids" not in again["choices"][0]


def test_prompt_tokens_match_the_models_tokenizer(client: httpx.Client) -> None:
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
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
    assert isinstance(text, str)


def _assert_4xx(r: httpx.Response, *needles: str) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert isinstance(detail, str) and detail
    for needle in needles:
        assert needle in detail, detail


def test_negative_max_tokens_is_rejected(client: httpx.Client) -> None:
    _assert_4xx(client.post("/v1/completions", json={"prompt": "x", "max_tokens": -3}),
                "max_tokens")


def test_prompt_longer_than_context_is_rejected(client: httpx.Client) -> None:
    r = client.post("/v1/completions",
                    json={"prompt": "word " * (ENGINE_MAX_MODEL_LEN * 2), "max_tokens": 4})
    _assert_4xx(r, "maximum context length", str(ENGINE_MAX_MODEL_LEN))


def test_prompt_plus_output_over_context_is_rejected(client: httpx.Client) -> None:
    r = client.post("/v1/completions",
                    json={"prompt": "hi", "max_tokens": ENGINE_MAX_MODEL_LEN})
    _assert_4xx(r, "max_tokens")


def test_malformed_json_is_rejected(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "unterminated',
                    headers={"content-type": "application/json"})
    _assert_4xx(r, "JSON")


def test_missing_prompt_and_bad_sampling_are_rejected(client: httpx.Client) -> None:
    _assert_4xx(client.post("/v1/completions", json={"max_tokens": 3}), "prompt")
    _assert_4xx(client.post("/v1/completions", json={"prompt": "", "max_tokens": 3}), "prompt")
    _assert_4xx(client.post("/v1/completions", json={"prompt": "x", "temperature": -1}),
                "temperature")
    _assert_4xx(client.post("/v1/completions",
                            json={"prompt": "x", "max_tokens": 2, "min_tokens": 5}),
                "min_tokens")
    _assert_4xx(client.post("/v1/chat/completions", json={"messages": []}), "messages")


def test_unknown_model_is_404(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404
    assert "gpt-9" in r.json()["detail"]


def test_oversized_body_is_413(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b"{" + b" " * (5 * 1024 * 1024) + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert "limit" in r.json()["detail"]
