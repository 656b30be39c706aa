"""What runs inside Ray: the engine replica deployment and the router that pins requests.

`EngineReplica` is a Ray Serve deployment around the project's own in-process engine
(`LocalVLLMEngine`): each replica is one vLLM AsyncLLM with priority scheduling, its exact
KV capacity, its per-step statistics and its prefix-cache hits, the same engine the
embedded server runs. The scheduler (server/engine/ray_serve.py) talks to it through a
`DeploymentHandle`:

- `generate(request, replica=ID)`: stream the request's `EngineOutput`s; `replica` names the
  replica the scheduler placed it on, and `PinnedRouter` (this deployment's request router)
  sends it there. Without `replica`, Ray Serve's own power-of-two-choices routing decides
  (policy `ray`: what a Ray user has without Justitia);
- `report(demand_tokens)` (broadcast to every replica): its id, its engine's limits, its
  statistics and the busy steps since the last report: each step's duration and KV in use
  (the scheduler's service rate) and its batch shape (the samples of the scheduler's step-time
  model, one model per replica). `demand_tokens` is the scheduler's
  KV demand (tokens reserved by running requests plus the footprints of queued ones), which
  the replica hands to Ray Serve's autoscaler as a custom metric (`record_autoscaling_stats`);
  `backlog_policy`, the deployment's autoscaling policy, asks for as many replicas as that
  demand fills (Ray applies the `--min-replicas`/`--max-replicas` bounds and the delays).

Cancelling a streamed call (the scheduler's `abort`, or its consumer going away) cancels
the replica's task, which aborts the request in vLLM and frees its KV cache.

This module imports Ray and vLLM at the top: only Ray's processes and the Ray adapter
import it, never the fast tier or the server without `--ray`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import asdict
from typing import Any

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from server.engine.base import EngineOutput, EngineRequest
from server.shared.step_time import StepSample

# A report keeps at most this many busy steps, and as many step samples (the scheduler polls
# twice a second; a replica steps at most a few hundred times a second).
STEP_BUFFER = 4096
# A request pinned to a replica that is no longer a candidate (Ray stopped it to scale down,
# or it died) waits this long for it, then goes to any replica: the scheduler re-places it
# only on a resend, and a request must not wait for a replica that will not come back.
PIN_WAIT_S = 3.0
# The custom autoscaling metrics (Ray Serve aggregates each over its look-back window).
DEMAND = "justitia_demand_tokens"
KV_TOKENS = "justitia_kv_tokens"
# Autoscaling: how quickly Ray acts on the demand (seconds). Scaling up waits out a blip;
# scaling down waits out a pause between bursts (a replica takes a minute to start here).
LOOK_BACK_S = 12.0  # over Ray's default push interval of the replicas' metrics (10 s)
UPSCALE_DELAY_S = 2.0
DOWNSCALE_DELAY_S = 30.0


class PinnedRouter(RequestRouter):
    """Sends a request to the replica named by its `replica` keyword (the scheduler's
    placement); a request without one, or whose replica is gone, goes to any replica with
    the fewest requests in flight (the scheduler re-places a request it resends)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        wanted = pending_request.kwargs.get("replica") if pending_request is not None else None
        if wanted is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
            assert pending_request is not None
            if pinned or time.time() - pending_request.created_at < PIN_WAIT_S:
                return [pinned]  # empty while it is not (yet) a candidate: wait a little
        return [candidate_replicas]


class EngineReplica:
    """One vLLM engine as a Ray Serve replica (see the module docstring).

    `settings` are `LocalEngineConfig`'s fields; `model` None: the embedded tiny model.
    On the CPU build each replica's model worker gets its own core, by its rank on the node
    (vLLM pins its worker to core 0 unless told otherwise, and two replicas there share it).
    """

    async def __init__(self, settings: dict[str, Any]) -> None:  # type: ignore[misc]
        # Ray actors may construct asynchronously: the replica is RUNNING (and takes
        # requests) once its engine has started.
        from server.engine.tiny_model import embedded_engine_config
        from server.engine.vllm_local import LocalEngineConfig, LocalVLLMEngine

        context = serve.get_replica_context()
        self._id = context.replica_id.unique_id
        self._node = context.rank.node_rank
        self._steps: list[tuple[float, float]] = []
        # (seconds, decode_seqs, prefill_tokens, kv_tokens): a StepSample as plain numbers
        self._samples: list[tuple[float, float, float, float]] = []
        self._demand = 0.0
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if cores and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[context.rank.local_rank % len(cores)])
        settings = dict(settings)
        model = settings.pop("model", None)
        # Ray replaces a dead replica itself: the engine inside does not restart on its own.
        settings.setdefault("restarts", 0)
        config = (embedded_engine_config(**settings) if model is None
                  else LocalEngineConfig(model=model, **settings))
        self._engine = LocalVLLMEngine(config)
        await self._engine.start()
        self._engine.add_step_listener(self._on_step)
        self._engine.add_sample_listener(self._on_sample)

    def _on_step(self, duration_s: float, kv_in_use: float) -> None:
        self._steps.append((duration_s, kv_in_use))
        if len(self._steps) > STEP_BUFFER:
            del self._steps[: len(self._steps) - STEP_BUFFER]

    def _on_sample(self, engine_name: str, sample: StepSample) -> None:
        self._samples.append((sample.seconds, sample.decode_seqs, sample.prefill_tokens, sample.kv_tokens))
        if len(self._samples) > STEP_BUFFER:
            del self._samples[: len(self._samples) - STEP_BUFFER]

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead engine makes Ray replace the replica."""
        if not self._engine.healthy:
            raise RuntimeError(f"the vLLM engine of replica {self._id} is not running: "
                               f"{self._engine.state_detail}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics: the scheduler's KV demand as of its last
        report, and this replica's KV capacity."""
        return {DEMAND: self._demand, KV_TOKENS: float(self._engine.info.kv_capacity_tokens)}

    async def report(self, demand_tokens: float | None = None) -> dict[str, Any]:
        if demand_tokens is not None:
            self._demand = float(demand_tokens)
        engine = self._engine
        steps, self._steps = self._steps, []
        samples, self._samples = self._samples, []
        return {"replica": self._id, "info": asdict(engine.info),
                "stats": asdict(engine.stats()), "steps": steps, "samples": samples,
                "healthy": engine.healthy,
                "pid": os.getpid(), "node": self._node}

    async def generate(self, request: EngineRequest, replica: str | None = None
                       ) -> AsyncGenerator[EngineOutput, None]:
        stream = self._engine.generate(request)
        try:
            async for out in stream:
                yield out
        finally:
            # Cancelled (the scheduler aborted it, or its consumer went away): closing the
            # engine's stream aborts the request in vLLM, which frees its KV cache.
            await stream.aclose()

    async def abort(self, request_id: str, replica: str | None = None) -> None:
        await self._engine.abort(request_id)

    async def __del__(self) -> None:
        """Ray Serve stops the replica: stop its engine (and vLLM's processes) with it."""
        await self._engine.close()


