"""`justitia serve` and `justitia model ...`. Heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path
from typing import Any

from justitia_cli import CommandError, Commands, formatter
from server.scheduler import POLICY_NAMES

TINY_NOTICE = (
    "Serving the embedded tiny model ({path}). Its weights are random, so the text it "
    "generates is noise; the engine around it (batching, KV cache, preemption, timing) is "
    "real vLLM. To serve a real model: justitia serve --model PATH_OR_ID"
)


def register(commands: Commands) -> None:
    serve = commands.root.add_parser(
        "serve",
        help="Run the Justitia server in front of an in-process vLLM engine.",
        description=(
            "Run the Justitia server: the agent API, an OpenAI-compatible API and the "
            "scheduler, in front of an in-process vLLM engine (the CPU build on machines "
            "without a GPU). With no --model it serves the embedded tiny model, created "
            "on first use."
        ),
        formatter_class=formatter,
    )
    serve.add_argument("--model", default=None, metavar="PATH_OR_ID",
                       help="model folder or id to serve (default: the embedded tiny model)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients use in the `model` field (default: from --model)")
    serve.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                       help="KV cache capacity M in tokens (CPU: sets vLLM's "
                            "num_gpu_blocks_override; default: what vLLM sizes)")
    serve.add_argument("--max-model-len", type=int, default=2048, metavar="N",
                       help="longest prompt + output in tokens")
    serve.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                       help="most requests the engine runs at once")
    serve.add_argument("--engine-nice", type=int, default=10, choices=range(0, 20), metavar="N",
                       help="CPU build only: niceness of vLLM's EngineCore process, which spins "
                            "on the core it shares with the API process (0: as vLLM leaves it; "
                            "see docs/server.md)")
    serve.add_argument("--engine-restarts", type=int, default=3, choices=range(0, 101),
                       metavar="N",
                       help="when the in-process engine dies, restart it up to N times in a "
                            "row (backoff 1, 2, 4 ... 30 s; running requests fail, queued ones "
                            "wait), then exit with status 69 so that a supervisor restarts the "
                            "server; the count starts over after 10 minutes of service (0: "
                            "exit at the first death; see docs/reliability.md)")
    serve.add_argument("--policy", default="justitia", choices=POLICY_NAMES,
                       help="scheduling policy")
    serve.add_argument("--las-half-life-s", type=float, default=60.0, metavar="SECONDS",
                       help="--policy las: half-life of an agent's attained service (default 60 s, "
                            "as llm-d's program-aware fairness plugin)")
    serve.add_argument("--las-head-wait-weight", type=float, default=0.2, metavar="W",
                       help="--policy las: weight of the head request's wait in the score, against 0.8 "
                            "for the attained service (default 0.2, as the plugin; 0: pure least attained "
                            "service, an O(log n) queue instead of a scan of the backlogged agents)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (without --api-key only loopback is allowed)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind")
    serve.add_argument("--health-port", type=int, default=None, metavar="P",
                       help="also answer GET /healthz and GET /readyz on this port (same host), "
                            "on a listener of its own that clients of the main port cannot "
                            "crowd out: point an orchestrator's probes here (default: none)")
    serve.add_argument("--shutdown-grace-s", type=float, default=10.0, metavar="SECONDS",
                       help="the first SIGINT/SIGTERM stops the server within this many seconds: "
                            "event streams end at once, requests in flight run on for all but "
                            "the last 5 s of it (half of it, if shorter) and then fail with 503 "
                            "'the server is shutting down'; a second signal exits at once")
    serve.add_argument("--api-key", action="append", default=[], metavar="TENANT=KEY",
                       help="accept this bearer key for this tenant (repeatable)")
    serve.add_argument("--rate-limit", action="append", default=[], metavar="[TENANT=]RPS[:BURST]",
                       help="per-tenant limit on inference (/v1/completions, "
                            "/v1/chat/completions) and registration (POST /v1/agents) calls: "
                            "RPS requests per second on average, up to BURST at once (default "
                            "BURST: one second's worth, at least 1). A bare value applies to "
                            "every tenant, TENANT=RPS[:BURST] to one, TENANT=off lifts it for "
                            "one (repeatable). Calls over it get 429 with Retry-After "
                            "(default: no limit)")
    serve.add_argument("--max-request-tokens", action="append", default=[],
                       metavar="[TENANT=]N",
                       help="per-tenant cap on one request's prompt tokens + max_tokens; "
                            "larger requests get 400 naming the cap. A bare N applies to every "
                            "tenant, TENANT=N to one, TENANT=off lifts it for one (repeatable; "
                            "default: only --max-model-len bounds a request)")
    serve.add_argument("--max-agents", action="append", default=[], metavar="[TENANT=]N",
                       help="per-tenant quota of live (not yet ended) agents, untagged requests' "
                            "agents included; registrations over it get 429 with Retry-After. "
                            "Bare N: every tenant; TENANT=N, TENANT=off: one (repeatable; "
                            "default: no quota)")
    serve.add_argument("--max-queued", action="append", default=[], metavar="[TENANT=]N",
                       help="per-tenant quota of requests waiting for admission; requests over "
                            "it get 429 with Retry-After (same syntax as --max-agents; default: "
                            "no quota)")
    serve.add_argument("--max-agent-bytes", action="append", default=[], metavar="[TENANT=]SIZE",
                       help="per-tenant quota of memory held by live agents: the bytes of their "
                            "kept prompts (up to 64 KiB each) and metadata (up to 64 KiB each); "
                            "registrations over it get 429 with Retry-After. SIZE: bytes, or with "
                            "K/M/G (e.g. 64M); same syntax as --max-agents (default: no quota)")
    serve.add_argument("--engine-url", action="append", default=[], metavar="URL",
                       help="use a remote vLLM OpenAI server as the engine (repeatable: "
                            "replicas; M is the sum of their KV capacities) instead of the "
                            "in-process one; start replicas with --scheduling-policy priority")
    serve.add_argument("--tokenizer", default=None, metavar="PATH_OR_ID",
                       help="tokenizer for --engine-url (default: the replicas' model)")
    serve.add_argument("--predictors", default=None, metavar="DIR",
                       help="trained cost predictors, one folder per agent type (from "
                            "`justitia train-predictor`), or one such folder; other types use "
                            "the cold start. A missing DIR, or one holding no usable "
                            "predictor, is refused; each one found is printed at startup")
    serve.add_argument("--retrain-every", type=int, default=20, metavar="N",
                       help="online learning: retrain an agent type's predictor (per tenant) in a "
                            "background process after every N new finished agents of it, and "
                            "serve the new model only if it beats the served predictions on the "
                            "newest agents (GET /v1/predictors; 0: off)")
    serve.add_argument("--data-dir", default=None, metavar="DIR",
                       help="where the history of finished agents is kept "
                            "(default: $JUSTITIA_HOME/data, ~/.cache/justitia/data)")
    serve.add_argument("--agent-lease", type=float, default=600.0, metavar="SECONDS",
                       help="an agent with no request in flight for this long (and no finish) expires")
    serve.add_argument("--agent-retention", type=float, default=3600.0, metavar="SECONDS",
                       help="ended agents stay readable through the API this long, then only "
                            "in the history (bounds the server's memory under heavy traffic)")
    serve.add_argument("--history-retention", type=float, default=30 * 86_400, metavar="SECONDS",
                       help="finished agents older than this are deleted from the history "
                            "(checked every 10 minutes; default 30 days; 0 keeps everything)")
    serve.add_argument("--session-idle-s", type=float, default=60.0, metavar="SECONDS",
                       help="an implicit session agent (OpenAI requests with a session header and "
                            "no agent tag) with no request in flight for this long is finished")
    serve.add_argument("--profile", default=None, metavar="NAME|FILE",
                       help="engine profile measured on this engine (`justitia bench calibrate "
                            "--out FILE`, or a built-in name): the server's step-time model "
                            "starts from it, and ETAs divide by the rate it sustains from the "
                            "first request instead of waiting for the online fit (default: the "
                            "cpu-tiny prior, trusted once fitted to 1,024 engine steps)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="server log level")
    serve.set_defaults(handler=run_serve)

    init_tiny = commands.model.add_parser(
        "init-tiny",
        help="Write the embedded tiny model (config + tokenizer, no weights) to DIR.",
        description=(
            "Write a tiny Llama model folder (config.json, tokenizer.json, "
            "tokenizer_config.json) that vLLM runs with random weights and no downloads."
        ),
        formatter_class=formatter,
    )
    init_tiny.add_argument("dir", metavar="DIR", help="folder to create")
    init_tiny.add_argument("--force", action="store_true", help="overwrite DIR's contents")
    init_tiny.set_defaults(handler=run_init_tiny)


def _parse_api_keys(items: list[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for item in items:
        tenant, sep, key = item.partition("=")
        if not sep or not tenant or not key:
            raise CommandError(f"--api-key takes TENANT=KEY, got {item!r}")
        if key in keys:
            raise CommandError(f"the same key is given to tenants {keys[key]!r} and {tenant!r}")
        keys[key] = tenant
    return keys


def _parse_limits(args: argparse.Namespace, tenants: set[str]) -> dict[str, Any]:
    """The limit options as ServerConfig fields; overrides must name a known tenant."""
    from server.auth import DEFAULT_TENANT
    from server.limits import Rate, parse_bytes, parse_count, parse_per_tenant, parse_tokens

    known = tenants or {DEFAULT_TENANT}
    parsed = {}
    for option, items, parse in (("--rate-limit", args.rate_limit, Rate.parse),
                                 ("--max-request-tokens", args.max_request_tokens, parse_tokens),
                                 ("--max-agents", args.max_agents, parse_count),
                                 ("--max-queued", args.max_queued, parse_count),
                                 ("--max-agent-bytes", args.max_agent_bytes, parse_bytes)):
        try:
            parsed[option] = limits = parse_per_tenant(items, parse)
        except ValueError as exc:
            raise CommandError(f"{option}: {exc}") from None
        unknown = sorted(set(limits.overrides) - known)
        if unknown:
            # A typo in a tenant name would silently leave that tenant on the default.
            raise CommandError(f"{option} names tenant(s) {', '.join(map(repr, unknown))} that "
                               f"no --api-key defines (tenants: {', '.join(sorted(known))})")
    rate, size = parsed["--rate-limit"], parsed["--max-request-tokens"]
    agents, queued = parsed["--max-agents"], parsed["--max-queued"]
    return {"rate_limit": rate.default, "tenant_rate_limits": rate.overrides,
            "max_request_tokens": size.default, "tenant_max_request_tokens": size.overrides,
            "max_agents": agents.default, "tenant_max_agents": agents.overrides,
            "max_queued": queued.default, "tenant_max_queued": queued.overrides,
            "max_agent_bytes": parsed["--max-agent-bytes"].default,
            "tenant_max_agent_bytes": parsed["--max-agent-bytes"].overrides}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_predictors(path: str) -> None:
    """Refuse a --predictors DIR that is missing or holds no usable predictor, and print the
    ones found, before the engine starts: a typo would otherwise leave every agent type on
    the cold start without a word."""
    from predictors.registry import describe, scan

    d = Path(path)
    train = f"train one with `justitia train-predictor AGENT --samples FILE --out {path}/AGENT`"
    if not d.exists():
        raise CommandError(f"--predictors {path}: no such directory; give the folder that "
                           f"`justitia train-predictor --out` wrote, or its parent, or {train}")
    if not d.is_dir():
        raise CommandError(f"--predictors {path} is not a directory; give the folder that "
                           "`justitia train-predictor --out` wrote, or its parent")
    if not os.access(d, os.R_OK | os.X_OK):
        raise CommandError(f"--predictors {path} cannot be read (permission denied)")
    found, errors = scan(d)
    if not found:
        why = "; ".join(f"{p}: {e}" for p, e in errors.items()) or "no metadata.json in it or its sub-folders"
        raise CommandError(f"--predictors {path} holds no usable predictor ({why}); {train}")
    # Printed, not logged: nothing routes the server's own loggers to the console.
    for agent_type, (p, meta) in sorted(found.items()):
        print(f"cost predictor for {agent_type!r}: {describe(meta, p)}", file=sys.stderr, flush=True)
    for bad, error in errors.items():
        print(f"skipping predictor {bad}: {error}", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    from server.config import ServerConfig

    keys = _parse_api_keys(args.api_key)
    limits = _parse_limits(args, set(keys.values()))
    if args.engine_url and (args.model or args.kv_tokens):
        raise CommandError("--engine-url serves the replicas' model and KV capacity: "
                           "drop --model and --kv-tokens (set them on the replicas)")
    if not keys and not _is_loopback(args.host):
        raise CommandError(
            f"refusing to bind {args.host} without API keys: anyone could use the engine. "
            "Add --api-key TENANT=KEY, or bind 127.0.0.1"
        )
    for option, value in (("--las-half-life-s", args.las_half_life_s), ("--session-idle-s", args.session_idle_s)):
        if not 0 < value < float("inf"):
            raise CommandError(f"{option} must be a positive number of seconds, not {value}")
    if not 0 < args.shutdown_grace_s < float("inf"):
        raise CommandError(f"--shutdown-grace-s must be a positive number of seconds, not {args.shutdown_grace_s}")
    if args.health_port is not None and (not 0 < args.health_port < 65536 or args.health_port == args.port):
        raise CommandError(f"--health-port must be a port (1-65535) other than --port, not {args.health_port}")
    if not 0 <= args.las_head_wait_weight < float("inf"):
        raise CommandError(f"--las-head-wait-weight must be a number >= 0, not {args.las_head_wait_weight}")
    if args.predictors is not None:
        _check_predictors(args.predictors)
    if args.retrain_every < 0:
        raise CommandError("--retrain-every takes a count of agents >= 0 (0 turns online learning off)")
    if args.profile is not None:
        from server.sim.profiles import load_profile

        try:
            load_profile(args.profile)
        except ValueError as exc:
            raise CommandError(f"--profile: {exc}") from None
    config = ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        kv_tokens=args.kv_tokens,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        engine_nice=args.engine_nice,
        engine_restarts=args.engine_restarts,
        policy=args.policy,
        las_half_life_s=args.las_half_life_s,
        las_head_wait_weight=args.las_head_wait_weight,
        session_idle_s=args.session_idle_s,
        host=args.host,
        port=args.port,
        health_port=args.health_port,
        shutdown_grace_s=args.shutdown_grace_s,
        api_keys=keys,
        engine_urls=args.engine_url,
        tokenizer=args.tokenizer,
        predictors_dir=args.predictors,
        retrain_every=args.retrain_every,
        data_dir=args.data_dir,
        agent_lease_s=args.agent_lease,
        agent_retention_s=args.agent_retention,
        history_retention_s=args.history_retention,
        log_level=args.log_level,
        profile=args.profile,
        **limits,
    )
    return serve(config)


def serve(config: Any, engine: Any = None) -> int:
    """Run the server until it stops; its exit status (non-zero: the engine failed).
    `engine`: an Engine to serve instead of the one `config` names (the test suite's fake)."""
    import math

    from server.app import create_app
    from server.http import concurrency_limit, graceful_server, raise_open_files_limit, uvicorn_config

    if engine is None and config.model is None and not config.engine_urls:
        from server.tiny_model import ensure_default_model

        path = ensure_default_model()
        print(TINY_NOTICE.format(path=path), file=sys.stderr, flush=True)
    app = create_app(config, engine=engine, model_name=engine.info.model if engine is not None else "")
    open_files = raise_open_files_limit()
    shutdown = app.state.shutdown
    shutdown.hard_exit = True  # this process is the server's own: the watchdog may end it
    shutdown.exit_code = lambda: int(app.state.exit_code)
    server = graceful_server(uvicorn_config(
        app, config.host, config.port, log_level=config.log_level,
        limit_concurrency=concurrency_limit(open_files),
        # uvicorn cancels what still runs a moment after the drain time, when the requests
        # in flight have been told (server/shutdown.py)
        timeout_graceful_shutdown=math.ceil(shutdown.drain_s + 0.5)), shutdown)
    # The app stops this server itself when its engine cannot be restarted (server/app.py).
    app.state.uvicorn_server = server
    server.run()
    if not server.started:
        return 3  # what uvicorn.run exits with when the start failed (the engine's, say)
    return int(app.state.exit_code)


def run_init_tiny(args: argparse.Namespace) -> int:
    from server.tiny_model import init_tiny

    try:
        path = init_tiny(args.dir, overwrite=args.force)
    except FileExistsError as exc:
        raise CommandError(f"{exc} (or pass --force)") from None
    print(f"tiny model written to {path}")
    return 0
