"""The live scheduler: the scheduler core driven by real time, in front of a real engine.

`LiveScheduler` is the face the API and the service use; it holds the table of agents and
joins the pieces that each do one thing:

- `server/runtime/lifecycle.py`: an agent's states and the one function that validates and
  applies a transition (queued, running, finished, failed, cancelled, expired);
- `server/runtime/admission.py`: requests wait for admission there, each with a ticket that the
  dispatcher's decision opens; per-tenant queued counts and quotas; pause and resume;
- `server/runtime/agent_listeners.py`: the side effects of agents' lives (history rows, predictor
  feedback, metrics) as listeners registered once, called on registration, on each
  request's end and on the agent's end;
- `server/runtime/agent_table.py`: the table of agents, by tenant and by session;
- `server/runtime/endings.py`: how an agent ends (finish, cancel, lease expiry, a session's
  idle end), durable in the history before the API answers;
- `server/runtime/cost_estimate.py`: an agent's predicted cost when it registers;
- `server/runtime/engine_upkeep.py`: tau, the engine's step-time model and capacity, and
  what the history keeps of them;
- `server/runtime/records.py` and `feeds.py`: agents' records and the streams of them.

An admitted request goes to the engine with an int priority from its agent's rank, so that
if the engine must preempt anyway it preempts the lowest-ranked agent.

Everything here runs on the server's single event loop, so the dispatcher (which is not
thread-safe) is only touched from there and needs no lock. The clock is read here and only
here; the dispatcher gets `now` as an argument.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from server.engine.base import (
    Capabilities,
    Engine,
    EngineError,
    EngineOutput,
    SamplingOptions,
)
from server.runtime.admission import Admission
from server.runtime.agent_listeners import (
    AgentListener,
    AgentListeners,
    HistoryWriter,
    MetricsRecorder,
    PredictorFeedback,
    Predictors,
)
from server.runtime.agent_table import AgentTable, held_bytes_of
from server.runtime.agents import AgentEntry, AgentRecord, encode_metadata, new_agent_id
from server.runtime.cost_estimate import estimate_cost
from server.runtime.declared import declared_batch, declared_shape
from server.runtime.endings import AgentEndings, require_live
from server.runtime.engine_upkeep import EngineUpkeep
from server.runtime.feeds import Feeds, agent_events
from server.runtime.lifecycle import AgentConflict, AgentNotFound
from server.runtime.live_config import LiveConfig
from server.runtime.records import agent_record
from server.runtime.relearn import Recalled
from server.runtime.request_path import RequestPath
from server.runtime.retain import LiveRetention
from server.runtime.type_shapes import ETA_QUANTILE, TypeShapes
from server.scheduler import AgentShape, AgentView, Dispatcher, get_policy

if TYPE_CHECKING:
    from server.runtime.history import History
    from server.runtime.metrics import Metrics

log = logging.getLogger("justitia.live")

# Of a registered prompt (up to 1 MB), only this much is kept once its cost is predicted.
KEPT_PROMPT_CHARS = 64 * 1024
#: The ETA pass is O(N log N): with many agents queued it runs less often, at most once per
#: this many times its own duration, so that it never takes more than 5% of the event loop.
ETA_PASS_SPACING = 20.0

__all__ = ["AgentConflict", "AgentNotFound", "LiveConfig", "LiveScheduler"]


class LiveScheduler:
    def __init__(
        self,
        engine: Engine,
        config: LiveConfig,
        *,
        predictors: Predictors | None = None,
        history: History | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        capabilities: Capabilities | None = None,
        listeners: list[AgentListener] | None = None,
    ) -> None:
        self.engine = engine
        # What the engine offers beyond `Engine`, found once (server/engine/base.py).
        self.capabilities = capabilities or Capabilities.of(engine)
        self.config = config
        self.predictors = predictors
        self.history = history
        self.metrics = metrics
        self._clock = clock
        self._wall = wall
        self._t0 = clock()
        self.table = AgentTable()
        self.agents = self.table.agents
        self.feeds = Feeds(self.agents, self.record)
        self._task: asyncio.Task[None] | None = None
        self.dispatcher = Dispatcher(
            get_policy(config.policy, las_half_life_s=config.las_half_life_s,
                       las_head_wait_weight=config.las_head_wait_weight),
            kv_capacity_tokens=engine.info.kv_capacity_tokens,
            iteration_time_s=config.initial_tau_s,
            now=0.0,
            block_size=engine.info.block_size,
            context_tokens=engine.info.max_model_len,
            tenant_weights=config.tenant_weights,
        )
        self.upkeep = EngineUpkeep(engine, self.capabilities, self.dispatcher,
                                   initial_tau_s=config.initial_tau_s, prior=config.time_model_prior,
                                   prior_measured=config.prior_measured, now=self.now,
                                   warm_up_steps=config.warm_up_steps,
                                   prior_tolerance=config.prior_tolerance)
        self.tau = self.upkeep.tau
        self.time_models = self.upkeep.time_models
        self.admission = Admission(
            self.dispatcher, config.quotas, config.max_num_seqs, self.now,
            placement=self.capabilities.placement,
            engine_recovering=self.upkeep.recovering,
        )
        history_writer = HistoryWriter(history) if history is not None else None
        self.listeners = AgentListeners()
        # Types' typical shapes, for the bounds of agents that declare none (type_shapes.py).
        self.type_shapes = TypeShapes()
        for listener in (history_writer, self.type_shapes,
                         PredictorFeedback(predictors) if predictors is not None else None,
                         MetricsRecorder(metrics) if metrics is not None else None,
                         *(listeners or [])):
            if listener is not None:
                self.listeners.add(listener)
        self.retention = LiveRetention.of(config.retain, self.dispatcher, engine, self.time_models, self.now)
        self.endings = AgentEndings(self.dispatcher, self.table, self.admission, engine, self.listeners,
                                    self.retention, config, history_writer=history_writer,
                                    now=self.now, wall=self._wall, pump=self._pump)
        self.requests = RequestPath(self.dispatcher, self.admission, self.engine, self.listeners,
                                    now=self.now, wall=self._wall, close=self.endings.close)
        if self.retention.active:
            self.admission.retention = self.retention
            self.requests.retention = self.retention
        self.upkeep.listen(on_state=self._on_engine_state, pump=self._pump)

    @property
    def recalled(self) -> Recalled:
        """What `start` learned again from the history."""
        return self.upkeep.recalled

    def _on_engine_state(self, state: str, detail: str) -> None:
        """The engine restarted: admit what waited. It gave up: fail what waits, with why."""
        if state == "running":
            self._pump()
        elif state == "failed":
            self.admission.fail_waiting(EngineError(f"the engine is not running: {detail}"))

    # -- time ---------------------------------------------------------------------
    def now(self) -> float:
        """The scheduler's clock: seconds since the server started."""
        return self._clock() - self._t0

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self.history is not None:
            await self.upkeep.recall(self.history, self.type_shapes, self._wall())
        self._task = asyncio.create_task(self._housekeeping(), name="justitia-housekeeping")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.admission.fail_waiting(EngineError("the server is shutting down"))
        await self.retention.close()
        await self.upkeep.save(self.history)

    async def _housekeeping(self) -> None:
        last = self.now()
        every = self.config.eta_refresh_s
        while True:
            await asyncio.sleep(min(self.config.housekeeping_s, every))
            try:
                t0 = time.perf_counter()
                self.dispatcher.refresh_etas(self.now())
                every = max(self.config.eta_refresh_s, ETA_PASS_SPACING * (time.perf_counter() - t0))
                if self.now() - last < self.config.housekeeping_s:
                    continue
                last = self.now()
                self.upkeep.update()  # tau, the step-time model and the rates ETAs divide by
                await self.upkeep.save_every(self.history)
                await self.endings.expire_idle()
                self.table.prune(self.now(), self.config.retention_s)
                if not self.engine.healthy and not self.upkeep.recovering():
                    self.admission.fail_waiting(EngineError("the engine is not running"))
            except Exception:  # housekeeping must survive anything one round throws
                log.exception("housekeeping round failed")

    # -- agents -------------------------------------------------------------------
    def register(
        self,
        agent_type: str,
        prompt: str,
        tenant: str,
        metadata: dict[str, Any] | None = None,
        *,
        predicted_cost: float | None = None,
        auto: bool = False,
        lease_s: float | None = None,
        session: str | None = None,
        metadata_json: bytes | None = None,
        shape: AgentShape | None = None,
    ) -> AgentEntry:
        """A new agent. `metadata_json`: `metadata` already encoded (`encode_metadata`),
        by a caller that did it off the event loop. `shape`: its structure where the caller
        knows it (a one-request agent made for an untagged request), over what its metadata
        declares."""
        self.config.quotas.check_agents(tenant, self.table.live_count(tenant))
        # One instant for both clocks: the wall-clock submission time is the moment the
        # promise is made from, not after the prediction and the scheduler's pass.
        now, submitted_at = self.now(), self._wall()
        metadata = metadata or {}
        kept_prompt = prompt[:KEPT_PROMPT_CHARS]
        if metadata_json is None:
            metadata_json = encode_metadata(metadata) if metadata else b"{}"
        self.config.quotas.check_metadata(tenant, len(metadata_json))
        held = held_bytes_of(kept_prompt, metadata_json)
        self.config.quotas.check_bytes(tenant, self.table.held_bytes(tenant), held)
        interval: tuple[float, float] | None = None
        guessed: AgentShape | None = None  # the structure a guessed cost stands for
        if predicted_cost is None:
            estimate = estimate_cost(self.predictors, agent_type, prompt, tenant, metadata)
            predicted_cost, cost_source = estimate.cost, estimate.source
            interval, guessed = estimate.interval, estimate.guessed
        else:
            cost_source = "request" if auto else "declared"
        agent_id = new_agent_id()
        declared = shape or declared_shape(metadata)
        view = self.dispatcher.register_agent(
            agent_id, predicted_cost, now, agent_type=agent_type, tenant=tenant,
            shape=declared or self.type_shapes.typical(tenant, agent_type),
            # A learned shape: the promise covers the type's p90, the ETA expects its median.
            # With none, the ETA expects the one request a guessed cost stands for: with no
            # path at all it would be the whole cost at the engine's full rate, a tenth or
            # less of the JCT of an agent whose requests run one after another.
            eta_shape=None if declared else (
                self.type_shapes.typical(tenant, agent_type, ETA_QUANTILE) or guessed),
            cost_p90=interval[1] if interval else None,
            cost_guessed=guessed is not None,
        )
        batch = declared_batch(metadata, tenant)
        if batch is not None and self.dispatcher.arrivals.declare(
                now, view.charged_cost, batch, self.dispatcher.eta_rate):
            view = self.dispatcher.view(agent_id, now)  # its ETA expects the rest of its batch
        entry = AgentEntry(
            id=agent_id,
            type=agent_type,
            tenant=tenant,
            # What a predictor learns from later (the history); the rest served prediction.
            prompt=kept_prompt,
            metadata=None,
            submitted_at=submitted_at,
            submitted_mono=now,
            predicted_cost=predicted_cost,
            auto=auto,
            session=session,
            lease_s=lease_s,
            cost_source=cost_source,
            cost_interval=interval,
            last_activity_mono=now,
            first_eta_s=view.eta_s,
            eta_scale=self.dispatcher.agents[agent_id].eta_scale,
            first_eta_interval_s=view.eta_interval_s,
            declared=declared,
            on_change=self.feeds.changed,
        )
        entry.metadata_json = metadata_json  # the bytes counted above, not encoded twice
        self.table.add(entry, held)
        self.listeners.on_agent_registered(entry)
        self.feeds.changed(entry)
        return entry

    def session_agent(self, tenant: str, session: str, agent_type: str, prompt: str) -> AgentEntry:
        """The live implicit agent of the tenant's session, registered at the session's first
        request (or its first since the last one ended): its cost is predicted from its type
        and prompt, and grows by the over-run rule as its requests run, as any agent's."""
        entry = self.table.session(tenant, session)
        if entry is None or entry.terminal:
            entry = self.register(agent_type, prompt, tenant, session=session)
            self.table.bind_session(tenant, session, entry)
        # A request is on its way: the idle finish must not end the agent under it.
        entry.last_activity_mono = self.now()
        return entry

    def get(self, agent_id: str, tenant: str) -> AgentEntry:
        return self.table.get(agent_id, tenant)

    def list(self, tenant: str) -> builtins.list[AgentEntry]:
        """The tenant's agents (live, and ended ones still kept), in registration order."""
        return self.table.list(tenant)

    def page(self, tenant: str, limit: int, after: int = 0,
             state: str | None = None) -> tuple[builtins.list[AgentEntry], int | None]:
        """A page of the tenant's agents in registration order (AgentTable.page)."""
        return self.table.page(tenant, limit, after, state)

    def live_page(self, tenant: str, limit: int,
                  ) -> tuple[builtins.list[AgentEntry], int, int | None]:
        """The tenant's first `limit` live agents (AgentTable.live_page)."""
        return self.table.live_page(tenant, limit)

    def record(self, entry: AgentEntry) -> AgentRecord:
        view = entry.final_view if entry.final_view is not None else self._view(entry)
        return agent_record(entry, view, self.now())

    def tool_call(self, entry: AgentEntry, tool: str | None, expected_s: float | None = None) -> AgentEntry:
        """The agent's client says it is in tool call `tool` from now (the SDK's `tool()`),
        maybe how long it expects it to take, or (`tool` None) that the call ended: the
        scheduler judges the rest of the pause from it, learns the call's length (pauses.py)
        and reconsiders its kept context. AgentConflict once the agent has ended."""
        require_live(entry)
        agent, now = self.dispatcher.agents[entry.id], self.now()
        if tool is not None:
            self.dispatcher.pauses.tool_started(agent, tool, expected_s, now)
        else:
            self.dispatcher.pauses.tool_ended(agent, now)
        self.retention.reconsider(entry.id)
        entry.last_activity_mono = now
        entry.touch()
        return entry

    def _view(self, entry: AgentEntry) -> AgentView:
        return self.dispatcher.view(entry.id, self.now())

    async def finish(self, entry: AgentEntry, error: str | None = None) -> AgentEntry:
        """The agent is done: `finished`, or `failed` with its client's `error`; returns once
        its end is durable (server/runtime/endings.py)."""
        return await self.endings.finish(entry, error)

    async def cancel(self, entry: AgentEntry) -> AgentEntry:
        """The agent is cancelled, its requests aborted (server/runtime/endings.py)."""
        return await self.endings.cancel(entry)

    def require_live(self, entry: AgentEntry) -> None:
        """AgentConflict (409) once the agent has ended."""
        require_live(entry)

    # -- requests -----------------------------------------------------------------
    def run(self, entry: AgentEntry, request_id: str, prompt_token_ids: tuple[int, ...],
            sampling: SamplingOptions) -> AsyncGenerator[EngineOutput, None]:
        """Queue one request of `entry`, wait for admission, then stream it from the engine
        (server/runtime/request_path.py)."""
        return self.requests.run(entry, request_id, prompt_token_ids, sampling)

    @property
    def paused(self) -> bool:
        return self.admission.paused

    def pause(self) -> None:
        """Stop admitting: requests queue, running ones finish (drain, maintenance)."""
        self.admission.pause()

    def resume(self) -> None:
        self.admission.resume()

    def _pump(self) -> None:
        self.admission.pump()

    # -- observation ----------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        snap = self.dispatcher.snapshot(self.now())
        snap["paused"] = self.paused
        stats = self.engine.stats()
        snap["engine"] = {
            "kv_usage": stats.kv_usage,
            "running": stats.running,
            "waiting": stats.waiting,
            "preemptions_total": stats.preemptions_total,
            "iteration_time_s": stats.iteration_time_s,
            "dtype": self.engine.info.dtype,
        }
        snap["time_model"] = self.upkeep.describe()
        snap["recalled"] = asdict(self.recalled)
        snap["retention"] = self.retention.summary()
        return snap

    def watch(
        self,
        tenant: str,
        ids: frozenset[str] | None = None,
        *,
        interval_s: float = 0.25,
        heartbeat_s: float = 15.0,
        initial: builtins.list[AgentEntry] | None = None,
    ) -> AsyncIterator[builtins.list[AgentRecord] | None]:
        """The records of a tenant's agents (all, or those in `ids`) as they change: first
        the live ones (or `initial`, the caller's bounded snapshot), then at most one batch
        per `interval_s` of those that changed (None: heartbeat). One stream serves a whole
        batch of agents (server/runtime/feeds.py)."""
        def first() -> builtins.list[AgentEntry]:
            if initial is not None:
                return initial
            if ids is None:
                return [e for e in self.list(tenant) if not e.terminal]
            return [e for i in ids if (e := self.agents.get(i)) and e.tenant == tenant]

        return self.feeds.watch(tenant, ids, first, interval_s=interval_s, heartbeat_s=heartbeat_s)

    def events(self, entry: AgentEntry, heartbeat_s: float = 15.0) -> AsyncIterator[AgentRecord | None]:
        """The record now and after every change, until the agent ends (None: heartbeat)."""
        return agent_events(entry, self.record, heartbeat_s)
