"""Engine replicas on Ray Serve, behind the engine interface (server/engine/base.py).

`RayServeEngine` is the one place that speaks Ray. It deploys the engine replicas
(server/engine/ray_replica.py: one vLLM engine each, the project's own in-process backend)
as a Ray Serve application, and presents them to the scheduler as one engine:

- capacity: M is the sum of the replicas' KV capacities; a replica that dies (or that Ray
  replaces) leaves M until a replica reports again, and capacity listeners hear each change;
- placement: the scheduler admits a request only once `place` reserved its footprint on
  one replica (the agent's previous one first: its prompt prefix is in that replica's
  prefix cache), in the scheduler's own order; the request is then sent to that replica
  through the deployment's handle (`PinnedRouter` routes on the replica named in the call);
- health: the replicas report twice a second (a broadcast of `report`): their statistics,
  their busy steps (the scheduler's service rate), each step's batch shape (the samples of
  the scheduler's step-time model: one model per replica, named by the replica's id) and
  that they are alive;
- failure: a request whose replica died before it produced anything is resent to another
  replica; one that had produced output fails with an error naming the replica's death.
  While no replica serves (Ray is replacing them), requests wait instead of failing.

Unpinned (`pinned=False`, policy `ray`), requests go wherever Ray Serve's own router sends
them and nothing is reserved: what a Ray user has without Justitia's scheduler.

The scheduler does not rely on Ray's own view of replica load for admission: Ray caches
queue lengths for up to 10 s and polls routing statistics every 10 s, too stale to keep a
KV cache from overflowing, so the KV ledger stays here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from server.engine.base import (
    NOT_RUNNING,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InvalidRequestError,
    SampleListener,
    StateListener,
    StepListener,
)
from server.engine.placement import (
    NoReplica,
    PlacedReplicas,
    ReplicaFailed,
    ReplicaPlacement,
    ReplicaSlot,
    footprint,
)
from server.engine.ray_cluster import kill_survivors, ray_processes_under
from server.engine.tokens import TokenizerEngine, fast_encoder
from server.shared.step_time import StepSample

log = logging.getLogger("justitia.engine.ray")

APP_NAME = "justitia-engines"
REPORT_TIMEOUT_S = 10.0  # a replica silent this long in a poll is treated as gone
CONNECT_TIMEOUT_S = 5.0  # TCP check of a Ray address before ray.init (which would retry)
OBJECT_STORE_BYTES = 200 * 1024 * 1024  # a local cluster's object store: the engine ships no tensors


class RayUnreachable(EngineError):
    """The Ray cluster named by --ray cannot be reached."""


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connection to a Ray address (`HOST:PORT` or `ray://HOST:PORT`) succeeds within
    `timeout_s`; RayUnreachable with what to do otherwise. `local` and `auto` are not
    network addresses and pass (ray.init says itself when no local cluster runs)."""
    if address in ("local", "auto"):
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise RayUnreachable(f"--ray {address!r} is not an address: give HOST:PORT (the head node's "
                             "GCS address that `ray start --head` prints, e.g. 10.0.0.5:6379), "
                             "ray://HOST:10001, auto, or local")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise RayUnreachable(
            f"cannot reach the Ray cluster at {address} ({exc}): start one there with "
            "`ray start --head`, or pass --ray local to start one on this machine") from None


def project_root() -> str:
    """The folder holding the `server` package: Ray's workers import the replica from it."""
    return str(Path(__file__).resolve().parents[2])


