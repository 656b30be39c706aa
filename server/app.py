"""The FastAPI application: wiring only. Each concern lives in its own module."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server import errors
from server.config import ServerConfig
from server.engine.base import Engine
from server.agents_api import router as agents_router
from server.history import History
from server.limits import PerTenant, RateLimiter
from server.live import LiveConfig, LiveScheduler
from server.metrics import CONTENT_TYPE, Metrics
from server.openai_api import install_fast_paths
from server.openai_api import router as openai_router
from server.service import InferenceService

log = logging.getLogger("justitia.server")


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
                scope["path"], 413, f"the body has {int(length)} bytes; the limit is {self.max_bytes}")
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            response = errors.error_response(
                scope["path"], 413, f"the body is over the limit of {self.max_bytes} bytes")
            await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def build_engine(config: ServerConfig) -> tuple[Engine, str]:
    """The in-process vLLM engine for this configuration, and the model's served name."""
    from server.engine.vllm_local import LocalEngineConfig, LocalVLLMEngine
    from server.tiny_model import TINY_MODEL_NAME, ensure_default_model

    if config.engine_urls:
        from server.engine.remote import RemoteVLLMEngine

        remote = RemoteVLLMEngine(config.engine_urls, tokenizer=config.tokenizer)
        return remote, config.served_model_name or ""

    if config.model is None:
        path = ensure_default_model()
        engine_cfg = LocalEngineConfig(
            model=str(path),
            kv_tokens=config.kv_tokens,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            engine_core_nice=config.engine_nice,
            dummy_weights=True,
            # bfloat16 on CPUs with AMX dies with SIGILL on batches of one or two tokens
            # (vLLM CPU 0.32, measured here); the tiny model loses nothing in float32.
            dtype="float32",
        )
        return LocalVLLMEngine(engine_cfg), config.served_model_name or TINY_MODEL_NAME
    engine_cfg = LocalEngineConfig(
        model=config.model,
        kv_tokens=config.kv_tokens,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        engine_core_nice=config.engine_nice,
    )
    name = config.served_model_name or Path(config.model).name or config.model
    return LocalVLLMEngine(engine_cfg), name


async def _warm_up(engine: Engine) -> None:
    """One short generation before /readyz turns green: the first steps of a fresh engine
    are slow (lazy initialisation), and agents admitted then would miss promises that the
    measured steady-state speed makes."""
    from server.engine.base import EngineRequest, SamplingOptions

    ids = tuple(engine.tokenize("Justitia warms up the engine before serving agents."))
    request = EngineRequest("justitia-warmup", ids, SamplingOptions(max_tokens=8, ignore_eos=True))
    async for _ in engine.generate(request):
        pass


def _data_dir(config: ServerConfig) -> Path:
    from server.tiny_model import justitia_home

    return Path(config.data_dir).expanduser() if config.data_dir else justitia_home() / "data"


def _predictors(config: ServerConfig):
    from predictors import PredictorRegistry

    return PredictorRegistry(config.predictors_dir)


def create_app(config: ServerConfig, engine: Engine | None = None, model_name: str = "") -> FastAPI:
    """The server. With no `engine`, the lifespan builds and starts the one `config` names."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal engine, model_name
        if engine is None:
            engine, model_name = build_engine(config)
        await engine.start()
        if not model_name:
            model_name = getattr(engine, "_served_name", "") or engine.info.model
        await _warm_up(engine)
        history = History(_data_dir(config) / "history.sqlite3")
        metrics = Metrics()
        scheduler = LiveScheduler(
            engine,
            LiveConfig(
                policy=config.policy,
                initial_tau_s=config.initial_tau_s,
                lease_s=config.agent_lease_s,
                retention_s=config.agent_retention_s,
                max_num_seqs=config.max_num_seqs,
            ),
            predictors=_predictors(config),
            history=history,
            metrics=metrics,
        )
        metrics.bind(scheduler)
        await scheduler.start()
        app.state.history = history
        app.state.metrics = metrics
        app.state.scheduler = scheduler
        app.state.service = InferenceService(engine, model_name, scheduler)
        app.state.ready = True
        log.info("engine ready: %s; policy %s", engine.info, config.policy)
        try:
            yield
        finally:
            app.state.ready = False
            await scheduler.close()
            await engine.close()
            history.close()

    app = FastAPI(
        title="Justitia",
        version="0.1.0",
        description="Fair and fast scheduling of task-parallel LLM agents on vLLM.",
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.ready = False
    app.state.rate_limiter = RateLimiter(PerTenant(config.rate_limit, config.tenant_rate_limits))
    app.state.request_size_limits = PerTenant(config.max_request_tokens,
                                              config.tenant_max_request_tokens)
    errors.install(app)
    errors.document_errors_as_sent(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.include_router(openai_router)
    install_fast_paths(app)
    app.include_router(agents_router)

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics(request: Request) -> Response:
        m = getattr(request.app.state, "metrics", None)
        body = m.render() if m is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    unavailable = errors.responses(503)

    @app.get("/healthz", tags=["operations"], responses=unavailable)
    async def healthz(request: Request) -> JSONResponse:
        service = getattr(request.app.state, "service", None)
        if service is None or not service.engine.healthy:
            return JSONResponse({"status": "unhealthy", "detail": "the engine is not running"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz", tags=["operations"], responses=unavailable)
    async def readyz(request: Request) -> JSONResponse:
        service = getattr(request.app.state, "service", None)
        if not request.app.state.ready or service is None or not service.engine.healthy:
            return JSONResponse({"status": "not ready", "detail": "the engine is starting"}, 503)
        return JSONResponse({"status": "ready", "model": service.model_name})

    return app
