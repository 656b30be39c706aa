"""The deadline promised at registration: as tight as the ETAs' own record allows.

The worst-case deadline (`Dispatcher._promise`: the GPS finish with the most work the
measured arrivals can bring ahead, at the pessimistic rate, plus the delay bound) holds
whatever the order of arrivals, but on the family of arrival shapes it was 15-25 times the
JCT: it tells a user almost nothing. The deadline given is the tighter of that and

    now + factor x (ETA - now)     (x the prediction's p90 over the prediction, if uncertain)

where `factor` is how far first ETAs have fallen short: the largest ratio JCT / first ETA of
the agents finished recently (`EtaCalibration`, the record the intervals are set by), never
below `MIN_FACTOR`, which is also a fresh server's. It was chosen on the family's tuning
seeds (0-4, fresh and taught servers, every shape) as the largest ratio seen there, rounded
up: no promise broke on them; held-out figures in docs/concepts.md. Tool time is not
calibrated this way: an agent that may pause between its stages keeps the worst case.
The worst case stays reported beside it (`delay_bound_s`), and the record's
`promise_assumes` says what the calibrated deadline rests on: traffic ahead like the
traffic behind, arrivals no faster than measured.

Pure: no clock.
"""

from __future__ import annotations

from .eta_interval import EtaCalibration

# The largest JCT / first ETA on the tuning seeds (5.5, a diurnal ramp's third agent on a
# fresh server), rounded up: the factor of a fresh server and the least any calibration gives.
PRIOR_FACTOR = 6.0
MIN_FACTOR = PRIOR_FACTOR
PROMISE_QUANTILE = 1.0  # of the recent JCT / first-ETA ratios: the largest
MIN_SEEN = 10


def promise_factor(calibration: EtaCalibration) -> float:
    """How many times its ETA an agent's deadline allows: the calibrated upper quantile."""
    upper = calibration.upper_ratio(PROMISE_QUANTILE, MIN_SEEN)
    return PRIOR_FACTOR if upper is None else max(MIN_FACTOR, upper)


def tight_deadline(now: float, eta_at: float, pauses_mean_s: float, pauses_p90_s: float, factor: float,
                   cost_ratio: float = 1.0) -> float:
    """`now + factor x` the ETA's engine time, plus the p90 tool time (a pause is the
    caller's, not the engine's: scaling it would double count, ignoring it break promises).
    `cost_ratio`: the cost the promise allows for over the one the ETA expects (a
    prediction's p90 over the prediction)."""
    engine_s = max(0.0, eta_at - now - pauses_mean_s) * max(1.0, cost_ratio)
    return now + factor * engine_s + pauses_p90_s


def assumption(factor: float, seen: int, arrival_rate: float) -> str:
    """What a calibrated deadline rests on, in the record's words."""
    basis = (f"the largest JCT / first ETA of the last {seen} agents finished, at least {MIN_FACTOR:g}"
             if seen >= MIN_SEEN else "a fresh server's prior")
    return (f"deadline = {factor:.2g} x the ETA ({basis}); holds while work arrives no faster than measured "
            f"({arrival_rate:.4g} units/s) and the traffic ahead is like the traffic behind; "
            f"without those assumptions: fair_finish_s + delay_bound_s")
