"""`justitia serve` and `justitia model ...`. Heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from pathlib import Path
from typing import Any

from justitia_cli import CommandError, Commands, formatter
from server.scheduler import LIVE_ONLY, POLICY_NAMES

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
    serve.add_argument("--policy", default="justitia", choices=POLICY_NAMES + LIVE_ONLY,
                       help="scheduling policy (ray: with --ray only, no Justitia scheduling: "
                            "every request goes to Ray Serve's own routing at once)")
    serve.add_argument("--retain", choices=("auto", "always", "never"), default="auto",
                       help="keep a paused agent's context in the engine's KV cache: auto (while "
                            "the expected rest of its pause costs less than prefilling it again), "
                            "always, never (default auto; Justitia's policies only, justitia-noretain: "
                            "never; docs/retention.md)")
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
                            "4096 per tenant; a bare 'off' lifts it for every tenant)")
    serve.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                       help="the tenant's weight in the fair share among tenants: the engine is "
                            "shared among tenants in proportion to their weights, then among each "
                            "tenant's agents (repeatable; default 1 for every tenant)")
    serve.add_argument("--max-agent-bytes", action="append", default=[], metavar="[TENANT=]SIZE",
                       help="per-tenant quota of memory held by live agents: the bytes of their "
                            "kept prompts (up to 64 Ki characters each) and metadata JSON "
                            "(--max-metadata-bytes each), as held in memory; registrations over "
                            "it get 429 with Retry-After (413: one agent over the whole quota). "
                            "SIZE: bytes, or with "
                            "K/M/G (e.g. 64M); same syntax as --max-agents (default: no quota)")
    serve.add_argument("--max-metadata-bytes", action="append", default=["64K"], metavar="[TENANT=]SIZE",
                       help="the most metadata (as compact JSON) one agent may carry; a larger "
                            "registration gets 413 naming this limit. Same syntax as "
                            "--max-agent-bytes (default 64K; TENANT=off lifts it for one tenant, "
                            "leaving the body size limit)")
    # What one request may ask of the server (docs/reliability.md, Request limits)
    serve.add_argument("--max-stop", type=_positive_int, default=16, metavar="N",
                       help="most stop sequences in one request; more: 400 (default: 16)")
    serve.add_argument("--max-stop-chars", type=_positive_int, default=256, metavar="N",
                       help="most characters in one stop sequence; longer: 400 (default: 256)")
    serve.add_argument("--max-messages", type=_positive_int, default=2048, metavar="N",
                       help="most messages in one chat request; more: 400 (default: 2048)")
    serve.add_argument("--max-schema-bytes", type=_schema_bytes, default=64 * 1024, metavar="SIZE",
                       help="largest JSON schema (response_format), as JSON; larger: 400. SIZE: "
                            "bytes, or with K/M (default: 64K)")
    serve.add_argument("--grammar-timeout", type=float, default=2.0, metavar="SECONDS",
                       help="time budget to compile a JSON schema's grammar, in a worker process "
                            "before the engine sees it; over it: 400 (default: 2)")
    serve.add_argument("--max-dashboard-streams", type=_positive_int, default=8, metavar="N",
                       help="open dashboard streams per tenant; more: 429 (default: 8)")
    serve.add_argument("--engine-url", action="append", default=[], metavar="URL",
                       help="use a remote vLLM OpenAI server as the engine (M is its KV capacity) "
                            "instead of the in-process one; start it with --scheduling-policy "
                            "priority. Several engine replicas: --ray")
    serve.add_argument("--tokenizer", default=None, metavar="PATH_OR_ID",
                       help="tokenizer for --engine-url or --ray (default: the replicas' model)")
    serve.add_argument("--ray", default=None, metavar="ADDRESS|local",
                       help="run the engine replicas as Ray Serve deployments on the Ray cluster at "
                            "ADDRESS (the head's HOST:PORT that `ray start --head` prints, "
                            "ray://HOST:10001, or auto), or on a cluster this server starts on "
                            "this machine (local); --kv-tokens is then M, split evenly over the "
                            "replicas (see docs/deployment.md)")
    serve.add_argument("--replicas", type=_positive_int, default=1, metavar="N",
                       help="--ray: engine replicas to start (default 1)")
    serve.add_argument("--min-replicas", type=_positive_int, default=None, metavar="A",
                       help="--ray: fewest replicas Ray Serve's autoscaling may keep (with --max-replicas); "
                            "it scales on the scheduler's KV demand over one replica's capacity")
    serve.add_argument("--max-replicas", type=_positive_int, default=None, metavar="B",
                       help="--ray: most replicas Ray Serve's autoscaling may start (with --min-replicas)")
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
    serve.add_argument("--history-max-rows", type=int, default=1_000_000, metavar="N",
                       help="the most agents the history keeps; past it the oldest are deleted "
                            "(0: no bound)")
    serve.add_argument("--history-max-bytes", default="1G", metavar="SIZE",
                       help="the most bytes of agents (prompts, metadata, request logs) the "
                            "history keeps; past it the oldest are deleted. SIZE: bytes, or with "
                            "K/M/G (0: no bound)")
    serve.add_argument("--session-idle-s", type=float, default=60.0, metavar="SECONDS",
                       help="an implicit session agent (OpenAI requests with a session header and "
                            "no agent tag) with no request in flight for this long is finished")
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help='one of vLLM\'s tool-call parsers (hermes, llama3_json, mistral, ...) for '
                            'the model\'s own tool-call format: enables tool_choice "auto" (the default '
                            'when a request lists tools). Without it "required" and named choices work '
                            '(structured output) and "auto" is refused with a 400')
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
    from server.api.auth import DEFAULT_TENANT
    from server.api.config import DEFAULT_MAX_QUEUED
    from server.runtime.limits import Rate, parse_bytes, parse_count, parse_per_tenant, parse_tokens

    known = tenants or {DEFAULT_TENANT}
    parsed = {}
    for option, items, parse in (("--rate-limit", args.rate_limit, Rate.parse),
                                 ("--max-request-tokens", args.max_request_tokens, parse_tokens),
                                 ("--max-agents", args.max_agents, parse_count),
                                 ("--max-queued", [i for i in args.max_queued if i != "off"], parse_count),
                                 ("--max-agent-bytes", args.max_agent_bytes, parse_bytes),
                                 ("--max-metadata-bytes", args.max_metadata_bytes, parse_bytes)):
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
    # a safe default: a tenant cannot queue without bound unless the operator says so
    max_queued = queued.default if queued.default is not None or "off" in args.max_queued else DEFAULT_MAX_QUEUED
    return {"rate_limit": rate.default, "tenant_rate_limits": rate.overrides,
            "max_request_tokens": size.default, "tenant_max_request_tokens": size.overrides,
            "max_agents": agents.default, "tenant_max_agents": agents.overrides,
            "max_queued": max_queued, "tenant_max_queued": queued.overrides,
            "tenant_weights": _parse_tenant_weights(args.tenant_weight, known),
            "max_agent_bytes": parsed["--max-agent-bytes"].default,
            "tenant_max_agent_bytes": parsed["--max-agent-bytes"].overrides,
            "max_metadata_bytes": parsed["--max-metadata-bytes"].default,
            "tenant_max_metadata_bytes": parsed["--max-metadata-bytes"].overrides}


def _parse_tenant_weights(items: list[str], known: set[str]) -> dict[str, float]:
    """--tenant-weight TENANT=W: a positive weight for a tenant an --api-key defines."""
    weights: dict[str, float] = {}
    for item in items:
        tenant, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not tenant or not 0 < weight < math.inf:
            raise CommandError(f"--tenant-weight takes TENANT=W with W a positive number, got {item!r}")
        if tenant not in known:
            raise CommandError(f"--tenant-weight names tenant {tenant!r} that no --api-key defines "
                               f"(tenants: {', '.join(sorted(known))})")
        weights[tenant] = weight
    return weights


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _schema_bytes(text: str) -> int:
    from server.runtime.limits import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 64:
        raise argparse.ArgumentTypeError(f"must be at least 64 bytes, got {n}")
    return n


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


def _check_files(args: argparse.Namespace) -> None:
    """What serve names on disk or by name (model, predictors, profile, tool-call parser),
    checked before the engine starts: one line each, not an engine's traceback."""
    if args.model is not None:
        from server.engine.model_check import ModelNotFound, check_model

        try:
            check_model(args.model)
        except ModelNotFound as exc:
            raise CommandError(str(exc)) from None
    if args.predictors is not None:
        _check_predictors(args.predictors)
    if args.profile is not None:
        from server.shared.profiles import load_profile

        try:
            load_profile(args.profile)
        except ValueError as exc:
            raise CommandError(f"--profile: {exc}") from None
    if args.tool_call_parser is not None:
        _check_tool_call_parser(args.tool_call_parser)


