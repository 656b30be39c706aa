"""`justitia serve`'s options read and checked before anything starts: API keys, per-tenant
limits and weights, the bind address, the files and names it is given (model, predictors,
profile, tool-call parser), the data directory and the Ray options. A bad one is a
`CommandError` (one line, exit status 2), not an engine's traceback minutes later."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from pathlib import Path
from typing import Any

from justitia_cli import CommandError
from server.scheduler import LIVE_ONLY


def checked_options(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, Any]]:
    """Every `serve` option checked before anything starts (one line and exit status 2
    for a bad one): the API keys (key -> tenant) and the limits as ServerConfig fields."""
    keys = parse_api_keys(args.api_key)
    limits = parse_limits(args, set(keys.values()))
    if len(args.engine_url) > 1:
        raise CommandError("one --engine-url: several engine replicas run on Ray Serve "
                           "(--ray ADDRESS|local --replicas N, see docs/deployment.md)")
    if args.engine_url and (args.model or args.kv_tokens):
        raise CommandError("--engine-url serves the replicas' model and KV capacity: "
                           "drop --model and --kv-tokens (set them on the replicas)")
    check_ray(args)
    if not keys and not is_loopback(args.host):
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
    check_files(args)
    return keys, limits


def parse_api_keys(items: list[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for item in items:
        tenant, sep, key = item.partition("=")
        if not sep or not tenant or not key:
            raise CommandError(f"--api-key takes TENANT=KEY, got {item!r}")
        if key in keys:
            raise CommandError(f"the same key is given to tenants {keys[key]!r} and {tenant!r}")
        keys[key] = tenant
    return keys


def parse_limits(args: argparse.Namespace, tenants: set[str]) -> dict[str, Any]:
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
            "tenant_weights": parse_tenant_weights(args.tenant_weight, known),
            "max_agent_bytes": parsed["--max-agent-bytes"].default,
            "tenant_max_agent_bytes": parsed["--max-agent-bytes"].overrides,
            "max_metadata_bytes": parsed["--max-metadata-bytes"].default,
            "tenant_max_metadata_bytes": parsed["--max-metadata-bytes"].overrides}


def parse_tenant_weights(items: list[str], known: set[str]) -> dict[str, float]:
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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_predictors(path: str) -> None:
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


def check_files(args: argparse.Namespace) -> None:
    """What serve names on disk or by name (model, predictors, profile, tool-call parser),
    checked before the engine starts: one line each, not an engine's traceback."""
    if args.model is not None:
        from server.engine.model_check import ModelNotFound, check_model

        try:
            check_model(args.model)
        except ModelNotFound as exc:
            raise CommandError(str(exc)) from None
    if args.predictors is not None:
        check_predictors(args.predictors)
    if args.profile is not None:
        from server.shared.profiles import load_profile

        try:
            load_profile(args.profile)
        except ValueError as exc:
            raise CommandError(f"--profile: {exc}") from None
    if args.tool_call_parser is not None:
        check_tool_call_parser(args.tool_call_parser)


def check_data_dir(data_dir: str | None) -> None:
    """Before anything starts (the engine would start only to be stopped): the history's
    directory can be written, else one line and exit status 2."""
    from server.engine.tiny_model import justitia_home
    from server.runtime.data_dir import HistoryUnwritable, check_writable

    try:
        check_writable(Path(data_dir).expanduser() if data_dir else justitia_home() / "data")
    except HistoryUnwritable as exc:
        raise CommandError(f"{exc.reason}: the server keeps its history there; give it a "
                           "writable --data-dir") from None


def check_ray(args: argparse.Namespace) -> None:
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


def check_tool_call_parser(name: str) -> None:
    from vllm.tool_parsers import ToolParserManager

    known = ToolParserManager.list_registered()
    if name not in known:
        raise CommandError(f"--tool-call-parser: unknown parser {name!r}; vLLM has {', '.join(sorted(known))}")


def history_bytes(text: str) -> int:
    from server.runtime.limits import parse_bytes

    if text.strip() == "0":
        return 0
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise CommandError(f"--history-max-bytes: {exc}") from None
