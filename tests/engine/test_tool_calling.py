"""Tool calling on the real engine, through the official `openai` client and through an
agent framework from PyPI (`openai-agents`) running its own loop against the server.

The embedded tiny model has random weights: a forced call (named or `required`) is valid
because the engine's grammar makes it so, which is what these tests rely on."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(vllm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="x", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def test_a_named_choice_returns_that_call_with_valid_arguments(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=300,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (called,) = choice.message.tool_calls
    assert called.type == "function" and called.function.name == "get_weather" and called.id
    assert json.loads(called.function.arguments)["city"] in ("Paris", "Rome")


def test_required_returns_calls_of_the_listed_functions(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=400,
                                    tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (called,) = choice.message.tool_calls  # parallel calls off: exactly one
    assert called.function.name in ("get_weather", "get_time")
    arguments = json.loads(called.function.arguments)
    assert set(arguments) == ({"city"} if called.function.name == "get_weather" else {"zone"})


def test_a_streamed_named_call_adds_up_to_the_arguments(oai: openai.OpenAI, model: str) -> None:
    stream = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=300, stream=True,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    name, arguments, finish, ids = None, "", None, set()
    for chunk in stream:
        for c in chunk.choices:
            for call in c.delta.tool_calls or ():
                ids |= {call.id} if call.id else set()
                name = name or call.function.name
                arguments += call.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and name == "get_weather" and len(ids) == 1
    assert json.loads(arguments)["city"] in ("Paris", "Rome")


def test_a_tool_answer_sent_back_gets_an_answer(oai: openai.OpenAI, model: str) -> None:
    first = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=300,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = oai.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its answer were read


def test_an_agent_framework_runs_its_tool_loop_against_the_server(vllm_server, model: str) -> None:
    import agents  # openai-agents, installed with the openai extra
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=vllm_server.url + "/v1", api_key="x", max_retries=0, timeout=180)
    agent = Agent(name="forecaster", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=1000),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome"), result.final_output
    assert result.final_output == f"sunny in {calls[0]}"
