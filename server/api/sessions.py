"""Sessions: agents for clients that never heard of agents, only of session ids.

Coding agents and gateways already tag their requests with a session id (Claude Code sends
`x-claude-code-session-id`, OpenCode `x-session-affinity`, llm-d's gateway
`x-gateway-inference-fairness-id`). An OpenAI-compatible request without an agent tag but
with one of these headers joins the implicit agent of (tenant, session id): created at the
session's first request, scheduled like any agent, finished once the session has been idle
for `--session-idle-s` (DESIGN.md section 8, additions; docs/server.md shows a client).

This module reads the headers; `LiveScheduler.session_agent` keeps the table of sessions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from server.api import errors
from server.runtime.agents import SessionRef

#: The session headers, in precedence order: the first one present names the session.
SESSION_HEADERS = (
    "X-Session-Id",
    "session-id",
    "x-session-affinity",
    "x-claude-code-session-id",
    "x-gateway-inference-fairness-id",
    "x-llm-d-inference-fairness-id",
)
#: The type of a session's agent (it selects the cost predictor); `session` when absent.
AGENT_TYPE_HEADER = "X-Justitia-Agent-Type"
SESSION_AGENT_TYPE = "session"
MAX_SESSION_ID_CHARS = 256
# The agent API's rule for a type (server/api/agents_api.py), so that a type means the same
# whichever way it arrives.
_TYPE = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


def session_of(headers: Mapping[str, str]) -> SessionRef | None:
    """The session named by the first session header present (empty values count as
    absent: some clients send the header before they have an id); None without one.
    A malformed id or type is a 400 that names the header."""
    for name in SESSION_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            return SessionRef(_checked_id(name, value), agent_type_of(headers))
    return None


def agent_type_of(headers: Mapping[str, str]) -> str:
    """The `X-Justitia-Agent-Type` header's type, else `session`."""
    value = headers.get(AGENT_TYPE_HEADER, "").strip()
    if not value:
        return SESSION_AGENT_TYPE
    if not _TYPE.match(value):
        raise errors.FieldHTTPException(
            400, f"the {AGENT_TYPE_HEADER} header must be 1-200 letters, digits or _ . : -; "
                 f"got {value[:40]!r}", param=AGENT_TYPE_HEADER)
    return value


def _checked_id(header: str, value: str) -> str:
    if len(value) > MAX_SESSION_ID_CHARS:
        raise errors.FieldHTTPException(
            400, f"the {header} header holds {len(value)} characters; a session id has at most "
                 f"{MAX_SESSION_ID_CHARS}", param=header)
    if not value.isprintable():
        raise errors.FieldHTTPException(
            400, f"the {header} header must be printable text", param=header)
    return value