def _check_data_dir(data_dir: str | None) -> None:
    """Before anything starts (the engine would start only to be stopped): the history's
    directory can be written, else one line and exit status 2."""
    from server.engine.tiny_model import justitia_home
    from server.runtime.data_dir import HistoryUnwritable, check_writable

    try:
        check_writable(Path(data_dir).expanduser() if data_dir else justitia_home() / "data")
    except HistoryUnwritable as exc:
        raise CommandError(f"{exc.reason}: the server keeps its history there; give it a "
                           "writable --data-dir") from None


def run_serve(args: argparse.Namespace) -> int:
    from server.api.config import ServerConfig

    keys = _parse_api_keys(args.api_key)
    limits = _parse_limits(args, set(keys.values()))
    if len(args.engine_url) > 1:
        raise CommandError("one --engine-url: several engine replicas run on Ray Serve "
                           "(--ray ADDRESS|local --replicas N, see docs/deployment.md)")
    if args.engine_url and (args.model or args.kv_tokens):
        raise CommandError("--engine-url serves the replicas' model and KV capacity: "
                           "drop --model and --kv-tokens (set them on the replicas)")
    _check_ray(args)
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
    if args.history_max_rows < 0:
        raise CommandError("--history-max-rows takes a count of agents >= 0 (0: no bound)")
    if not 0 < args.grammar_timeout < float("inf"):
        raise CommandError(f"--grammar-timeout must be a positive number of seconds, not {args.grammar_timeout}")
    if args.retrain_every < 0:
        raise CommandError("--retrain-every takes a count of agents >= 0 (0 turns online learning off)")
    _check_files(args)
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
        history_max_bytes=_history_bytes(args.history_max_bytes),
        log_level=args.log_level,
        profile=args.profile,
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
        max_messages=args.max_messages,
        max_schema_bytes=args.max_schema_bytes,
        grammar_timeout_s=args.grammar_timeout,
        max_dashboard_streams=args.max_dashboard_streams,
        **limits,
    )
    return serve(config)


