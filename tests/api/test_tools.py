"""Tool calling on /v1/chat/completions without the engine (fast tier): what is accepted and
refused, how a tool conversation is shown to the model, the grammars a forced call gets and
how answers are read (vLLM's own hermes parser for "auto"). The engine tier
(test_tool_calling.py) runs the round trips on vLLM with the official client."""

from __future__ import annotations

import json

import httpx
import pytest

from server.api.errors import InvalidRequestError
from server.api.tool_calls import ToolCallParser, plan_tools, required_schema
from server.engine.tiny_model import _build_tokenizer
from tests.support.fake_engine import FakeServer

WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
CLOCK = {"name": "get_time"}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
CALL_HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def chat(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"max_tokens": 4, **body})


def test_a_tool_conversation_is_accepted_and_shown_to_the_model(fake_client: httpx.Client,
                                                                fake_server) -> None:
    r = chat(fake_client, messages=CALL_HISTORY, tools=TOOLS, tool_choice="none")
    assert r.status_code == 200, r.text
    # the prompt the engine saw holds the tools, the call and its answer
    prompt = fake_server.engine.last_prompt_text()
    assert "get_weather" in prompt and "Paris" in prompt and "sunny, 21 C" in prompt
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert "tool_calls" not in message


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),  # "auto" by default, no parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [{"type": "function", "function": WEATHER}] * 2, "tool_choice": "required"}, "tools", "same name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", ""),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "tools", ""),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format", "drop response_format"),
    ({"functions": [WEATHER]}, "functions", "send tools"),
])
def test_tool_options_it_cannot_honour_get_a_400_naming_them(fake_client: httpx.Client, body, param,
                                                             words) -> None:
    r = chat(fake_client, messages=[{"role": "user", "content": "hi"}], **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].split(".")[0] == param
    assert words in error["message"]


@pytest.mark.parametrize("message, words", [
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "user", "content": None}, "needs content"),
    ({"role": "user", "content": "x", "tool_calls": CALL_HISTORY[1]["tool_calls"]}, "only an assistant"),
])
def test_malformed_tool_messages_are_refused_with_the_reason(fake_client: httpx.Client, message, words) -> None:
    r = chat(fake_client, messages=[message])
    assert r.status_code == 400 and words in r.text


def test_content_given_as_text_parts_is_joined(fake_client: httpx.Client, fake_server) -> None:
    r = chat(fake_client, messages=[{"role": "user", "content": [{"type": "text", "text": "alpha "},
                                                                 {"type": "text", "text": "beta"}]}])
    assert r.status_code == 200, r.text
    assert "alpha \nbeta" in fake_server.engine.last_prompt_text()  # joined as vLLM joins them


def test_a_named_choice_constrains_the_answer_to_that_functions_arguments() -> None:
    plan = plan_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert json.loads(plan.json_schema() or "") == WEATHER["parameters"]
    content, calls = plan.calls('{"city": "Rome"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert calls[0]["id"].startswith("call-") and calls[0]["type"] == "function"
    # cut short by max_tokens: no call, the text as content
    assert plan.calls('{"city": "Ro') == ('{"city": "Ro', [])
    # a function without parameters still takes an object
    clock = plan_tools([CLOCK], {"type": "function", "function": {"name": "get_time"}}, None, None)
    assert json.loads(clock.json_schema() or "") == {"type": "object", "properties": {}}


def test_required_is_a_list_of_calls_of_the_listed_functions() -> None:
    plan = plan_tools([WEATHER, CLOCK], "required", None, None)
    schema = json.loads(plan.json_schema() or "")
    assert schema == required_schema([WEATHER, CLOCK], parallel=True)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert json.loads(plan_tools([WEATHER], "required", False, None).json_schema() or "")["maxItems"] == 1
    _, calls = plan.calls('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                          '{"name": "get_time", "parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.slow
def test_vllms_hermes_parser_reads_a_call_out_of_an_auto_answer() -> None:
    from transformers import PreTrainedTokenizerFast  # seconds to import: only this test needs it

    parser = ToolCallParser("hermes", PreTrainedTokenizerFast(tokenizer_object=_build_tokenizer()))
    plan = plan_tools([WEATHER], "auto", None, parser.name)
    text = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    content, calls = plan.calls(text, parser)
    assert content == "Let me look."
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert plan.calls("just words", parser) == ("just words", [])
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallParser("no-such-parser", None)


@pytest.mark.slow
def test_auto_is_served_when_the_server_has_a_parser(tmp_path) -> None:
    with FakeServer(tmp_path, tool_call_parser="hermes") as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


def test_plan_refuses_a_choice_without_tools() -> None:
    with pytest.raises(InvalidRequestError):
        plan_tools(None, "required", None, None)
    assert plan_tools(None, None, None, None).mode == "none"


def test_a_tools_schema_is_held_to_the_schema_limits(fake_client: httpx.Client) -> None:
    """Function parameters are a caller's schema: a forced call compiles them, so the same
    limits as a response format's apply (a counted pattern would stall the grammar compiler)."""
    hostile = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(ab|cd){5000}$"}}}
    r = chat(fake_client, messages=[{"role": "user", "content": "hi"}], tool_choice="required",
             tools=[{"type": "function", "function": {"name": "f", "parameters": hostile}}])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
