"""`justitia serve` run: the checked options as a `ServerConfig`, and the server process
itself (uvicorn with a graceful shutdown, the app's exit status)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from server.cli.serve_checks import check_data_dir, checked_options, history_bytes

TINY_NOTICE = (
    "Serving the embedded tiny model ({path}). Its weights are random, so the text it "
    "generates is noise; the engine around it (batching, KV cache, preemption, timing) is "
    "real vLLM. To serve a real model: justitia serve --model PATH_OR_ID"
)


def run_serve(args: argparse.Namespace) -> int:
    """`justitia serve`: the options checked, then the server run until it stops."""
    from server.api.config import ServerConfig

    keys, limits = checked_options(args)
    config = ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        kv_tokens=args.kv_tokens,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        engine_nice=args.engine_nice,
        engine_restarts=args.engine_restarts,
        policy=args.policy,
        retain=args.retain,
        las_half_life_s=args.las_half_life_s,
        las_head_wait_weight=args.las_head_wait_weight,
        session_idle_s=args.session_idle_s,
        tool_call_parser=args.tool_call_parser,
        host=args.host,
        port=args.port,
        health_port=args.health_port,
        shutdown_grace_s=args.shutdown_grace_s,
        api_keys=keys,
        engine_urls=args.engine_url,
        tokenizer=args.tokenizer,
        ray_address=args.ray,
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        predictors_dir=args.predictors,
        retrain_every=args.retrain_every,
        data_dir=args.data_dir,
        agent_lease_s=args.agent_lease,
        agent_retention_s=args.agent_retention,
        history_retention_s=args.history_retention,
        history_max_rows=args.history_max_rows,
        history_max_bytes=history_bytes(args.history_max_bytes),
        log_level=args.log_level,
        profile=args.profile,
        prior_tolerance=args.prior_tolerance,
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
        max_messages=args.max_messages,
        max_schema_bytes=args.max_schema_bytes,
        grammar_timeout_s=args.grammar_timeout,
        max_dashboard_streams=args.max_dashboard_streams,
        **limits,
    )
    return serve(config)


def serve(config: Any, engine: Any = None) -> int:
    """Run the server until it stops; its exit status (non-zero: the engine failed).
    `engine`: an Engine to serve instead of the one `config` names (the test suite's fake)."""
    import math

    from server.api.app import create_app
    from server.api.http import concurrency_limit, graceful_server, raise_open_files_limit, uvicorn_config

    check_data_dir(config.data_dir)

    if engine is None and config.model is None and not config.engine_urls and not config.ray_address:
        from server.engine.tiny_model import ensure_default_model

        path = ensure_default_model()
        print(TINY_NOTICE.format(path=path), file=sys.stderr, flush=True)
    # The model's name is read once the engine has started (the lifespan does it).
    app = create_app(config, engine=engine)
    open_files = raise_open_files_limit()
    shutdown = app.state.shutdown
    shutdown.hard_exit = True  # this process is the server's own: the watchdog may end it
    shutdown.exit_code = lambda: int(app.state.exit_code)
    server = graceful_server(uvicorn_config(
        app, config.host, config.port, log_level=config.log_level,
        limit_concurrency=concurrency_limit(open_files),
        # uvicorn cancels what still runs a moment after the drain time, when the requests
        # in flight have been told (server/runtime/shutdown.py)
        timeout_graceful_shutdown=math.ceil(shutdown.drain_s + 0.5)), shutdown)
    # The app stops this server itself when its engine cannot be restarted (server/api/app.py).
    app.state.uvicorn_server = server
    server.run()
    if not server.started:
        return 3  # what uvicorn.run exits with when the start failed (the engine's, say)
    return int(app.state.exit_code)
