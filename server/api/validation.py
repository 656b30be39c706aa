"""Checks every request body gets before its own fields are validated.

Python's JSON parser accepts two things that are not valid text or JSON, and both would
turn into 500s further on (docs/reliability.md):

- lone UTF-16 surrogates (`"\\ud800"`): the tokenizer refuses them, and a record that holds
  one (agent metadata) cannot be encoded as UTF-8 in the response, so one such agent would
  break its tenant's `GET /v1/agents`;
- `NaN` and `Infinity`, which JSON does not have, and which no field here means.

It also refuses nesting deeper than `MAX_JSON_DEPTH`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, model_validator

_SURROGATE = re.compile("[\ud800-\udfff]")
#: Nesting deeper than this is refused: no field here needs it, and deep values cost
#: recursion in every encoder and validator after this one (depth 600 overflows it: a 500).
MAX_JSON_DEPTH = 32


def _valid_text(value: str) -> bool:
    """No lone surrogate in `value`. Both checks are single C calls that do not hold the
    interpreter for long: scanning a 4 MB string with the regular expression took 75 ms."""
    if value.isascii():  # O(1): CPython knows the widest character of a string
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def find_invalid_value(data: Any) -> str | None:
    """A description of the first string that is not valid Unicode or number that is not
    finite in `data` (parsed JSON), with its path; None if there is none."""
    # An explicit stack, not recursion: the JSON parser accepts nesting deeper than
    # Python's recursion limit would leave room for here.
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return (f"{path or 'the body'}: JSON nested deeper than {MAX_JSON_DEPTH} levels "
                    f"is not accepted")
        if isinstance(value, str):
            match = None if _valid_text(value) else _SURROGATE.search(value)
            if match:
                return (f"{path or 'the body'}: text must be valid Unicode; it holds a lone "
                        f"UTF-16 surrogate (\\u{ord(match.group()):04x})")
        elif isinstance(value, float):
            if not math.isfinite(value):
                return f"{path or 'the body'}: {value} is not a JSON number"
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{path}.{key}" if path else str(key)
                stack.append((path or "the body", key, depth + 1))  # keys are text too
                stack.append((inner, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))
    return None


class RequestBody(BaseModel):
    """Base of the request bodies: refuses invalid text and non-finite numbers anywhere."""

    @model_validator(mode="before")
    @classmethod
    def _valid_json_text(cls, data: Any) -> Any:
        problem = find_invalid_value(data)
        if problem is not None:
            raise ValueError(problem)
        return data
