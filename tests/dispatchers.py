"""Dispatchers in the states tests start from."""

from __future__ import annotations

from server.scheduler import Dispatcher


def quiet_for(d: Dispatcher, seconds: float = 100.0) -> Dispatcher:
    """A server that has measured arrivals, and no load, for `seconds`: its promises count
    on that (a server that has measured none widens them)."""
    d.arrivals.add(-seconds, 0.0)
    return d