def runtime_env() -> dict[str, Any]:
    """What Ray's worker processes need to import this project's code."""
    path = os.pathsep.join(p for p in (project_root(), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name in ("JUSTITIA_HOME", "VLLM_CPU_KVCACHE_SPACE", "RAY_AUTH_MODE"):
        if name in os.environ:
            env[name] = os.environ[name]
    return {"env_vars": env}


def connect(address: str) -> bool:
    """Connect this process to Ray (`local`: start a cluster of this process's own, on
    loopback); True when this process started the cluster (it stops it on close)."""
    check_reachable(address)  # before importing Ray: a refused address fails at once
    import ray

    if ray.is_initialized():
        return False
    if address == "local":
        # A cluster of our own on this machine: loopback only, no token to hand around.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        for attempt in range(3):
            try:
                ray.init(include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                         _node_ip_address="127.0.0.1", runtime_env=runtime_env(),
                         log_to_driver=False, logging_level=logging.WARNING)
                return True
            except Exception as exc:
                # Ray gives its raylet 30 s to register, which a busy machine exceeds now
                # and then: try again.
                if "timed out during startup" not in str(exc) or attempt == 2:
                    raise EngineError(f"the local Ray cluster did not start: {exc}") from exc
                log.warning("the local Ray cluster did not start in time; trying again")
                ray.shutdown()
    try:
        ray.init(address=address, runtime_env=runtime_env(), log_to_driver=False,
                 logging_level=logging.WARNING)
    except Exception as exc:  # ConnectionError, RuntimeError, a version mismatch ...
        raise RayUnreachable(
            f"cannot connect to the Ray cluster at {address} ({exc}): is `ray start --head` "
            "running there, with the same Ray version as here? (--ray local starts one on "
            "this machine)") from None
    return False


class RayServeEngine(PlacedReplicas, TokenizerEngine):
    """Engine replicas deployed on Ray Serve as one engine (see the module docstring).

    Capabilities (server/engine/base.py): `StepStatistics`, `StepSamples`, `Placement`,
    `CapacityChanges`, `ReplicaList`, `Autoscaled` and `Supervised`.
    """

    def __init__(self, address: str, replicas: int, settings: dict[str, Any], *,
                 pinned: bool = True, tokenizer: str | None = None,
                 min_replicas: int | None = None, max_replicas: int | None = None,
                 app_name: str = APP_NAME, poll_interval_s: float = 0.5,
                 start_timeout_s: float = 1800.0) -> None:
        self.address = address
        self.replica_count = replicas
        self.settings = dict(settings)
        self.pinned = pinned
        self.tokenizer_name = tokenizer
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.app_name = app_name
        self.poll_interval_s = poll_interval_s
        self.start_timeout_s = start_timeout_s
        self.placement = ReplicaPlacement()
        self.state = "stopped"
        self.state_detail = "the engine has not started"
        self._state_listeners: list[StateListener] = []
        self._step_listeners: list[StepListener] = []
        self._sample_listeners: list[SampleListener] = []
        self._streams: dict[str, Any] = {}
        self._aborted: set[str] = set()
        self.handle: Any = None  # the application's Ray Serve handle, once started
        self._poller: asyncio.Task[None] | None = None
        self._owns_cluster = False
        self._attached = False
        self._changed = asyncio.Event()
        self._demand: Callable[[], int] | None = None

    # -- lifecycle --------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.handle is not None and bool(self.placement.serving)

    @property
    def recovering(self) -> bool:
        """No replica serves now, but Ray is bringing them back: requests wait."""
        return self.state in ("starting", "restarting")

    def add_state_listener(self, listener: StateListener) -> None:
        self._state_listeners.append(listener)

    def _set_state(self, state: str, detail: str) -> None:
        if (state, detail) == (self.state, self.state_detail):
            return
        self.state, self.state_detail = state, detail
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for listener in self._state_listeners:
            try:
                listener(state, detail)
            except Exception:
                log.exception("engine state listener failed")

    async def start(self) -> None:
        self._set_state("starting", "the engine replicas are starting on Ray")
        self._owns_cluster = await asyncio.to_thread(connect, self.address)
        from ray import serve

        from server.engine.ray_replica import engine_deployment

        env = runtime_env()
        if self.min_replicas is not None:
            # The replicas push the autoscaling metrics (the scheduler's demand) every 2 s
            # rather than Ray's 10 s: the autoscaler acts on a burst sooner.
            env["env_vars"]["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "2"
        app = engine_deployment(replicas=self.replica_count, pinned=self.pinned, settings=self.settings,
                                min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                                ray_actor_options={"num_cpus": 0, "runtime_env": env})
        started = time.monotonic()
        try:
            self._attached = await asyncio.to_thread(self._running_app)
            if self._attached:  # deployed beforehand (`serve deploy`, a RayService): use it
                log.info("scheduling onto the running Ray Serve application %r", self.app_name)
                self.handle = serve.get_app_handle(self.app_name)
            else:
                await asyncio.to_thread(serve.start, proxy_location="Disabled")
                self.handle = await asyncio.wait_for(
                    asyncio.to_thread(serve.run, app, name=self.app_name, route_prefix=None),
                    self.start_timeout_s)
        except TimeoutError as exc:
            await self._teardown()
            raise EngineError(f"the engine replicas did not start on Ray ({self.address}) within "
                              f"{self.start_timeout_s:.0f} s (see Ray's logs under /tmp/ray)") from exc
        except Exception as exc:
            await self._teardown()
            raise EngineError(f"the engine replicas did not start on Ray ({self.address}): {exc}") from exc
        self._stream_handle = self.handle.options(stream=True, method_name="generate")
        reports = await self._reports()
        if not reports:
            await self._teardown()
            raise EngineError("the engine replicas started on Ray but none reports")
        first = reports[0]["info"]
        self._tokenizer = self._load_tokenizer(first["model"])
        self._encode = fast_encoder(self._tokenizer)
        self.absorb(reports)
        self._info = EngineInfo(**{**first, "kv_capacity_tokens": self.capacity})
        self.placement.started()
        log.info("%d engine replicas on Ray in %.0f s, M = %d KV tokens", len(reports),
                 time.monotonic() - started, self.capacity)
        self._set_state("running", "")
        self._poller = asyncio.create_task(self._poll_forever(), name="justitia-ray-reports")

    def _running_app(self) -> bool:
        """An application of our name already runs on the cluster (not one we deployed)."""
        from ray import serve

        try:
            status = serve.status().applications.get(self.app_name)
        except Exception:  # Serve not started on this cluster yet
            return False
        return status is not None and str(status.status).endswith("RUNNING")

    async def close(self) -> None:
        self._set_state("stopped", "the engine was stopped")
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self._teardown()

    async def _teardown(self) -> None:
        """Our application leaves the cluster; a cluster this process started goes with it
        (every Ray process under this one, the engine replicas and their engines too)."""
        import ray

        if not ray.is_initialized():
            return
        from ray import serve

        self.handle = None
        if not self._owns_cluster:
            if not self._attached:  # an application someone else deployed stays
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(serve.delete, self.app_name)
            await asyncio.to_thread(ray.shutdown)
            return
        # Our own cluster: no need to stop the application replica by replica (the server's
        # shutdown has seconds, not minutes); note every process of it before Ray stops it,
        # as some of them outlive their parents (Ray's agents, vLLM's engine processes).
        doomed = ray_processes_under(os.getpid())
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.shutdown)
        await asyncio.to_thread(kill_survivors, doomed)

    # -- reports: health, statistics, capacity -------------------------------------------
    def set_demand_source(self, demand: Callable[[], int]) -> None:
        """The scheduler's KV demand, sent with every poll: with --min/--max-replicas the
        replicas hand it to Ray Serve's autoscaler (server/engine/ray_replica.py)."""
        self._demand = demand

    async def _reports(self) -> list[dict[str, Any]]:
        demand = self._demand() if self._demand is not None else None
        results = await self.handle.broadcast("report", demand).results_async(
            return_exceptions=True, timeout_s=REPORT_TIMEOUT_S)
        return [r for r in results if isinstance(r, dict)]

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll()

    async def poll(self) -> bool:
        """Ask every replica for its report once (sending the scheduler's demand) and take
        the answers in; False when the broadcast itself failed (nothing is known then)."""
        try:
            reports = await self._reports()
        except Exception as exc:
            log.warning("the engine replicas did not report: %s", exc)
            return False
        self.absorb(reports)
        return True

    def absorb(self, reports: list[dict[str, Any]]) -> None:
        """Take in the replicas' reports (`report` in server/engine/ray_replica.py): a replica
        that reports joins or stays, healthy or not; one that does not report is gone; M
        follows, and the replicas' busy steps reach the step listeners."""
        placement = self.placement
        for rep in reports:
            known = placement.replicas.get(rep["replica"])
            if known is None and not rep["healthy"]:
                continue  # down, and it had left the table: it joins once its engine runs
            slot = known or placement.join(rep["replica"], int(rep["info"]["kv_capacity_tokens"]))
            placement.set_serving(slot, bool(rep["healthy"]), "its engine is not running")
            slot.stats = EngineStats(**rep["stats"])
            slot.detail.update(pid=rep.get("pid"), node=rep.get("node"))
        placement.keep_only((rep["replica"] for rep in reports), "it stopped reporting")
        m = self._capacity_changed()
        for rep in reports:
            known = placement.replicas.get(rep["replica"])
            kv = known.kv_capacity_tokens if known is not None else 0
            # As if every replica were as full as this one: the estimator's tau is per full
            # cache, and the replicas share the load.
            scale = m / kv if kv else 1.0
            for duration_s, kv_in_use in rep["steps"]:
                for listener in self._step_listeners:
                    listener(duration_s, kv_in_use * scale)
            # The same view for the step-time model: each replica's step as the whole
            # fleet's, its batch scaled alike (StepSample.scaled). An application deployed
            # by an earlier Justitia sends no samples: its reports are read without them.
            for seconds, decode_seqs, prefill_tokens, kv_tokens in rep.get("samples", ()):
                sample = StepSample(seconds, decode_seqs, prefill_tokens, kv_tokens).scaled(scale)
                for sample_listener in self._sample_listeners:
                    sample_listener(rep["replica"], sample)

    def _capacity_changed(self) -> int:
        m = self.placement.capacity
        if m <= 0:
            if self.state == "running":
                self._set_state("restarting", "no engine replica serves; Ray is replacing them")
            return m  # M keeps its last value: nothing is admitted anyway
        if self.state == "restarting":
            self._set_state("running", "")
        if self._info is not None and m != self._info.kv_capacity_tokens:
            self._info = dataclasses.replace(self._info, kv_capacity_tokens=m)
        return self.placement.announce()

    # -- capabilities: the placement's (PlacedReplicas) ---------------------------------
    def add_step_listener(self, listener: StepListener) -> None:
        self._step_listeners.append(listener)

    def add_sample_listener(self, listener: SampleListener) -> None:
        """Call `listener(replica_id, sample)` for every busy step of every replica, its
        batch scaled to the whole fleet (see `absorb`): the scheduler fits one step-time
        model per replica."""
        self._sample_listeners.append(listener)

    def stats(self) -> EngineStats:
        return self.placement.stats()

    def place(self, request_id: str, agent_id: str, footprint: int) -> bool:
        """Reserve room for an admitted request on one replica (the placement's rule).
        Unpinned, Ray places it: nothing is reserved here."""
        return super().place(request_id, agent_id, footprint) if self.pinned else True

    # -- requests -----------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        response = self._streams.pop(request_id, None)
        if response is not None:
            self._aborted.add(request_id)
            response.cancel()  # Ray cancels the replica's task: vLLM aborts, KV is freed

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if self.handle is None:
            raise EngineError(NOT_RUNNING)
        need = footprint(request)
        failed: list[ReplicaSlot] = []
        while True:
            while not self.healthy:  # Ray is replacing the replicas: wait for one
                if self.state in ("stopped", "failed"):
                    raise EngineError(f"{NOT_RUNNING}: {self.state_detail}")
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self.poll_interval_s)
            replica: ReplicaSlot | None = None
            held = 0
            if self.pinned:
                try:
                    replica, held = self.placement.claim(request.request_id, need, failed)
                except NoReplica as exc:
                    raise EngineError(f"{exc}; the request was not run") from exc
            emitted = False
            try:
                async for out in self._stream(replica, request):
                    emitted = True
                    yield out
                return
            except ReplicaFailed as exc:
                if replica is not None:
                    failed.append(replica)
                    self.placement.set_serving(replica, False, str(exc))
                    self._capacity_changed()
                if emitted:
                    raise EngineError(f"{exc} while running this request, after it had produced "
                                      "output: it was not resent; send it again") from exc
                log.warning("%s before its first token; resending %s", exc, request.request_id)
            finally:
                if replica is not None:
                    self.placement.unclaim(replica, held)

    async def _stream(self, replica: ReplicaSlot | None, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        import ray.exceptions
        from ray.serve.exceptions import RequestCancelledError

        rid = request.request_id
        kwargs = {"replica": replica.id} if replica is not None else {}
        response = self._stream_handle.remote(request, **kwargs)
        self._streams[rid] = response
        last: EngineOutput | None = None
        try:
            try:
                async for out in response:
                    last = out
                    yield out
            except (RequestCancelledError, asyncio.CancelledError):
                if rid not in self._aborted:
                    raise
            except (InvalidRequestError, EngineError) as exc:
                # The replica's engine refused or failed the request itself: its own error,
                # without Ray's wrapping (the replica's traceback).
                cause = getattr(exc, "cause", None)
                if isinstance(cause, (InvalidRequestError, EngineError)):
                    raise cause from None
                raise
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                    ray.exceptions.ActorDiedError) as exc:
                where = f"engine replica {replica.id}" if replica is not None else "an engine replica"
                raise ReplicaFailed(f"{where} died ({type(exc).__name__})") from exc
            if rid in self._aborted:
                p = len(request.prompt_token_ids)
                yield dataclasses.replace(last, finished=True, finish_reason="abort") if last else \
                    EngineOutput(rid, "", p, 0, finished=True, finish_reason="abort")
        finally:
            self._aborted.discard(rid)
            if self._streams.pop(rid, None) is not None and (last is None or not last.finished):
                response.cancel()  # our consumer left early: the replica aborts the request
