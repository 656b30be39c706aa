"""Pydantic models of what the server returns."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

AgentState = Literal["queued", "running", "paused", "finished", "failed", "cancelled", "expired"]
TERMINAL_STATES: frozenset[str] = frozenset({"finished", "failed", "cancelled", "expired"})


class AgentRecord(BaseModel):
    """The server's view of one agent (docs/server.md, "Agents").

    `fair_finish_s`, `eta_s`, `delay_bound_s` and `deadline_s` are seconds from
    `submitted_at`; `submitted_at` and `finished_at` are unix seconds on the server's clock.
    Unknown fields are kept (a newer server may add some).
    """

    model_config = ConfigDict(extra="allow")

    id: str
    type: str
    state: str
    predicted_cost: float | None = None
    virtual_finish: float | None = None
    consumed_cost: float | None = None
    requests_total: int = 0
    requests_done: int = 0
    submitted_at: float | None = None
    fair_finish_s: float | None = None
    eta_s: float | None = None
    delay_bound_s: float | None = None
    deadline_s: float | None = None
    finished_at: float | None = None
    tenant: str | None = None
    metadata: dict[str, Any] | None = None
    #: The ETA the server gave when the agent was submitted (seconds from submitted_at).
    first_eta_s: float | None = None
    #: Job completion time, once terminal: finished_at - submitted_at.
    jct_s: float | None = None
    #: Why a `failed` agent failed (its code raised), as the SDK reported it.
    error: str | None = None
    #: Where predicted_cost came from: "declared", "request", "model", "cold_start" or
    #: "fallback" (docs/predictors.md); None from servers that do not say.
    cost_source: str | None = None
    #: The session id of an implicit session agent (OpenAI requests that carry a session
    #: header and no agent tag; docs/server.md); None for other agents and older servers.
    session: str | None = None
    #: While `paused` (running, nothing in flight: a tool call): when the pause began (unix
    #: seconds) and how long it has lasted; None otherwise and from older servers.
    paused_at: float | None = None
    paused_for_s: float | None = None

    @model_validator(mode="after")
    def _fill_jct(self) -> AgentRecord:
        # Older servers do not send jct_s; it follows from the two timestamps.
        if (self.jct_s is None and self.state == "finished" and self.finished_at is not None
                and self.submitted_at is not None):
            self.jct_s = self.finished_at - self.submitted_at
        return self

    @property
    def terminal(self) -> bool:
        """True once the agent is finished, failed, cancelled or expired."""
        return self.state in TERMINAL_STATES


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @property
    def kv_cost(self) -> float:
        """KV token-time of the request: p*d + d*(d+1)/2 (docs/concepts.md, "Cost model")."""
        p, d = self.prompt_tokens, self.completion_tokens
        return float(p * d + d * (d + 1) // 2)


class Completion(BaseModel):
    """One completion (or chat completion): its text, why it stopped, and its token counts."""

    model_config = ConfigDict(extra="allow")

    id: str
    text: str
    finish_reason: str | None = None
    usage: Usage = Usage()
    agent_id: str | None = None
    raw: dict[str, Any] = {}

    def __str__(self) -> str:
        return self.text
