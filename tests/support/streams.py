"""Reading the server's event streams (SSE) in tests."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx


def sse_json(response: httpx.Response) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream as they arrive (not `[DONE]`)."""
    for line in response.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[len("data: "):])


class BackgroundStream:
    """Reads a stream's JSON events into `events` on a thread while the test goes on.

    `open_stream` opens the stream (`lambda: client.stream("POST", ...)`); what the thread
    saw of the response (`content_type`) and any error it met (`error`) stay readable.
    """

    def __init__(self, open_stream: Callable[[], AbstractContextManager[httpx.Response]]) -> None:
        self.events: list[dict] = []
        self.content_type: str | None = None
        self.error: BaseException | None = None
        self._open = open_stream
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with self._open() as response:
                self.content_type = response.headers.get("content-type")
                for event in sse_json(response):
                    self.events.append(event)
        except Exception as exc:  # kept for the test to look at, not lost with the thread
            self.error = exc

    def join(self, timeout_s: float = 60.0) -> None:
        """Wait for the stream to end; an AssertionError if it has not within `timeout_s`."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the stream did not end within {timeout_s} s"
