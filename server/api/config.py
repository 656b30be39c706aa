"""The server's configuration: one pydantic model, filled from the command line."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from server.runtime.limits import Rate
from server.runtime.prior_check import TOLERANCE

# Requests a tenant may have waiting for admission unless told otherwise (--max-queued).
DEFAULT_MAX_QUEUED = 4096


class ServerConfig(BaseModel):
    model: str | None = Field(
        default=None, description="Model folder or id; None serves the embedded tiny model."
    )
    served_model_name: str | None = None
    kv_tokens: int | None = Field(default=None, ge=1, description="KV cache capacity M in tokens.")
    max_model_len: int = Field(default=2048, ge=64)
    max_num_seqs: int = Field(default=256, ge=1)
    engine_nice: int = Field(default=10, ge=0, le=19,
                             description="CPU build: niceness of vLLM's EngineCore process.")
    engine_restarts: int = Field(
        default=3, ge=0,
        description="In-process engine: restarts of a dead engine in a row before the server "
                    "exits with status 69 (0: exit at the first death).")
    policy: str = "justitia"
    retain: Literal["auto", "always", "never"] = "auto"  # paused agents' contexts (server/runtime/retain.py)
    las_half_life_s: float = Field(default=60.0, gt=0, description="las: half-life of attained service.")
    las_head_wait_weight: float = Field(default=0.2, ge=0, description="las: weight of the head wait.")
    session_idle_s: float = Field(
        default=60.0, gt=0, description="An implicit session agent idle this long is finished.")
    tool_call_parser: str | None = Field(
        default=None, description='vLLM tool-call parser that reads the model\'s own call format '
                                  '(tool_choice "auto"); None refuses "auto".')
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    health_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Also serve GET /healthz and /readyz on this port, outside the event loop.")
    shutdown_grace_s: float = Field(
        default=10.0, gt=0, description="Seconds from the first SIGINT/SIGTERM to the exit.")
    api_keys: dict[str, str] = Field(default_factory=dict, description="key -> tenant")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    data_dir: str | None = Field(
        default=None, description="Where the history database lives (default: JUSTITIA_HOME/data)."
    )
    predictors_dir: str | None = Field(
        default=None, description="Trained predictors, one folder per agent type."
    )
    retrain_every: int = Field(
        default=20, ge=0,
        description="Retrain a (tenant, agent type)'s predictor in the background after this "
                    "many new finished agents of it (0: no online learning).")
    engine_urls: list[str] = Field(
        default_factory=list, max_length=1,
        description="A remote vLLM OpenAI server (one; several replicas run on Ray); empty: "
                    "the in-process engine.")
    tokenizer: str | None = None
    ray_address: str | None = Field(
        default=None, description="Ray cluster of the engine replicas (HOST:PORT, ray://..., auto, "
                                  "or local); None: no Ray.")
    replicas: int = Field(default=1, ge=1, description="Engine replicas on Ray.")
    min_replicas: int | None = Field(default=None, ge=1, description="Ray Serve autoscaling: fewest replicas.")
    max_replicas: int | None = Field(default=None, ge=1, description="Ray Serve autoscaling: most replicas.")
    agent_lease_s: float = Field(default=600.0, gt=0)
    agent_retention_s: float = Field(
        default=3600.0, ge=0, description="How long ended agents stay readable (in memory)."
    )
    history_retention_s: float = Field(
        default=30 * 86_400, ge=0,
        description="Finished agents older than this leave the history (0: keep them all).")
    history_max_rows: int = Field(
        default=1_000_000, ge=0,
        description="The most agents the history keeps; the oldest go first (0: no bound).")
    history_max_bytes: int = Field(
        default=1 << 30, ge=0,
        description="The most bytes of rows the history keeps; the oldest go first (0: no bound).")
    initial_tau_s: float = Field(default=0.01, gt=0)
    profile: str | None = Field(
        default=None,
        description="Engine profile measured on this engine (a `bench calibrate` file, or a "
                    "built-in name): the prior of the engine's time model.")
    prior_tolerance: float = Field(
        default=TOLERANCE, ge=1.0,
        description="A measured prior whose prediction of the engine's warm-up is off by more than "
                    "this factor is scaled to it (server/runtime/prior_check.py).")
    log_level: str = "info"
    # Per-tenant limits (server/runtime/limits.py); None everywhere: no limits.
    rate_limit: Rate | None = Field(
        default=None, description="Inference and registration calls per tenant (token bucket)."
    )
    tenant_rate_limits: dict[str, Rate | None] = Field(
        default_factory=dict, description="tenant -> its own rate (None: unlimited)"
    )
    max_request_tokens: int | None = Field(
        default=None, ge=1, description="Cap on a request's prompt tokens + max_tokens."
    )
    tenant_max_request_tokens: dict[str, int | None] = Field(
        default_factory=dict, description="tenant -> its own cap (None: no cap)"
    )
    max_agents: int | None = Field(default=None, ge=1, description="Live agents per tenant.")
    tenant_max_agents: dict[str, int | None] = Field(default_factory=dict)
    max_queued: int | None = Field(default=DEFAULT_MAX_QUEUED, ge=1,
                                   description="Queued (not yet admitted) requests per tenant (None: no quota).")
    tenant_max_queued: dict[str, int | None] = Field(default_factory=dict)
    # Hierarchical fair share: a tenant's weight in the engine's share among tenants (default 1).
    tenant_weights: dict[str, float] = Field(default_factory=dict,
                                             description="tenant -> its weight in the fair share among tenants")
    max_agent_bytes: int | None = Field(default=None, ge=1,
                                        description="Bytes of prompts and metadata held by a tenant's live agents.")
    tenant_max_agent_bytes: dict[str, int | None] = Field(default_factory=dict)
    max_metadata_bytes: int | None = Field(default=64 * 1024, ge=1,
                                           description="Bytes of one agent's metadata (compact JSON).")
    tenant_max_metadata_bytes: dict[str, int | None] = Field(default_factory=dict)
    # What one request may ask of the server (server/api/request_limits.py, docs/reliability.md).
    max_stop: int = Field(default=16, ge=1, description="Stop sequences per request.")
    max_stop_chars: int = Field(default=256, ge=1, description="Characters per stop sequence.")
    max_messages: int = Field(default=2048, ge=1, description="Messages per chat request.")
    max_schema_bytes: int = Field(default=64 * 1024, ge=64, description="Bytes of a JSON schema.")
    max_schema_enum: int = Field(default=1024, ge=1, description="Enum/const values in a schema.")
    max_schema_properties: int = Field(default=1024, ge=1, description="Properties in a schema.")
    max_schema_depth: int = Field(default=12, ge=1, description="Nesting of sub-schemas.")
    max_pattern_repeat: int = Field(default=256, ge=1,
                                    description="Largest counted repetition {n} in a pattern.")
    grammar_timeout_s: float = Field(
        default=2.0, gt=0, description="Time budget to compile a JSON schema's grammar.")
    grammar_warm_up: bool = Field(
        default=True, description="Start the grammar worker (and load its compiler) at start-up "
                                  "rather than at the first JSON schema.")
    max_dashboard_streams: int = Field(
        default=8, ge=1, description="Open dashboard streams (GET /v1/scheduler/events) per tenant.")
