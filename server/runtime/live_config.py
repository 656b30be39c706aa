"""The live scheduler's settings (filled from `justitia serve`'s options)."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.runtime.limits import Quotas
from server.runtime.prior_check import TOLERANCE
from server.scheduler.time_model import DEFAULT_PRIOR, TimeModel
from server.shared.step_time import StepSample


@dataclass(frozen=True)
class LiveConfig:
    policy: str = "justitia"
    # Whether a paused agent's context is kept in the engine: auto (while it pays), always,
    # never (server/runtime/retain.py; policies that do not keep contexts: never).
    retain: str = "auto"
    las_half_life_s: float | None = None  # las only (None: its default)
    las_head_wait_weight: float | None = None  # las only (None: its default)
    session_idle_s: float = 60.0  # an implicit session agent idle this long is finished
    initial_tau_s: float = 0.01
    lease_s: float = 600.0  # an agent idle this long without finish expires
    retention_s: float = 3600.0  # terminal agents stay readable this long
    max_num_seqs: int = 256
    housekeeping_s: float = 1.0
    eta_refresh_s: float = 0.25  # ETAs are replayed this often, off the request path
    quotas: Quotas = field(default_factory=Quotas)
    # tenant -> its weight in the hierarchical fair share (default 1; tenant_clock.py)
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Where the engine's time model starts before it has seen a step (server/scheduler/time_model.py).
    time_model_prior: TimeModel = DEFAULT_PRIOR
    # The prior was measured on this engine (`serve --profile`, a `bench calibrate` file): it
    # times ETAs from the start, and sets their rate (Dispatcher.eta_rate) before the fit has
    # seen TRUSTED_STEPS steps.
    prior_measured: bool = False
    # The last round of the engine's warm-up (server/api/app.py): a measured prior is checked
    # against these steps, and scaled where the host runs at another speed (prior_check.py).
    warm_up_steps: tuple[StepSample, ...] = ()
    prior_tolerance: float = TOLERANCE  # the warm-up may be off a measured prior by this factor
