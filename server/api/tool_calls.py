"""OpenAI tool calling on `POST /v1/chat/completions`.

How a request with `tools` is served depends on `tool_choice`:

- `"none"`: the model answers in text; the tools are still shown to it (in the chat
  template), as OpenAI does.
- a named function, or `"required"`: structured output. The engine's grammar (xgrammar,
  through vLLM's structured outputs) constrains the answer to that function's arguments, or
  to a JSON list of `{"name", "parameters"}` calls of the listed functions, so the answer is
  a valid call whatever the model; the schemas are those vLLM's own server builds
  (`vllm.tool_parsers.utils.get_json_schema_from_tools`).
- `"auto"` (OpenAI's default when tools are given): the model decides, in its own format,
  which only a parser for that model family can read. `justitia serve --tool-call-parser NAME`
  names one of vLLM's parsers (hermes, llama3_json, mistral, ...); without one, `"auto"` is
  refused with a 400 that says so, rather than answering text that hides a call.

The plan is made when the request is parsed (`plan_tools`), the answer read when the output
is complete (`ToolPlan.calls`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from server.api.errors import InvalidRequestError
from server.api.openai_schemas import new_id

Mode = Literal["none", "named", "required", "auto"]


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    # A function without parameters still takes a JSON object (vLLM: _params_or_empty_object).
    return parameters if parameters else {"type": "object", "properties": {}}


def required_schema(tools: Sequence[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of one or more calls of the listed functions (vLLM's schema for
    `tool_choice: "required"`; at most one call when parallel calls are off)."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["name"]]},
                            "parameters": _arguments_schema(t.get("parameters"))},
             "required": ["name", "parameters"]}
            for t in tools]},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served: the grammar to apply and how to read the answer."""

    mode: Mode
    tools: tuple[dict[str, Any], ...] = ()  # each {"name", "description"?, "parameters"?}
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def json_schema(self) -> str | None:
        """The grammar the engine applies to the answer (None: free text)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["name"] == self.name)
            return json.dumps(_arguments_schema(tool.get("parameters")))
        if self.mode == "required":
            return json.dumps(required_schema(self.tools, self.parallel))
        return None

    def calls(self, text: str, parser: ToolCallParser | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished answer. A constrained answer that is not
        valid JSON was cut short (max_tokens): it is returned as content, with no call."""
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [call(self.name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        if self.mode == "auto" and parser is not None:
            return parser.extract(text, self)
        return text, []


def call(name: str, arguments: str) -> dict:
    """One entry of `message.tool_calls`."""
    return {"id": new_id("call"), "type": "function", "function": {"name": name, "arguments": arguments}}


def plan_tools(tools: Sequence[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser_name: str | None) -> ToolPlan:
    """The plan of a validated request (`tools` as their `function` objects). Raises
    InvalidRequestError for a choice this server cannot honour."""
    listed = tuple(tools or ())
    parallel = parallel_tool_calls is not False
    if not listed:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools: list the functions the model may call",
                                      param="tool_choice")
        return ToolPlan("none")
    names = [t["name"] for t in listed]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: two functions have the same name", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools "
                                      f"({', '.join(names)})", param="tool_choice")
        return ToolPlan("named", listed, name, parallel)
    if choice == "auto" and parser_name is None:
        raise InvalidRequestError(
            'tool_choice "auto" (the default when tools are given) needs a parser of the model\'s '
            "tool-call format: start the server with --tool-call-parser NAME (vLLM's parsers: hermes, "
            'llama3_json, mistral, ...), or send tool_choice "required" or a named function',
            param="tool_choice")
    mode: Mode = "required" if choice == "required" else "none" if choice == "none" else "auto"
    return ToolPlan(mode, listed, None, parallel)


class ToolCallParser:
    """One of vLLM's tool-call parsers (`vllm.tool_parsers`), reading a model's own tool-call
    format out of a finished answer. Loaded once at start-up: importing vLLM's parsers takes
    seconds."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        try:
            self._cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ValueError(f"unknown tool-call parser {name!r}; vLLM has: {known}") from None
        self.name = name
        self._tokenizer = tokenizer

    def extract(self, text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": ""}], "model": "m", "tool_choice": "auto",
            "tools": [{"type": "function", "function": t} for t in plan.tools]})
        # A parser keeps state while it streams: one per answer.
        info = self._cls(self._tokenizer, list(request.tools or ())).extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [call(c.function.name, c.function.arguments) for c in info.tool_calls]
        return info.content or None, calls