def backlog_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve autoscaling policy: as many replicas as the scheduler's KV demand fills
    (demand over one replica's KV capacity, rounded up). Ray's wrapper clamps the answer to
    min/max replicas and applies the up/down-scaling delays. No report yet: stay."""
    metrics = ctx.aggregated_metrics or {}
    demand = max(metrics.get(DEMAND, {}).values(), default=None)
    capacities = [v for v in metrics.get(KV_TOKENS, {}).values() if v > 0]
    if demand is None or not capacities:
        return ctx.target_num_replicas, {}
    # Self-contained (Ray's controller runs it from a pickle, where this project's other
    # modules may not import): replicas of the smallest capacity the demand fills.
    return max(1, math.ceil(demand / min(capacities))), {}


def autoscaling_config(min_replicas: int, max_replicas: int, initial: int) -> dict[str, Any]:
    """The engine deployment's autoscaling: `backlog_policy` on the scheduler's demand."""
    return {"min_replicas": min_replicas, "max_replicas": max_replicas, "initial_replicas": initial,
            "policy": {"policy_function": "server.engine.ray_replica:backlog_policy"},
            # the window's peak: up at once on a burst, down only once the window is quiet
            "look_back_period_s": LOOK_BACK_S, "aggregation_function": "max",
            "upscale_delay_s": UPSCALE_DELAY_S,
            "downscale_delay_s": DOWNSCALE_DELAY_S}


def engine_deployment(*, replicas: int, pinned: bool, settings: dict[str, Any],
                      min_replicas: int | None = None, max_replicas: int | None = None,
                      ray_actor_options: dict[str, Any] | None = None) -> Any:
    """The engine deployment, bound and ready for `serve.run`.

    `pinned`: Justitia's scheduler places every request (`PinnedRouter`); else Ray Serve's
    default router does. Each replica takes as many requests as the scheduler sends: the
    scheduler, not Ray's queue limit, bounds what is in flight (`max_ongoing_requests`
    high, as Ray Serve LLM sets it)."""
    options: dict[str, Any] = {
        "name": "JustitiaEngine",
        "max_ongoing_requests": 1_000_000,
        "ray_actor_options": ray_actor_options or {"num_cpus": 0},
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 5.0,
    }
    if min_replicas is not None and max_replicas is not None and min_replicas != max_replicas:
        options["autoscaling_config"] = autoscaling_config(min_replicas, max_replicas, replicas)
        # A replica Ray stops to scale down finishes the requests it runs first.
        options["graceful_shutdown_timeout_s"] = 120.0
    else:
        options["num_replicas"] = replicas
    if pinned:
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(
            request_router_class="server.engine.ray_replica:PinnedRouter")  # type: ignore[arg-type]
    deployment: Any = serve.deployment(EngineReplica)
    return deployment.options(**options).bind(settings)


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The engine application for Ray Serve's config files and Python users:
    `import_path: server.engine.ray_replica:build_app` with `args` such as
    `{"replicas": 2, "kv_tokens": 4096, "max_model_len": 1024}`, or
    `serve.run(build_app({...}), name="justitia-engines")`.

    `replicas`, `min_replicas`/`max_replicas` (autoscaling) and `pinned` (default true: the
    Justitia scheduler places requests) shape the deployment; every other key is a setting of
    each replica's engine (`LocalEngineConfig`: `model` (default the embedded tiny model),
    `kv_tokens`, `max_model_len`, `max_num_seqs`, ...). `justitia serve --ray ADDRESS` finds
    an application of this name running and schedules onto it instead of deploying its own.
    """
    settings = dict(args or {})
    replicas = int(settings.pop("replicas", 1))
    pinned = bool(settings.pop("pinned", True))
    low, high = settings.pop("min_replicas", None), settings.pop("max_replicas", None)
    actor_options = settings.pop("ray_actor_options", None)
    return engine_deployment(replicas=replicas, pinned=pinned, settings=settings,
                             min_replicas=low, max_replicas=high, ray_actor_options=actor_options)
