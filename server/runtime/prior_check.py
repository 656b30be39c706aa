"""A measured time-model prior checked against the engine's own warm-up steps.

A prior measured on this engine (`serve --profile` with a `bench calibrate` file, or the
last run's fit kept in the history) times every ETA and promise from the first agent on,
until the online fit has seen TRUSTED_STEPS steps (server/runtime/engine_upkeep.py). A
profile calibrated on another host, or on this one in a faster hour, makes each of those
early promises too tight by the same factor: served on a 2-core AMD host, a profile of the
2-core Intel host the family is calibrated on predicted steps 3-4x too short, and promises
of the first three bursts broke.

The server runs a warm-up before it takes agents (server/api/app.py): batches of known
shapes, whose last round runs on a warmed engine. Its steps are the host's speed of the
minute, measured before anyone is promised anything. Where their summed time is off the
prior's prediction of the same steps by more than the tolerance (`serve --prior-tolerance`,
1.5 by default), the prior is scaled by that ratio: all of its coefficients, since one
factor is what a hundred steps of a few shapes can tell. The sum, not the median step,
because an ETA is a sum of steps: a prefill counts by its length, as it does in the ETA,
where the median is a small decode step's (on that AMD host the median read 1.96x and the
sum 3.32x, the traffic's steps about 3.4x). Steps more than DELAYED times the median ratio are
left out: a step the OS held up says nothing of the engine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.shared.step_time import StepSample, TimeModel

# Outside this factor the warm-up and the prior disagree by more than one host drifts from
# hour to hour (steps 10-40% off their calibration within an hour on the family's host;
# docs/benchmarks.md, the family live) and by less than another host differs (3-4x between
# the two kinds of 2-core host measured). Within it the warm-up cannot tell drift from its
# own noise: a few shapes of small batches, not the traffic's.
TOLERANCE = 1.5
DELAYED = 5.0  # a step this many times the median ratio was held up, not computed
MIN_STEPS = 16  # fewer warm-up steps (an engine that reports none, a tiny cache) say nothing


@dataclass(frozen=True)
class PriorCheck:
    """What the warm-up said of the prior (plain data, in `GET /v1/scheduler`)."""

    steps: int  # warm-up steps compared
    ratio: float | None  # their summed time over the prior's prediction of it (None: too few steps)
    scaled: bool  # the prior was scaled by `ratio`

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "ratio": self.ratio, "scaled": self.scaled}


def check_prior(prior: TimeModel, steps: Sequence[StepSample],
                tolerance: float = TOLERANCE) -> tuple[TimeModel, PriorCheck]:
    """The prior to time ETAs with, given the engine's warm-up `steps`, and what was found."""
    pairs = [(s.seconds, predicted) for s in steps if (predicted := prior.predict(s)) > 0 and s.seconds > 0]
    if len(pairs) < MIN_STEPS:
        return prior, PriorCheck(len(pairs), None, False)
    typical = statistics.median(seconds / predicted for seconds, predicted in pairs)
    kept = [(seconds, predicted) for seconds, predicted in pairs if seconds / predicted <= DELAYED * typical]
    ratio = sum(seconds for seconds, _ in kept) / sum(predicted for _, predicted in kept)
    if 1.0 / tolerance <= ratio <= tolerance:
        return prior, PriorCheck(len(kept), ratio, False)
    return prior.scaled(ratio, f"x{ratio:.2f} to {len(kept)} warm-up steps"), PriorCheck(len(kept), ratio, True)


class WarmUpSteps:
    """Listens to the engine's step samples during the warm-up and keeps those of its
    current round (`next_round` forgets the ones before: the first round pays for the
    engine's lazy set-up). Once `close`d it keeps nothing more: engines offer no way to
    stop listening, and a closed listener costs one test per step."""

    def __init__(self) -> None:
        self._steps: list[StepSample] = []
        self._open = True

    def observe(self, engine: str, sample: StepSample) -> None:
        if self._open:
            self._steps.append(sample)

    def next_round(self) -> None:
        self._steps.clear()

    def close(self) -> tuple[StepSample, ...]:
        self._open = False
        steps, self._steps = tuple(self._steps), []
        return steps
