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


def worst_case_promises(d: Dispatcher) -> Dispatcher:
    """A server whose first ETAs have all fallen a thousand times short: the calibrated
    deadline (tight_promise.py) is then never the tighter, and deadlines are the worst case."""
    for _ in range(20):
        d.etas.calibration.observe(1.0, 1000.0)
    return d
