"""Dispatchers in the states tests start from."""

from __future__ import annotations

from server.scheduler import Dispatcher


def quiet_for(d: Dispatcher, seconds: float = 100.0) -> Dispatcher:
    """A server that has measured arrivals, and no load, for `seconds`, up to now (t = 0):
    its promises count on that (a server that has measured none, or none since a lull of a
    whole arrival window, widens them)."""
    step = max(1.0, d.arrivals.window_s / 2)
    t = -seconds
    while t < 0.0:
        d.arrivals.add(t, 0.0)
        t += step
    d.arrivals.add(0.0, 0.0)
    return d
