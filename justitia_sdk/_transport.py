"""Retries as an httpx transport: `RetryTransport` wraps the transport that does the I/O.

Every request a client sends goes through it. It sends again what is safe to send again
(refused connections, 429 and 503 answers, with exponential backoff and jitter, honoring
`Retry-After`; a completion whose connection broke), within the client's retry budget, and
keeps the client's liveness clock (`Liveness`): once no request has got through for
`server_gone_s` seconds, every request fails at once with `ServerGoneError` until one gets
through again. What it gives up on it raises as `ServerUnavailableError`; any other answer
(2xx, or a 4xx about the request) it returns to the client unread by it, for the client to
turn into a result or an `APIError`.

A request marked with the `NO_RETRY` extension (event streams, `/readyz`) passes straight
through: it is sent once and leaves the liveness clock alone.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import anyio
import httpx

from justitia_sdk._errors import ServerGoneError, ServerUnavailableError

#: Answers worth asking again: the server is busy (429) or not serving yet/any more (503).
RETRY_STATUSES = frozenset({429, 503})
#: Requests safe to send again when their connection broke: the server died under them, so
#: nothing of them survives there. Agent calls are not (a lost answer to a registration
#: would register twice).
INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Request extension: send once, outside the retries and the liveness clock.
NO_RETRY = "justitia_no_retry"
#: Seconds without a request getting through before a client takes its server for gone:
#: longer than a restart of the bundled server takes (55-90 s on 2 CPU cores).
SERVER_GONE_S = 120.0
#: Failures further apart than this (no request tried in between) are not one outage: the
#: clock starts again from the later one.
OUTAGE_GAP_S = 30.0
#: Backoff: the first pause (seconds, before jitter), doubled each retry up to the cap.
_BACKOFF_FIRST_S = 0.25
_BACKOFF_CAP_S = 8.0
#: The shortest pause before the try that finds a gone server out as the window ends.
_MIN_PAUSE_S = 0.05
_BROKEN = (httpx.RemoteProtocolError, httpx.ReadError)
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)


class Liveness:
    """When the client's requests last got through to the server, shared by all of them.

    A request gets through when the server answers it with anything but 503 (a 429 is a
    live server asking to slow down). Refused and broken connections and 503s are failures.
    The server is *gone* once failures have lasted `gone_s` seconds with no request getting
    through in between: from then on a request fails at its first failure, without retries,
    until one gets through again.
    """

    def __init__(self, gone_s: float) -> None:
        if gone_s <= 0:
            raise ValueError("server_gone_s must be > 0 seconds")
        self.gone_s = gone_s
        self.down_since: float | None = None
        self.last_failure: float | None = None
        self.last_ok: float | None = None

    def ok(self) -> None:
        self.down_since = self.last_failure = None
        self.last_ok = time.monotonic()

    def failed(self, since: float) -> None:
        """A request failed that was sent at `since` (monotonic; for a connection that
        broke, when it broke): nothing has got through since then, or since the last
        request that did, whichever is later."""
        now = time.monotonic()
        since = max(min(since, now), self.last_ok or since)
        if (self.down_since is None or self.last_failure is None
                or now - self.last_failure > OUTAGE_GAP_S):
            self.down_since = since
        else:
            self.down_since = min(self.down_since, since)
        self.last_failure = now

    def down_for(self) -> float:
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    @property
    def gone(self) -> bool:
        return self.down_since is not None and self.down_for() >= self.gone_s

    def until_gone(self, pause: float) -> float:
        """`pause`, cut short to try again as the window ends: a gone server is found out
        when the window ends, not a backoff later."""
        return min(pause, max(_MIN_PAUSE_S, self.gone_s - self.down_for()))


@dataclass
class RetryBudget:
    """How long one request keeps trying: `window_s` seconds from its first try (from the
    break, for a completion whose connection broke), or at most `max_retries` retries."""

    max_retries: int | None = None
    window_s: float = 120.0

    def spent(self, attempt: int, started: float) -> bool:
        if self.max_retries is not None and attempt >= self.max_retries:
            return True
        return time.monotonic() - started >= self.window_s


def backoff(attempt: int) -> float:
    """Exponential with full jitter, so that many agents refused at once do not retry in
    lockstep."""
    return min(_BACKOFF_CAP_S, _BACKOFF_FIRST_S * 2.0**attempt) * (0.5 + random.random())


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def detail_of(response: httpx.Response) -> str:
    """The server's one-sentence reason for an error answer (read)."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # OpenAI's shape
        message = body["error"].get("message")
        if isinstance(message, str):
            return message
    return json.dumps(body)[:300]


def _tried(attempt: int, started: float) -> str:
    return (f" through {attempt} retries over {time.monotonic() - started:.0f} s" if attempt
            else "")


class RetryTransport(httpx.AsyncBaseTransport):
    """Sends each request through `inner`, again while a retry can succeed (module doc)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, *, liveness: Liveness,
                 budget: RetryBudget, base_url: str) -> None:
        self.inner = inner
        self.liveness = liveness
        self.budget = budget
        self.base_url = base_url

    async def aclose(self) -> None:
        await self.inner.aclose()

    def gone_error(self, last: str) -> ServerGoneError:
        return ServerGoneError(
            f"the Justitia server at {self.base_url} is gone: no request has got through "
            f"for {self.liveness.down_for():.0f} s (server_gone_s={self.liveness.gone_s:g}); "
            f"last failure: {last}")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.extensions.get(NO_RETRY):
            return await self.inner.handle_async_request(request)
        method, path = request.method, request.url.path
        resend_on_break = method == "POST" and path in INFERENCE_PATHS
        attempt, started = 0, time.monotonic()
        while True:
            sent = time.monotonic()
            try:
                response = await self.inner.handle_async_request(request)
                # Read here, so that a connection broken mid-answer is retried as one broken
                # before the answer began.
                await response.aread()
            except (*_REFUSED, *_BROKEN) as exc:
                broke = isinstance(exc, _BROKEN)
                self.liveness.failed(time.monotonic() if broke else sent)
                if self.liveness.gone:
                    raise self.gone_error(f"{exc!r}") from exc
                if broke and resend_on_break:
                    started = time.monotonic()  # the server died under it: a new window
                if (broke and not resend_on_break) or self.budget.spent(attempt, started):
                    raise ServerUnavailableError(
                        f"cannot reach the Justitia server at {self.base_url}: {exc!r}"
                        f"{_tried(attempt, started)}") from exc
                await anyio.sleep(self.liveness.until_gone(backoff(attempt)))
                attempt += 1
                continue
            self._note_answer(response, sent)
            if response.status_code not in RETRY_STATUSES:
                return response
            if self.budget.spent(attempt, started):
                raise ServerUnavailableError(
                    f"{method} {path}: the server stayed busy ({response.status_code}: "
                    f"{detail_of(response)}){_tried(attempt, started)}")
            pause = retry_after(response) or backoff(attempt)
            if response.status_code == 503:
                pause = self.liveness.until_gone(pause)
            await anyio.sleep(pause)
            attempt += 1

    def _note_answer(self, response: httpx.Response, sent: float) -> None:
        """The liveness clock after an answer: a 503 is a failure (raises `ServerGoneError`
        once the window has passed), anything else gets through."""
        if response.status_code != 503:
            self.liveness.ok()
            return
        self.liveness.failed(sent)
        if self.liveness.gone:
            raise self.gone_error(f"503: {detail_of(response)}")
