"""OpenAI compatibility, checked with the official `openai` client against the real engine:
errors carry the server's message, and every sampling field is honoured or refused (a 400
naming it), never silently ignored."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from server.scheduler import kv_cost
from tests.support.servers import ENGINE_KV_TOKENS, ENGINE_MAX_MODEL_LEN
from tests.support.streams import sse_json
from tests.support.waiting import all_agents


@pytest.fixture(scope="module")
def oai(vllm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


# -- errors -------------------------------------------------------------------------------
def test_client_error_message_is_the_servers(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=model, prompt="hello", max_tokens=0)
    err = caught.value
    assert "max_tokens" in str(err) and "greater than or equal to 1" in str(err)
    assert err.param == "max_tokens" and err.type == "invalid_request_error"


def test_context_overflow_message_reaches_the_client(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=model, prompt=[5] * 100, max_tokens=ENGINE_MAX_MODEL_LEN)
    assert "maximum context length" in str(caught.value)
    assert caught.value.param == "max_tokens"


def test_unknown_model_is_not_found_with_openais_code(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        oai.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert "gpt-nope" in str(caught.value)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


def test_openai_routes_carry_both_shapes_and_the_agent_api_keeps_detail(
        vllm_client: httpx.Client) -> None:
    r = vllm_client.post("/v1/completions", json={"prompt": "x", "n": 0})
    body = r.json()
    assert r.status_code == 400
    assert body["error"]["message"] == body["detail"]  # the SDK reads detail
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "n"
    r = vllm_client.get("/v1/completions")  # 405 on an OpenAI route
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = vllm_client.post("/v1/agents", json={"prompt": "no type"})
    assert r.status_code == 400 and set(r.json()) == {"detail"}
    r = vllm_client.get("/v1/agents/nope")
    assert r.status_code == 404 and set(r.json()) == {"detail"}


# -- max_tokens ---------------------------------------------------------------------------
def test_max_completion_tokens_is_honoured(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                    max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_max_completion_tokens_and_max_tokens_must_agree(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=3, max_completion_tokens=5)
    assert caught.value.param == "max_completion_tokens" and "differ" in str(caught.value)
    same = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, max_completion_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert same.usage.completion_tokens == 4


def test_chat_without_max_tokens_fills_the_context(oai: openai.OpenAI, model: str) -> None:
    # A long conversation leaves a short rest of the context: the answer fills it (not 16).
    words = " ".join(["token"] * 2000)
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": words}],
                                    extra_body={"ignore_eos": True})
    p = r.usage.prompt_tokens
    assert ENGINE_MAX_MODEL_LEN - p > 16, "the prompt must leave more than 16 tokens"
    assert r.usage.completion_tokens == ENGINE_MAX_MODEL_LEN - p
    assert r.choices[0].finish_reason == "length"


# -- n --------------------------------------------------------------------------------------
def test_n_sequences_are_returned_and_all_are_charged(oai: openai.OpenAI, model: str,
                                                      vllm_client: httpx.Client) -> None:
    agent = vllm_client.post("/v1/agents", json={"type": "n_test", "prompt": "x"}).json()
    r = oai.completions.create(model=model, prompt=[9] * 30, max_tokens=7, n=3,
                               extra_body={"ignore_eos": True},
                               extra_headers={"X-Justitia-Agent": agent["id"]})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 21 and r.usage.prompt_tokens == 30
    rec = vllm_client.get(f"/v1/agents/{agent['id']}").json()
    assert rec["consumed_cost"] == pytest.approx(3 * kv_cost(30, 7))
    vllm_client.post(f"/v1/agents/{agent['id']}/finish")


def test_n_streams_every_sequence_to_its_end(oai: openai.OpenAI, model: str) -> None:
    ended: dict[int, str] = {}
    text: dict[int, str] = {}
    usage = None
    for chunk in oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2,
            stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                ended[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert ended == {0: "length", 1: "length"} and set(text) == {0, 1}
    assert usage is not None and usage.completion_tokens == 12


def test_n_over_the_cap_or_the_kv_cache_is_refused(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=model, prompt="x", max_tokens=2, n=17)
    assert caught.value.param == "n"
    with pytest.raises(openai.BadRequestError) as caught:  # 16 x 1000 tokens > the KV cache
        oai.completions.create(model=model, prompt=[3] * 500, max_tokens=500, n=16)
    assert caught.value.param == "n" and str(ENGINE_KV_TOKENS) in str(caught.value)


def test_best_of_must_equal_n(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=model, prompt="x", max_tokens=2, best_of=1000)
    assert caught.value.param == "best_of" and "best_of" in str(caught.value)
    r = oai.completions.create(model=model, prompt="x", max_tokens=2, n=2, best_of=2)
    assert len(r.choices) == 2


# -- logprobs -------------------------------------------------------------------------------
SPECIAL_TOKENS = {"<s>", "</s>", "<pad>"}  # the embedded tiny model's (server/engine/tiny_model.py)


def _visible(text: str) -> str:
    # A token holding part of a character's bytes is decoded alone as U+FFFD or as nothing
    # (vLLM), while the text decodes the whole character: compare the rest.
    return text.replace("\ufffd", "")


def test_completion_logprobs(oai: openai.OpenAI, model: str) -> None:
    r = oai.completions.create(model=model, prompt="the cat", max_tokens=6, logprobs=2,
                               temperature=0.0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert _visible("".join(lp.tokens)) == _visible(r.choices[0].text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and sampled <= 0.0  # keyed by text: two may share one
        # greedy: the sampled token is the most likely one
        assert sampled == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs_and_top_logprobs(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=5, logprobs=True, top_logprobs=3,
                                    extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    # A sampled special token (the tiny model's random weights can pick <s>) is listed among
    # the logprobs but left out of the text (skip_special_tokens), as in vLLM's own server.
    listed = "".join(t.token for t in content if t.token not in SPECIAL_TOKENS)
    assert _visible(listed) == _visible(r.choices[0].message.content)
    for t in content:
        values = [a.logprob for a in t.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert t.logprob <= 0.0 and bytes(t.bytes).decode() == t.token
    plain = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_cover_every_token(vllm_client: httpx.Client) -> None:
    with vllm_client.stream("POST", "/v1/completions",
                       json={"prompt": "abc", "max_tokens": 5, "logprobs": 1,
                             "ignore_eos": True, "stream": True}) as r:
        tokens = [t for e in sse_json(r) for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert len(tokens) == 5


@pytest.mark.parametrize("kwargs, param", [
    ({"logprobs": 10**6}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
])
def test_logprobs_over_the_engines_limit_are_refused(oai: openai.OpenAI, model: str,
                                                     kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=model, prompt="x", max_tokens=2, **kwargs)
    assert caught.value.param == param and param in str(caught.value)


def test_top_logprobs_needs_logprobs(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2, top_logprobs=2)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2, logprobs=True, top_logprobs=21)
    assert caught.value.param == "top_logprobs"


# -- structured output ------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def test_json_schema_output_is_valid_json_of_that_schema(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "give a"}], max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"a"} and isinstance(value["a"], int)


def test_json_object_output_starts_an_object(oai: openai.OpenAI, model: str) -> None:
    r = oai.completions.create(model=model, prompt="json:", max_tokens=8,
                               extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.lstrip().startswith("{")


def test_unknown_response_format_is_refused(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2, response_format={"type": "grammar"})
    assert caught.value.param == "response_format" and "json_schema" in str(caught.value)


# -- penalties, and what is refused ----------------------------------------------------
def test_penalties_are_accepted_within_openais_range(oai: openai.OpenAI, model: str) -> None:
    r = oai.completions.create(model=model, prompt="x", max_tokens=3, presence_penalty=1.5,
                               frequency_penalty=-1.0)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=model, prompt="x", max_tokens=3, presence_penalty=3)
    assert caught.value.param == "presence_penalty"


CHAT_REFUSED = [
    ("tool_choice", {"tool_choice": "auto"}),  # a choice with no tools to choose from
    ("functions", {"extra_body": {"functions": [{"name": "f"}]}}),
    ("logit_bias", {"logit_bias": {"5": 10}}),
    ("audio", {"extra_body": {"audio": {"voice": "alloy", "format": "wav"}}}),
    ("reasoning_effort", {"reasoning_effort": "high"}),
    ("priority", {"extra_body": {"priority": -5}}),
    ("stream_options", {"stream_options": {"include_usage": True}}),
    ("repetition_penalty", {"extra_body": {"repetition_penalty": 1.3}}),
]


@pytest.mark.parametrize("field, kwargs", CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_unsupported_chat_fields_are_refused_by_name(oai: openai.OpenAI, model: str,
                                                     field: str, kwargs: dict) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2, **kwargs)
    assert caught.value.param == field and field in str(caught.value)


@pytest.mark.parametrize("field, kwargs", [("echo", {"echo": True}), ("suffix", {"suffix": "end"}),
                                           ("logit_bias", {"logit_bias": {"3": -100}})])
def test_unsupported_completion_fields_are_refused_by_name(oai: openai.OpenAI, model: str,
                                                           field: str, kwargs: dict) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=model, prompt="x", max_tokens=2, **kwargs)
    assert caught.value.param == field and field in str(caught.value)


def test_off_values_and_harmless_fields_are_accepted(vllm_client: httpx.Client) -> None:
    r = vllm_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [],
        "tool_choice": "none", "logit_bias": {}, "user": "u1", "store": False,
        "metadata": {"k": "v"}, "response_format": {"type": "text"}, "logprobs": False,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    r = vllm_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "echo": False,
                                             "suffix": None, "best_of": 1, "n": 1})
    assert r.status_code == 200, r.text
    assert math.isfinite(r.json()["usage"]["total_tokens"])


def test_a_schema_the_grammar_compiler_refuses_is_a_400(oai: openai.OpenAI, model: str) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}})
    assert "no-such-type" in str(caught.value)  # vLLM's grammar compiler's own words
    # and the engine still serves
    assert oai.completions.create(model=model, prompt="x", max_tokens=2).usage.completion_tokens


def test_a_schema_the_compiler_refuses_is_a_400_before_the_stream_starts(vllm_client: httpx.Client) -> None:
    """The grammar is compiled before the engine sees it (server/api/grammar.py): a schema it
    refuses is OpenAI's 400 naming it, not an error event after the headers went out."""
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    with vllm_client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"schema": bad}}}) as r:
        r.read()
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert set(error) == {"message", "type", "param", "code"}


