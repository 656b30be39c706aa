"""A measured time-model prior checked against the engine's own warm-up steps.

A prior measured on this engine (`serve --profile` with a `bench calibrate` file, or the
last run's fit kept in the history) times every ETA and promise from the first agent on,
until the online fit has seen TRUSTED_STEPS steps (server/runtime/engine_upkeep.py). A
profile calibrated on another host, or on this one in a faster hour, makes each of those
early promises too tight by the same factor: served on a 2-core AMD host, a profile of the
2-core Intel host the family is calibrated on predicted steps 3-4x too short, and promises
of the first three bursts broke.

The server runs a warm-up before it takes agents (server/engine/warm_up.py): batches of
known shapes, whose last round runs on a warmed engine. Its steps are the host's speed of
the minute, measured before anyone is promised anything. Their summed time over the prior's
prediction of the same steps (`warm_up_reading`: the sum, as an ETA sums steps, a prefill
by its length; on that AMD host the median step read 1.96x, the sum 3.32x and the traffic's
steps about 3.4x) is compared with what the same warm-up read against the prior where it was
measured (`TimeModel.warm_up_ratio`: `bench calibrate` records it, a server keeping its fit
records its own): the linear model misses the warm-up's few small shapes by an amount of its
own, and a calibration made minutes before read 1.12-1.57 on that AMD host, enough to be
scaled as if it were another host's. Where the two readings differ by more than the
tolerance (`serve --prior-tolerance`, 1.5 by default), the prior is scaled by their ratio:
all of its coefficients, since one factor is what a hundred steps of a few shapes can tell.
A prior without a reading of its own (an older calibration) is compared with the warm-up's
reading alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from server.shared.step_time import MIN_STEPS, StepSample, TimeModel, warm_up_reading

__all__ = ["MIN_STEPS", "TOLERANCE", "PriorCheck", "check_prior"]

# Outside this factor the warm-up and the prior disagree by more than one host drifts from
# hour to hour (steps 10-40% off their calibration within an hour on the family's host;
# docs/benchmarks.md, the family live) and by less than another host differs (3-4x between
# the two kinds of 2-core host measured). Within it the warm-up cannot tell drift from its
# own noise: a few shapes of small batches, not the traffic's.
TOLERANCE = 1.5


@dataclass(frozen=True)
class PriorCheck:
    """What the warm-up said of the prior (plain data, in `GET /v1/scheduler`)."""

    steps: int  # warm-up steps compared
    # their summed time over the prior's prediction of it, over the prior's own reading
    # where it has one (None: too few steps)
    ratio: float | None
    scaled: bool  # the prior was scaled by `ratio`
    reading: float | None = None  # the warm-up's summed time over the prior's prediction
    expected: float | None = None  # what the warm-up read where the prior was measured

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "ratio": self.ratio, "scaled": self.scaled, "reading": self.reading,
                "expected": self.expected}


def check_prior(prior: TimeModel, steps: Sequence[StepSample],
                tolerance: float = TOLERANCE) -> tuple[TimeModel, PriorCheck]:
    """The prior to time ETAs with, given the engine's warm-up `steps`, and what was found."""
    reading = warm_up_reading(prior, steps)
    expected = prior.warm_up_ratio
    if reading.ratio is None:
        return prior, PriorCheck(reading.steps, None, False, None, expected)
    ratio = reading.ratio / (expected or 1.0)
    check = PriorCheck(reading.steps, ratio, False, reading.ratio, expected)
    if 1.0 / tolerance <= ratio <= tolerance:
        return prior, check
    # the scaled prior predicts the warm-up as this host runs it now: its reading is the one seen
    rescaled = prior.scaled(ratio, f"x{ratio:.2f} to {reading.steps} warm-up steps")
    return replace(rescaled, warm_up_ratio=reading.ratio / ratio), replace(check, scaled=True)
