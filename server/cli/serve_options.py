"""The parser of `justitia serve`: every option, its default and its help. Reading and
checking them is `serve_checks`; running the server is `serving`."""

from __future__ import annotations

import argparse

from justitia_cli import Commands
from justitia_cli.options import add_command, kv_tokens_option, max_model_len_option, positive_int
from server.cli.serving import run_serve
from server.runtime.prior_check import TOLERANCE
from server.scheduler import LIVE_ONLY, POLICY_NAMES


def register(commands: Commands) -> None:
    serve = add_command(
        commands.root,
        "serve",
        help="Run the Justitia server in front of an in-process vLLM engine.",
        description=(
            "Run the Justitia server: the agent API, an OpenAI-compatible API and the "
            "scheduler, in front of an in-process vLLM engine (the CPU build on machines "
            "without a GPU). With no --model it serves the embedded tiny model, created "
            "on first use."
        ),
        handler=run_serve,
    )
    serve.add_argument("--model", default=None, metavar="PATH_OR_ID",
                       help="model folder or id to serve (default: the embedded tiny model)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients use in the `model` field (default: from --model)")
    kv_tokens_option(serve, "KV cache capacity M in tokens (CPU: sets vLLM's "
                            "num_gpu_blocks_override; default: what vLLM sizes)", metavar="N")
    max_model_len_option(serve, "longest prompt + output in tokens")
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
    serve.add_argument("--max-stop", type=positive_int, default=16, metavar="N",
                       help="most stop sequences in one request; more: 400 (default: 16)")
    serve.add_argument("--max-stop-chars", type=positive_int, default=256, metavar="N",
                       help="most characters in one stop sequence; longer: 400 (default: 256)")
    serve.add_argument("--max-messages", type=positive_int, default=2048, metavar="N",
                       help="most messages in one chat request; more: 400 (default: 2048)")
    serve.add_argument("--max-schema-bytes", type=_schema_bytes, default=64 * 1024, metavar="SIZE",
                       help="largest JSON schema (response_format), as JSON; larger: 400. SIZE: "
                            "bytes, or with K/M (default: 64K)")
    serve.add_argument("--grammar-timeout", type=float, default=2.0, metavar="SECONDS",
                       help="time budget to compile a JSON schema's grammar, in a worker process "
                            "before the engine sees it; over it: 400 (default: 2)")
    serve.add_argument("--max-dashboard-streams", type=positive_int, default=8, metavar="N",
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
    serve.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                       help="--ray: engine replicas to start (default 1)")
    serve.add_argument("--min-replicas", type=positive_int, default=None, metavar="A",
                       help="--ray: fewest replicas Ray Serve's autoscaling may keep (with --max-replicas); "
                            "it scales on the scheduler's KV demand over one replica's capacity")
    serve.add_argument("--max-replicas", type=positive_int, default=None, metavar="B",
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
    serve.add_argument("--prior-tolerance", type=_factor, default=TOLERANCE, metavar="X",
                       help="a measured prior (--profile, or the last run's fit in the history) is "
                            "checked against the engine's warm-up before any agent registers: when "
                            "the warm-up's steps took more than X times what it predicts, or less than "
                            "1/X, it is scaled to them (a profile of another host). Default %(default)s; a "
                            "huge X trusts the prior as it is")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="server log level")


def _schema_bytes(text: str) -> int:
    from server.runtime.limits import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n < 64:
        raise argparse.ArgumentTypeError(f"must be at least 64 bytes, got {n}")
    return n


def _factor(text: str) -> float:
    """An argparse type: a factor >= 1."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x >= 1.0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return x
