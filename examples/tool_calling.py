"""Tool calling against Justitia: the official `openai` client's round trip, then an OpenAI
Agents SDK agent whose loop calls a Python tool through the server (docs/tools.md).

    python examples/tool_calling.py                       # embedded server
    python examples/tool_calling.py --url http://127.0.0.1:8000

The embedded tiny model has random weights: its calls are valid because a named or
"required" tool choice is served by the engine's grammar, whatever the model.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Literal

import openai
from _runner import server_url

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}]


def round_trip(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("JUSTITIA_API_KEY", "x"))
    model = client.models.list().data[0].id
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    city = json.loads(call.function.arguments)["city"]
    print(f"the model called {call.function.name}({call.function.arguments})")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": f"sunny in {city}"}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=32)
    print(f"its answer after reading the tool's: {answer.choices[0].message.content!r}")


def framework_agent(url: str) -> None:
    import agents
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool

    agents.set_tracing_disabled(True)  # no trace upload: nothing leaves this machine

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("JUSTITIA_API_KEY", "x"))
    model = openai.OpenAI(base_url=url + "/v1", api_key="x").models.list().data[0].id
    agent = Agent(name="forecaster", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=1000),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    print(f"the Agents SDK's agent answered: {result.final_output!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running Justitia server (default: JUSTITIA_URL, else an embedded one)")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="embedded server KV tokens")
    args = parser.parse_args()
    with server_url(args.url, args.kv_tokens) as url:
        round_trip(url)
        framework_agent(url)


if __name__ == "__main__":
    main()