# -- sessions -----------------------------------------------------------------------------
def test_completions_with_only_a_session_header_are_one_agent(oai: openai.OpenAI, model: str, vllm_server) -> None:
    # What a coding agent's client does: no agent tag, only its session id in a header.
    session = f"sess-{id(oai)}-{math.floor(1e6 * math.pi)}"
    for k in range(3):
        out = oai.completions.create(model=model, prompt=f"step {k}: fix the test", max_tokens=4,
                                     extra_headers={"session-id": session})
        assert out.usage is not None and out.usage.completion_tokens >= 1
    with httpx.Client(base_url=vllm_server.url, timeout=30) as c:
        mine = [a for a in all_agents(c) if a.get("session") == session]
    assert len(mine) == 1, mine
    (agent,) = mine
    assert agent["requests_done"] == 3 and agent["session"] == session and agent["type"] == "session"
    assert agent["state"] == "paused"  # between its requests, until --session-idle-s (60 s) of idleness
    assert agent["delay_bound_s"] > 0 and agent["predicted_cost"] > 0


def test_generated_token_ids_resent_hit_the_prefix_cache(vllm_client: httpx.Client) -> None:
    """return_token_ids gives the ids the engine generated; a conversation resent with them
    is served from vLLM's prefix cache (usage.prompt_tokens_details.cached_tokens)."""
    prompt = [11 + (7 * k) % 600 for k in range(200)]
    first = vllm_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                                                       "return_token_ids": True}).json()
    ids = first["choices"][0]["token_ids"]
    assert len(ids) == 40 and all(isinstance(t, int) for t in ids)
    again = vllm_client.post("/v1/completions", json={"prompt": prompt + ids + [5, 6, 7], "max_tokens": 1}).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    block = vllm_client.get("/v1/scheduler").json()["block_size"]
    assert cached >= (len(prompt) + len(ids) - 1) // block * block - block
    assert "token_ids" not in again["choices"][0]
