"""What an agent type name may be: one rule, shared by `@agent` and the server."""

from __future__ import annotations

import re

#: An agent type name: letters, digits and `_ . : -`, 1 to AGENT_TYPE_MAX_LENGTH characters.
#: The server's `POST /v1/agents` refuses any other `type`; `@agent` refuses it where the
#: agent is defined.
AGENT_TYPE_PATTERN = r"^[A-Za-z0-9_.:\-]+$"
AGENT_TYPE_MAX_LENGTH = 200

_TYPE = re.compile(AGENT_TYPE_PATTERN)


def check_agent_type(name: object) -> str:
    """`name` if it is a valid agent type name; else ValueError saying what is allowed."""
    if not isinstance(name, str):
        raise TypeError(f"an agent type name is a str, not {type(name).__name__}")
    if not name or len(name) > AGENT_TYPE_MAX_LENGTH or not _TYPE.match(name):
        shown = name if len(name) <= 60 else name[:57] + "..."
        raise ValueError(
            f"invalid agent type name {shown!r}: use 1 to {AGENT_TYPE_MAX_LENGTH} letters, "
            "digits and _ . : - (no spaces); give @agent(\"a_valid_name\") a name of that form")
    return name