def _check_ray(args: argparse.Namespace) -> None:
    """--ray and its options agree, and the cluster answers (a clear error, not a hang)."""
    if args.ray is None:
        if args.policy in LIVE_ONLY:
            raise CommandError(f"--policy {args.policy} is Ray Serve's own routing: it needs --ray")
        ray_only = [o for o, v in (("--replicas", args.replicas != 1), ("--min-replicas", args.min_replicas),
                                   ("--max-replicas", args.max_replicas)) if v]
        if ray_only:
            raise CommandError(f"{', '.join(ray_only)} set the engine replicas on Ray: add --ray ADDRESS|local")
        return
    if args.engine_url:
        raise CommandError("--ray deploys its own engine replicas: drop --engine-url")
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise CommandError("--min-replicas and --max-replicas go together (the autoscaling range)")
    if args.min_replicas is not None and not args.min_replicas <= args.replicas <= args.max_replicas:
        raise CommandError(f"--replicas {args.replicas} must lie in --min-replicas {args.min_replicas} .. "
                           f"--max-replicas {args.max_replicas}")
    if args.kv_tokens is not None and args.kv_tokens // args.replicas < args.max_model_len:
        raise CommandError(f"--kv-tokens {args.kv_tokens} over {args.replicas} replicas leaves each "
                           f"{args.kv_tokens // args.replicas} tokens, below --max-model-len {args.max_model_len}: "
                           "every replica needs room for one full-length request")
    from server.engine.ray_serve import RayUnreachable, connect

    try:
        # Connected here, before the server starts: an unreachable cluster is this one
        # error and exit status 2, not a failed application start-up.
        if args.ray != "local":
            connect(args.ray)
    except RayUnreachable as exc:
        raise CommandError(str(exc)) from None


def _check_tool_call_parser(name: str) -> None:
    from vllm.tool_parsers import ToolParserManager

    known = ToolParserManager.list_registered()
    if name not in known:
        raise CommandError(f"--tool-call-parser: unknown parser {name!r}; vLLM has {', '.join(sorted(known))}")


def _history_bytes(text: str) -> int:
    from server.runtime.limits import parse_bytes

    if text.strip() == "0":
        return 0
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise CommandError(f"--history-max-bytes: {exc}") from None


def serve(config: Any, engine: Any = None) -> int:
    """Run the server until it stops; its exit status (non-zero: the engine failed).
    `engine`: an Engine to serve instead of the one `config` names (the test suite's fake)."""
    import math

    from server.api.app import create_app
    from server.api.http import concurrency_limit, graceful_server, raise_open_files_limit, uvicorn_config

    _check_data_dir(config.data_dir)

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


def run_init_tiny(args: argparse.Namespace) -> int:
    from server.engine.tiny_model import init_tiny

    try:
        path = init_tiny(args.dir, overwrite=args.force)
    except FileExistsError as exc:
        raise CommandError(f"{exc} (or pass --force)") from None
    print(f"tiny model written to {path}")
    return 0
