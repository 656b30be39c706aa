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


class ServerGoneError(ServerUnavailableError):
    """No request of the client has got through to the server for `server_gone_s` seconds
    (refused or broken connections, 503): the client takes the server for gone. Requests
    fail at once with it until one gets through again; a batch fails its pending inputs
    with it."""


#: Statuses that may be answered differently when asked again: the server was busy,
#: restarting or behind a proxy that lost it. Any other 4xx is about the request itself.
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)  # httpx.HTTPStatusError, openai's APIStatusError
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def is_retryable(exc: BaseException) -> bool:
    """Whether running again what raised `exc` can succeed: True for connection errors and
    timeouts, 408/429/5xx answers (the server was busy or restarting) and the agent's own
    exceptions; False for an HTTP 4xx about the request (a prompt too long, a bad field, a
    wrong key: the same request gets the same answer), for `ServerGoneError` (the server
    is taken for gone) and for cancellations. What `retries=` of a batch retries.
    """
    if isinstance(exc, ServerGoneError):
        return False
    if isinstance(exc, AgentCancelledError):
        return False
    if isinstance(exc, BaseExceptionGroup):
        return all(is_retryable(e) for e in exc.exceptions)
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, cancellation
        return False
    status = _status_of(exc)
    if status is not None and 400 <= status < 600:
        return status in RETRYABLE_STATUSES
    return True


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
