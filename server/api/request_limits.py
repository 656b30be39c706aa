"""What one inference request may ask of the server, checked before any work is done.

A request's cost is not only its tokens: every stop string is matched against every new
token of every sequence, every chat message is rendered and tokenized, and a JSON schema is
compiled into a grammar whose size has little to do with the schema's. Each has a limit,
and a request over one is refused with a 400 that names the limit and the server option
that sets it (docs/reliability.md has the table):

| what                                   | default | option                |
|----------------------------------------|---------|-----------------------|
| stop sequences                         | 16      | `--max-stop`          |
| characters of one stop sequence        | 256     | `--max-stop-chars`    |
| chat messages                          | 2048    | `--max-messages`      |
| bytes of a JSON schema (as JSON)       | 64 KiB  | `--max-schema-bytes`  |
| enum/const values in a schema (total)  | 1024    | (fixed)               |
| properties in a schema (total)         | 1024    | (fixed)               |
| nesting of sub-schemas                 | 12      | (fixed)               |
| counted repetition in a pattern `{n}`  | 256     | (fixed)               |
| grammar compile time                   | 2 s     | `--grammar-timeout`   |

The checks here are pure (no I/O, no clock); server/api/grammar.py compiles what passes them
under the time budget.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.engine.base import InvalidRequestError

KIB = 1024


@dataclass(frozen=True)
class RequestLimits:
    max_stop: int = 16
    max_stop_chars: int = 256
    max_messages: int = 2048
    max_schema_bytes: int = 64 * KIB
    max_schema_enum: int = 1024
    max_schema_properties: int = 1024
    max_schema_depth: int = 12
    max_pattern_repeat: int = 256
    grammar_timeout_s: float = 2.0


class RequestLimitExceeded(InvalidRequestError):
    """A request over one of the limits above (answered 400, naming it)."""


def check_stop(stop: Sequence[str], limits: RequestLimits) -> None:
    if not stop:
        return
    if len(stop) > limits.max_stop:
        raise RequestLimitExceeded(
            f"stop has {len(stop)} sequences; at most {limits.max_stop} are accepted "
            f"(the server's --max-stop)", param="stop")
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_chars:
            raise RequestLimitExceeded(
                f"stop[{i}] has {len(s)} characters; a stop sequence may have at most "
                f"{limits.max_stop_chars} (the server's --max-stop-chars)", param="stop")


def check_messages(count: int, limits: RequestLimits) -> None:
    if count > limits.max_messages:
        raise RequestLimitExceeded(
            f"messages has {count} entries; at most {limits.max_messages} are accepted "
            f"(the server's --max-messages)", param="messages")


# Keywords whose value is a map of names to sub-schemas (not a schema itself): they do not
# add a level of nesting, their values do.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
# Keywords whose values are data, not sub-schemas.
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required"})
# {n}, {n,} and {n,m} in a regular expression (the largest bound is what counts).
_COUNTED = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def schema_text_size(schema_text: str) -> int:
    return len(schema_text.encode())


def check_schema(schema_text: str, limits: RequestLimits, param: str = "response_format") -> None:
    """Refuse a JSON schema (as JSON text) over the size and structure limits."""
    size = schema_text_size(schema_text)
    if size > limits.max_schema_bytes:
        raise RequestLimitExceeded(
            f"the JSON schema has {size} bytes; at most {limits.max_schema_bytes} are "
            f"accepted (the server's --max-schema-bytes)", param=param)
    _SchemaWalk(limits, param).walk(json.loads(schema_text))


class _SchemaWalk:
    """Counts enum values and properties and follows sub-schemas, with an explicit stack:
    no recursion on what a caller sent."""

    def __init__(self, limits: RequestLimits, param: str) -> None:
        self.limits, self.param = limits, param
        self.enums = self.properties = 0

    def walk(self, schema: Any) -> None:
        stack: list[tuple[Any, int]] = [(schema, 1)]  # (value, schema depth)
        while stack:
            value, depth = stack.pop()
            if isinstance(value, list):
                stack.extend((v, depth) for v in value)
            elif isinstance(value, dict):
                self._schema(value, depth, stack)

    def _schema(self, value: dict[str, Any], depth: int, stack: list[tuple[Any, int]]) -> None:
        limits = self.limits
        if depth > limits.max_schema_depth:
            raise RequestLimitExceeded(
                f"the JSON schema nests sub-schemas deeper than {limits.max_schema_depth} "
                "levels, the most accepted", param=self.param)
        for key, item in value.items():
            if key == "enum" and isinstance(item, list):
                self.enums += len(item)
            elif key == "const":
                self.enums += 1
            elif key == "pattern" and isinstance(item, str):
                _check_pattern(item, limits, self.param)
            if key in _SCHEMA_MAPS and isinstance(item, dict):
                if key == "properties":
                    self.properties += len(item)
                stack.extend((v, depth + 1) for v in item.values())
            elif key not in _NOT_SCHEMAS:
                stack.append((item, depth + 1))
        if self.enums > limits.max_schema_enum:
            raise RequestLimitExceeded(
                f"the JSON schema has more than {limits.max_schema_enum} enum or const values, "
                "the most accepted", param=self.param)
        if self.properties > limits.max_schema_properties:
            raise RequestLimitExceeded(
                f"the JSON schema has more than {limits.max_schema_properties} properties, "
                "the most accepted", param=self.param)


def _check_pattern(pattern: str, limits: RequestLimits, param: str) -> None:
    for m in _COUNTED.finditer(pattern):
        bound = max(int(m.group(1)), int(m.group(2)) if m.group(2) else 0)
        if bound > limits.max_pattern_repeat:
            raise RequestLimitExceeded(
                f"the JSON schema's pattern {pattern[:80]!r} repeats {bound} times "
                f"({m.group(0)}); a counted repetition may be at most "
                f"{limits.max_pattern_repeat}", param=param)
