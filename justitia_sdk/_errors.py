"""Exceptions raised by the SDK. One base class, so `except JustitiaError` catches them all."""

from __future__ import annotations


class JustitiaError(Exception):
    """Base class of every error the SDK raises on purpose."""


class APIError(JustitiaError):
    """The server answered with an error status. `detail` is the server's one-sentence reason."""

    def __init__(self, status_code: int, detail: str, *, method: str = "", url: str = "") -> None:
        self.status_code = status_code
        self.detail = detail
        self.method = method
        self.url = url
        where = f" ({method} {url})" if method else ""
        super().__init__(f"{status_code}: {detail}{where}")


class AgentNotFoundError(APIError):
    """404: the server does not know this agent (or it belongs to another tenant)."""


class AgentClosedError(APIError):
    """409: the agent is finished, cancelled or expired; it takes no more requests."""


class AuthenticationError(APIError):
    """401/403: missing or wrong API key (set `api_key=` or JUSTITIA_API_KEY)."""


class NotJustitiaError(APIError):
    """The URL answered, but not as a Justitia server (an HTML page, another web server)."""


class AgentTimeoutError(JustitiaError, TimeoutError):
    """A batch's agent did not finish within its `timeout` (it was cancelled on the server)."""


class AgentCancelledError(JustitiaError):
    """A batch's agent was cancelled with its batch (an interrupt, `Batch.cancel`)."""


class ServerUnavailableError(JustitiaError):
    """The server could not be reached, or stayed busy (429/503) through every retry."""


def error_for(status_code: int, detail: str, *, method: str = "", url: str = "") -> APIError:
    """The most specific APIError subclass for a status code."""
    cls: type[APIError] = APIError
    if status_code == 404:
        cls = AgentNotFoundError if "/agents" in url or "agent" in detail.lower() else APIError
    elif status_code == 409:
        cls = AgentClosedError
    elif status_code in (401, 403):
        cls = AuthenticationError
    return cls(status_code, detail, method=method, url=url)
