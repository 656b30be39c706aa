"""The FastAPI application: wiring only. Each concern lives in its own module."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api import errors
from server.api.agents_api import DIRECT as DIRECT_AGENT_ROUTES
from server.api.agents_api import router as agents_router
from server.api.auth import RateLimitFirst
from server.api.bodies import serve_directly
from server.api.config import ServerConfig
from server.api.dashboard import DashboardHub
from server.api.dashboard.api import router as dashboard_router
from server.api.dashboard.shared import DashboardStreams
from server.api.grammar import GrammarChecker
from server.api.health import liveness, readiness
from server.api.openai_api import DIRECT as DIRECT_OPENAI_ROUTES
from server.api.openai_api import router as openai_router
from server.api.request_limits import RequestLimits
from server.api.tool_calls import ToolCallParser
from server.engine.base import (
    Capabilities,
    Engine,
    EngineError,
    EngineInfo,
    EngineRequest,
    SamplingOptions,
    StepSamples,
    Supervised,
)
from server.runtime.data_dir import check_writable
from server.runtime.history import History
from server.runtime.limits import PerTenant, Quotas, RateLimiter
from server.runtime.live import LiveConfig, LiveScheduler
from server.runtime.metrics import CONTENT_TYPE, Metrics
from server.runtime.prior_check import WarmUpSteps
from server.runtime.service import InferenceService
from server.runtime.shutdown import SHUTTING_DOWN, Shutdown
from server.scheduler.policies import ENGINE, get_policy
from server.shared.step_time import StepSample

log = logging.getLogger("justitia.server")


#: Headers of an answer given before the request's body was read: the connection closes
#: after it, so the server does not go on receiving (and parsing, on the event loop) the
#: megabytes the client still sends.
UNREAD_BODY = {"Connection": "close"}
GRAMMAR_WARM_UP_WAIT_S = 60.0  # the longest start-up waits for the grammar worker to load


class BodySizeLimit:
    """Refuse bodies over the limit with 413 before reading them into memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            response = errors.error_response(
                scope["path"], 413, f"the body has {int(length)} bytes; the limit is {self.max_bytes}",
                headers=UNREAD_BODY)
            await response(scope, receive, send)
            return
        if length is not None or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            # The server holds a request to its Content-Length; bodiless methods have none.
            await self.app(scope, receive, send)
            return
        # A body of unknown length (chunked) is read here, up to the limit, and replayed:
        # an exception raised from inside the app's receive() would be caught by FastAPI's
        # body parser and answered 400 instead of 413.
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                response = errors.error_response(
                    scope["path"], 413, f"the body is over the limit of {self.max_bytes} bytes",
                    headers=UNREAD_BODY)
                await response(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def build_engine(config: ServerConfig) -> tuple[Engine, str]:
    """The in-process vLLM engine for this configuration, and the model's served name."""
    from server.engine.tiny_model import TINY_MODEL_NAME, embedded_engine_config
    from server.engine.vllm_local import LocalEngineConfig, LocalVLLMEngine

    if config.ray_address:
        from server.engine.ray_serve import RayServeEngine

        settings: dict[str, Any] = {"model": config.model, "max_model_len": config.max_model_len,
                                    "max_num_seqs": config.max_num_seqs,
                                    "engine_core_nice": config.engine_nice}
        if config.kv_tokens is not None:  # M, split evenly over the replicas
            settings["kv_tokens"] = config.kv_tokens // config.replicas
        ray_engine = RayServeEngine(config.ray_address, config.replicas, settings,
                                    pinned=get_policy(config.policy).admission != ENGINE,
                                    tokenizer=config.tokenizer, min_replicas=config.min_replicas,
                                    max_replicas=config.max_replicas)
        name = config.served_model_name or (Path(config.model).name if config.model else TINY_MODEL_NAME)
        return ray_engine, name

    if config.engine_urls:
        from server.engine.remote import RemoteVLLMEngine

        remote = RemoteVLLMEngine(config.engine_urls[0], tokenizer=config.tokenizer)
        return remote, config.served_model_name or ""

    if config.model is None:
        engine_cfg = embedded_engine_config(
            kv_tokens=config.kv_tokens,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            engine_core_nice=config.engine_nice,
            restarts=config.engine_restarts,
        )
        return LocalVLLMEngine(engine_cfg), config.served_model_name or TINY_MODEL_NAME
    engine_cfg = LocalEngineConfig(
        model=config.model,
        kv_tokens=config.kv_tokens,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        engine_core_nice=config.engine_nice,
        restarts=config.engine_restarts,
    )
    name = config.served_model_name or Path(config.model).name or config.model
    return LocalVLLMEngine(engine_cfg), name


# The warm-up: (prompt tokens, output tokens) of requests run together, WARM_UP_ROUNDS times.
# With one short generation instead, a fresh server's first agents ran slower than the same
# agents after a few seconds of traffic (the vLLM CPU engine, the family's `tenants` seed
# 102: mean JCT median 1.32 s over six fresh servers, 1.06-1.14 s after eight agents, median
# 1.14 s over four with this batch): the engine's first batches of each size and length pay
# for lazy set-up. Most of it is a CPU kernel per row count, which the engine builds itself
# for every batch size it can hold (server/engine/cpu_worker.py); this batch also reaches the
# prefill lengths and the server's own paths (streams, output tasks).
WARM_UP_BATCH = ((64, 16), (256, 16), (1024, 16), (64, 64), (256, 64), (512, 64))
WARM_UP_ROUNDS = 2


def warm_up_requests(info: EngineInfo, text_ids: Sequence[int], round_: int = 0) -> list[EngineRequest]:
    """The warm-up batch for an engine of `info`: each request cut to fit its context and
    the KV cache alone, its prompt `text_ids` repeated from a shifted start (a prompt of its
    own: the prefix cache must not make its prefill free)."""
    if not text_ids:
        return []
    requests = []
    for k, (prompt, output) in enumerate(WARM_UP_BATCH):
        prompt = min(prompt, min(info.max_model_len, info.kv_capacity_tokens) - output)
        if prompt < 1:
            continue
        shift = k * 7 + round_ * 3
        ids = tuple(text_ids[(shift + i) % len(text_ids)] for i in range(prompt))
        requests.append(EngineRequest(f"justitia-warmup-{round_}-{k}", ids,
                                      SamplingOptions(max_tokens=output, ignore_eos=True)))
    return requests


async def _warm_up(engine: Engine, samples: StepSamples | None) -> tuple[StepSample, ...]:
    """A few batches before /readyz turns green: the first steps of a fresh engine are slow
    (lazy initialisation, per batch shape), and agents admitted then would miss promises
    that the measured steady-state speed makes. Returns the steps of its last round, run on
    the warmed engine (the prior's check, server/runtime/prior_check.py)."""
    ids = engine.tokenize("Justitia warms up the engine before serving agents: batches of several "
                          "lengths, so that the first agents meet the engine's steady speed.")
    steps = WarmUpSteps()
    if samples is not None:
        samples.add_sample_listener(steps.observe)

    async def run(request: EngineRequest) -> None:
        async for _ in engine.generate(request):
            pass

    for round_ in range(WARM_UP_ROUNDS):
        steps.next_round()
        async with anyio.create_task_group() as group:
            for request in warm_up_requests(engine.info, ids, round_):
                group.start_soon(run, request)
    return steps.close()


# Exit status of a server whose engine could not be restarted (a supervisor restarts it).
EXIT_ENGINE_FAILED = 69  # EX_UNAVAILABLE (sysexits.h); uvicorn uses 3 for a failed start
# How long the graceful shutdown after an engine failure may take before the process ends
# anyway: open connections or a stuck engine must not keep a useless server up.
FORCED_EXIT_AFTER_S = 30.0


def _exit_when_engine_fails(app: FastAPI, engine: Supervised | None) -> None:
    """Once the engine is dead for good, shut the server down with a non-zero status, so
    that a supervisor (systemd, Kubernetes, Docker) restarts the whole process instead of
    a server answering 503 forever."""

    def on_state(state: str, detail: str) -> None:
        if state != "failed":
            return
        log.critical("the engine cannot be restarted (%s): the server exits with status %d",
                     detail, EXIT_ENGINE_FAILED)
        app.state.exit_code = EXIT_ENGINE_FAILED
        app.state.shutdown.begin("the engine cannot be restarted")  # event streams end
        uvicorn_server = getattr(app.state, "uvicorn_server", None)
        if uvicorn_server is not None:
            # A graceful stop; `justitia serve` then returns the exit code.
            uvicorn_server.should_exit = True
        else:  # run by another ASGI server: stop it the way a supervisor would
            signal.raise_signal(signal.SIGTERM)
        timer = threading.Timer(FORCED_EXIT_AFTER_S, os._exit, (EXIT_ENGINE_FAILED,))
        timer.daemon = True
        timer.start()

    if engine is not None:  # an engine nobody restarts has no state to follow
        engine.add_state_listener(on_state)


def _data_dir(config: ServerConfig) -> Path:
    from server.engine.tiny_model import justitia_home

    return Path(config.data_dir).expanduser() if config.data_dir else justitia_home() / "data"


def _time_model_prior(config: ServerConfig) -> dict[str, Any]:
    """LiveConfig's prior of the engine's time model: the profile's coefficients when the
    server was given one (measured on this engine), else LiveConfig's default."""
    if config.profile is None:
        return {}
    from dataclasses import replace

    from server.shared.profiles import load_profile

    profile = load_profile(config.profile)
    prior = replace(profile.time_model(), source=f"prior: {profile.name} profile")
    return {"time_model_prior": prior, "prior_measured": True}


async def _tool_parser(config: ServerConfig, engine: Engine) -> ToolCallParser | None:
    """vLLM's tool-call parser named by --tool-call-parser, loaded off the event loop
    (importing vLLM's parsers takes seconds)."""
    if config.tool_call_parser is None:
        return None
    tokenizer = getattr(engine, "tokenizer", None)
    return await anyio.to_thread.run_sync(ToolCallParser, config.tool_call_parser, tokenizer)


def _predictors(config: ServerConfig):
    from predictors import PredictorRegistry
    from predictors.online import OnlineTrainer
    from server.engine.processes import run_when_engine_idle

    # Retraining waits for CPU time nothing else wants (server/engine/processes.py).
    online = (OnlineTrainer(config.retrain_every, worker_setup=run_when_engine_idle)
              if config.retrain_every > 0 else None)
    return PredictorRegistry(config.predictors_dir, online=online)


def request_limits(config: ServerConfig) -> RequestLimits:
    return RequestLimits(
        max_stop=config.max_stop, max_stop_chars=config.max_stop_chars,
        max_messages=config.max_messages, max_schema_bytes=config.max_schema_bytes,
        max_schema_enum=config.max_schema_enum, max_schema_properties=config.max_schema_properties,
        max_schema_depth=config.max_schema_depth, max_pattern_repeat=config.max_pattern_repeat,
        grammar_timeout_s=config.grammar_timeout_s)


def create_app(config: ServerConfig, engine: Engine | None = None, model_name: str = "") -> FastAPI:
    """The server. With no `engine`, the lifespan builds and starts the one `config` names."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal engine, model_name
        # The history first: a data dir that cannot be written stops the start here, with
        # one clear error, before an engine is started for nothing.
        check_writable(_data_dir(config))
        history = History(_data_dir(config) / "history.sqlite3",
                          retention_s=config.history_retention_s or None,
                          max_rows=config.history_max_rows or None,
                          max_bytes=config.history_max_bytes or None)
        shutdown: Shutdown = app.state.shutdown
        shutdown.bind(asyncio.get_running_loop())
        health = None
        if config.health_port is not None:
            from server.api.health import HealthListener

            # Before the engine starts: an orchestrator sees "starting" from the first second.
            health = HealthListener(app, config.host, config.health_port).start()
        if engine is None:
            engine, model_name = build_engine(config)
        expect_shutdown = getattr(engine, "expect_shutdown", None)
        if expect_shutdown is not None:
            # An engine that dies during the shutdown stopped with the server: no restart.
            shutdown.on_begin(expect_shutdown)
        capabilities = Capabilities.of(engine)  # what the engine offers, found once
        _exit_when_engine_fails(app, capabilities.supervision)
        await engine.start()
        if not model_name:
            model_name = engine.info.served_name or engine.info.model
        warm_up_steps = await _warm_up(engine, capabilities.step_samples)
        metrics = Metrics()
        predictors = _predictors(config)
        scheduler = LiveScheduler(
            engine,
            LiveConfig(
                policy=config.policy,
                retain=config.retain,
                las_half_life_s=config.las_half_life_s,
                las_head_wait_weight=config.las_head_wait_weight,
                session_idle_s=config.session_idle_s,
                initial_tau_s=config.initial_tau_s,
                **_time_model_prior(config),
                warm_up_steps=warm_up_steps,
                prior_tolerance=config.prior_tolerance,
                lease_s=config.agent_lease_s,
                retention_s=config.agent_retention_s,
                max_num_seqs=config.max_num_seqs,
                quotas=Quotas(PerTenant(config.max_agents, config.tenant_max_agents),
                              PerTenant(config.max_queued, config.tenant_max_queued),
                              PerTenant(config.max_agent_bytes, config.tenant_max_agent_bytes),
                              PerTenant(config.max_metadata_bytes, config.tenant_max_metadata_bytes)),
                tenant_weights=dict(config.tenant_weights),
            ),
            predictors=predictors,
            history=history,
            metrics=metrics,
            capabilities=capabilities,
        )
        metrics.bind(scheduler)
        dashboard = DashboardHub(scheduler)
        scheduler.listeners.add(dashboard)  # it learns of agents as they come and go
        await scheduler.start()
        await dashboard.start()
        app.state.dashboard = dashboard
        app.state.dashboard_streams = DashboardStreams(dashboard, config.max_dashboard_streams)
        app.state.history = history
        app.state.metrics = metrics
        app.state.scheduler = scheduler
        app.state.service = InferenceService(engine, model_name, scheduler)
        app.state.tool_parser = await _tool_parser(config, engine)
        grammars: GrammarChecker = app.state.grammars
        warming = asyncio.create_task(grammars.start() if config.grammar_warm_up
                                      else asyncio.sleep(0), name="justitia-grammar-warm-up")
        # Ready once the grammar worker has loaded its compiler (torch, xgrammar: seconds of
        # CPU): on a CPU build that import, beside the engine, made the first agents served
        # twice as slow (one agent of 13 requests: 3.7 s as a fresh server's first, 2.0 s
        # later on). Bounded: a worker slow to start does not keep the server from serving.
        await asyncio.wait({warming}, timeout=GRAMMAR_WARM_UP_WAIT_S)
        app.state.grammar_warm_up = warming
        # Once the shutdown's drain time is over, what still waits for admission fails.
        shutdown.on_drain_over(lambda: scheduler.admission.fail_waiting(EngineError(SHUTTING_DOWN)))
        app.state.ready = True
        log.info("engine ready: %s; capabilities %s; policy %s", engine.info,
                 ", ".join(sorted(capabilities.names)) or "none", config.policy)
        try:
            yield
        finally:
            app.state.ready = False
            warming.cancel()
            await grammars.close()
            await app.state.dashboard_streams.close()
            await dashboard.close()
            await shutdown.bounded(scheduler.close(), "saving the scheduler's state")
            await shutdown.bounded(engine.close(), "stopping the engine", reserve_s=0.5)
            history.close()
            predictors.close()
            if health is not None:
                health.close()

    app = FastAPI(
        title="Justitia",
        version="0.1.0",
        description="Fair and fast scheduling of task-parallel LLM agents on vLLM.",
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.tool_parser = None
    app.state.ready = False
    app.state.exit_code = 0
    app.state.shutdown = Shutdown(config.shutdown_grace_s)
    app.state.rate_limiter = RateLimiter(PerTenant(config.rate_limit, config.tenant_rate_limits))
    app.state.request_size_limits = PerTenant(config.max_request_tokens,
                                              config.tenant_max_request_tokens)
    app.state.limits = request_limits(config)
    app.state.grammars = GrammarChecker(config.grammar_timeout_s)
    errors.install(app)
    errors.document_errors_as_sent(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    # Outside the size limit: the rate is counted (and a caller over it refused) before
    # anything of the body is read, a refused oversized body included.
    app.add_middleware(RateLimitFirst)
    app.include_router(openai_router)
    app.include_router(agents_router)
    # Served without FastAPI's body handling: large bodies are parsed off the event loop.
    serve_directly(app, DIRECT_OPENAI_ROUTES | DIRECT_AGENT_ROUTES)
    app.include_router(dashboard_router)

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics(request: Request) -> Response:
        m = getattr(request.app.state, "metrics", None)
        body = m.render() if m is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    unavailable = errors.responses(503)

    @app.get("/healthz", tags=["operations"], responses=unavailable)
    async def healthz(request: Request) -> JSONResponse:
        """Liveness: 200 while the engine runs or is being restarted (the server heals
        itself; restarting the process would not help), 503 once it will not run again."""
        code, body = liveness(request.app)
        return JSONResponse(body, code)

    @app.get("/readyz", tags=["operations"], responses=unavailable)
    async def readyz(request: Request) -> JSONResponse:
        """Readiness: 200 only while the engine runs and the server takes work; otherwise
        503 with its state and why (`stopping` once a shutdown has begun)."""
        code, body = readiness(request.app)
        return JSONResponse(body, code)

    return app
