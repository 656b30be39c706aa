"""The live scheduler: the scheduler core driven by real time, in front of a real engine.

`LiveScheduler` is the face the API and the service use; it holds the table of agents and
joins the pieces that each do one thing:

- `server/runtime/lifecycle.py`: an agent's states and the one function that validates and
  applies a transition (queued, running, finished, failed, cancelled, expired);
- `server/runtime/admission.py`: requests wait for admission there, each with a ticket that the
  dispatcher's decision opens; per-tenant queued counts and quotas; pause and resume;
- `server/runtime/agent_listeners.py`: the side effects of agents' lives (history rows, predictor
  feedback, metrics) as listeners registered once, called on registration, on each
  request's end and on the agent's end.

An admitted request goes to the engine with an int priority from its agent's rank, so that
if the engine must preempt anyway it preempts the lowest-ranked agent.

Everything here runs on the server's single event loop, so the dispatcher (which is not
thread-safe) is only touched from there and needs no lock. The clock is read here and only
here; the dispatcher gets `now` as an argument.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import itertools
import logging
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedDict

from server.engine.base import (
    Capabilities,
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    SamplingOptions,
)
from server.runtime.admission import Admission, Ticket
from server.runtime.agent_listeners import (
    AgentListener,
    AgentListeners,
    HistoryWriter,
    MetricsRecorder,
    PredictorFeedback,
    Predictors,
)
from server.runtime.agents import (
    MAX_ERROR_CHARS,
    AgentEntry,
    AgentRecord,
    AgentStateName,
    CostSource,
    RequestLog,
    encode_metadata,
    new_agent_id,
)
from server.runtime.lifecycle import ABANDONED, AgentConflict, AgentNotFound, transition
from server.runtime.limits import QuotaExceeded, Quotas
from server.runtime.relearn import HistoryReading, Recalled, engine_key, engine_state, recall
from server.runtime.type_shapes import ETA_QUANTILE, TypeShapes
from server.scheduler import (
    AgentShape,
    Dispatcher,
    RequestSpec,
    RequestStatus,
    decode_for_kv_cost,
    get_policy,
    kv_cost,
)
from server.scheduler.declared import BatchDeclaration
from server.scheduler.policies import FOOTPRINT
from server.scheduler.prefix import PrefixRef, block_chain
from server.scheduler.rate import TauEstimator
from server.scheduler.reprediction import DEFAULT_P90_RATIO, expected_total
from server.scheduler.time_model import DEFAULT_PRIOR, TimeModel, TimeModelBank

if TYPE_CHECKING:
    from server.runtime.history import History
    from server.runtime.metrics import Metrics

log = logging.getLogger("justitia.live")

# Of a registered prompt (up to 1 MB), only this much is kept once its cost is predicted.
KEPT_PROMPT_CHARS = 64 * 1024
# The output a request is guessed to decode when nothing predicts its agent's cost.
FALLBACK_OUTPUT_TOKENS = 256

__all__ = ["AgentConflict", "AgentNotFound", "LiveConfig", "LiveScheduler"]


@dataclass(eq=False)
class _Feed:
    """One multiplexed event stream: the ids of its tenant's agents that changed since its
    last flush. Many changes of one agent between two flushes are sent as one record."""

    tenant: str
    ids: frozenset[str] | None  # None: every agent of the tenant
    dirty: set[str] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class LiveConfig:
    policy: str = "justitia"
    las_half_life_s: float | None = None  # las only (None: its default)
    las_head_wait_weight: float | None = None  # las only (None: its default)
    session_idle_s: float = 60.0  # an implicit session agent idle this long is finished
    initial_tau_s: float = 0.01
    lease_s: float = 600.0  # an agent idle this long without finish expires
    retention_s: float = 3600.0  # terminal agents stay readable this long
    max_num_seqs: int = 256
    housekeeping_s: float = 1.0
    eta_refresh_s: float = 0.25  # ETAs are replayed this often, off the request path
    quotas: Quotas = field(default_factory=Quotas)
    # tenant -> its weight in the hierarchical fair share (default 1; tenant_clock.py)
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Where the engine's time model starts before it has seen a step (server/scheduler/time_model.py).
    time_model_prior: TimeModel = DEFAULT_PRIOR
    # The prior was measured on this engine (`serve --profile`, a `bench calibrate` file): it
    # times ETAs from the start, and sets their rate (Dispatcher.eta_rate) before the fit has
    # seen TRUSTED_STEPS steps.
    prior_measured: bool = False


# A fit to this many engine steps describes the engine whatever its prior: only then does a
# model started from a prior measured elsewhere set the rate ETAs divide by.
TRUSTED_STEPS = 1024
ENGINE_SAVE_S = 60.0  # how often what was measured of the engine is saved in the history (and at shutdown)


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
        self.agents: dict[str, AgentEntry] = {}
        # Agents that have not ended (scanned for expiry every second) and ended ones in the
        # order they ended (pruned from the front): housekeeping stays O(live agents) however
        # many ended agents are kept readable.
        self._open: set[str] = set()
        self._ended: collections.deque[str] = collections.deque()
        self._feeds: dict[str, set[_Feed]] = {}
        # Per tenant: its agents in registration order (pages of GET /v1/agents) and how
        # many are live (the max_agents quotas).
        self._by_tenant: dict[str, SortedDict] = {}
        self._live_count: collections.Counter[str] = collections.Counter()
        self._held_bytes: collections.Counter[str] = collections.Counter()  # --max-agent-bytes
        # (tenant, session id) -> the id of its implicit agent (live, or ended and replaced
        # at the session's next request); the tenant in the key keeps sessions apart.
        self._sessions: dict[tuple[str, str], str] = {}
        self._agent_seq = itertools.count(1)
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
        # R = M / tau must be the rate the engine really serves with the memory it fills,
        # not M over the raw step time (see server/scheduler/rate.py).
        self.tau = TauEstimator(engine.info.kv_capacity_tokens, config.initial_tau_s)
        # until the engine's rate is measured, promises are widened and say so
        self.dispatcher.set_iteration_time(config.initial_tau_s, 0.0, **self.tau.promise_times())
        self.admission = Admission(
            self.dispatcher, config.quotas, config.max_num_seqs, self.now,
            placement=self.capabilities.placement,
            engine_recovering=self._engine_recovering,
        )
        self._history_writer = HistoryWriter(history) if history is not None else None
        self.listeners = AgentListeners()
        # Types' typical shapes, for the bounds of agents that declare none (type_shapes.py).
        self.type_shapes = TypeShapes()
        for listener in (self._history_writer, self.type_shapes,
                         PredictorFeedback(predictors) if predictors is not None else None,
                         MetricsRecorder(metrics) if metrics is not None else None,
                         *(listeners or [])):
            if listener is not None:
                self.listeners.add(listener)
        self.time_models = TimeModelBank(config.time_model_prior)
        self.recalled = Recalled()  # what `start` learned again from the history
        # the prior was measured on this engine: a calibration, or the last run's saved fit
        self._prior_measured = config.prior_measured
        self._engine_saved_at = 0.0
        if config.prior_measured:
            self.dispatcher.set_time_model(config.time_model_prior)
        self._listen_to_engine()

    def _listen_to_engine(self) -> None:
        caps = self.capabilities
        if caps.step_statistics is not None:
            caps.step_statistics.add_step_listener(self._on_engine_step)
        # The engine's step time as a function of its batch, learned from its own steps
        # (one model per engine; engines that report no step shapes keep none).
        if caps.step_samples is not None:
            caps.step_samples.add_sample_listener(self.time_models.observe)
        # Engines of several replicas: M follows the replicas that serve (added, removed,
        # failed, back).
        if caps.capacity_changes is not None:
            caps.capacity_changes.add_capacity_listener(self._on_capacity_change)
        if caps.supervision is not None:
            caps.supervision.add_state_listener(self._on_engine_state)

    def _on_engine_state(self, state: str, detail: str) -> None:
        """The engine restarted: admit what waited. It gave up: fail what waits, with why."""
        if state == "running":
            self._pump()
        elif state == "failed":
            self.admission.fail_waiting(EngineError(f"the engine is not running: {detail}"))

    def _engine_recovering(self) -> bool:
        """The engine is down but being restarted: queued requests wait for it."""
        supervised = self.capabilities.supervision
        return supervised is not None and supervised.recovering

    def _on_capacity_change(self, kv_capacity_tokens: int) -> None:
        self.dispatcher.set_kv_capacity(kv_capacity_tokens, self.now())
        self.tau.set_kv_capacity(kv_capacity_tokens)
        self._pump()

    def _on_engine_step(self, duration_s: float, kv_in_use: float) -> None:
        footprint = self.dispatcher.policy.admission == FOOTPRINT
        reserved = self.dispatcher.ledger.reserved_kv if footprint else None
        self.tau.observe_step(duration_s, kv_in_use, reserved)

    # -- time ---------------------------------------------------------------------
    def now(self) -> float:
        """The scheduler's clock: seconds since the server started."""
        return self._clock() - self._t0

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        if self.history is not None:
            await self._recall(self.history)
        self._task = asyncio.create_task(self._housekeeping(), name="justitia-housekeeping")

    async def _recall(self, history: History) -> None:
        """Learn again what the last run learned and the history kept (server/runtime/relearn.py):
        the types' shapes, the episodes of arrivals, the engine's time model and tau."""
        try:
            reading = await asyncio.to_thread(HistoryReading.read, history, self.type_shapes.window,
                                              self.dispatcher.arrivals.max_samples, self.engine.info)
        except Exception as exc:  # a history that cannot be read leaves the server fresh, not down
            log.warning("could not read the history to learn from it again: %s", exc)
            return
        self.recalled = recall(reading, self.type_shapes, self.dispatcher, self.now(), self._wall())
        if reading.saved_tau is not None and not self.tau.measured and self.tau.resume(*reading.saved_tau):
            self.recalled = replace(self.recalled, tau_s=self.tau.tau_s)
            self.dispatcher.set_iteration_time(self.tau.tau_s, self.now(), **self.tau.promise_times())
        prior = reading.prior
        # a calibration given to this run wins; a bank that has seen steps keeps its fit
        if prior is not None and not self._prior_measured and not self.time_models.fitters:
            self.time_models.prior = prior  # its fitters start from it (none has yet)
            self._prior_measured = True
            self.dispatcher.set_time_model(prior)
        if self.recalled.agents or self.recalled.registrations:
            log.info("learned again from the history: the shapes of %d agents of %d types, %d "
                     "registrations (%d episodes of arrivals)", self.recalled.agents, self.recalled.types,
                     self.recalled.registrations, self.dispatcher.arrivals.episodes)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.admission.fail_waiting(EngineError("the server is shutting down"))
        await self._save_engine_state()

    async def _save_engine_state(self) -> None:
        """Keep what this run measured of the engine in the history for the next run on it
        (server/runtime/relearn.py): the best-fitted time model once it has learned from
        TRUSTED_STEPS steps, and tau's evidence once a step has measured it."""
        if self.history is None:
            return
        models = self.time_models.models()
        model = max(models.values(), key=lambda m: m.samples) if models else None
        state = engine_state(model if model is not None and model.samples >= TRUSTED_STEPS else None,
                             self.tau.state() if self.tau.measured else None)
        if not state:
            return
        try:
            await asyncio.to_thread(self.history.save_engine_state, engine_key(self.engine.info), state)
        except Exception as exc:  # the next run starts from its priors: worse ETAs, nothing lost
            log.warning("could not save the engine's measurements in the history: %s", exc)

    async def _housekeeping(self) -> None:
        last = self.now()
        every = self.config.eta_refresh_s
        while True:
            await asyncio.sleep(min(self.config.housekeeping_s, every))
            try:
                t0 = time.perf_counter()
                self.dispatcher.refresh_etas(self.now())
                # The ETA pass is O(N log N): with many agents queued it runs less often, so
                # that it never takes more than 5% of the event loop.
                every = max(self.config.eta_refresh_s, 20.0 * (time.perf_counter() - t0))
                if self.now() - last < self.config.housekeeping_s:
                    continue
                last = self.now()
                self._update_tau()
                if self.now() - self._engine_saved_at >= ENGINE_SAVE_S:
                    self._engine_saved_at = self.now()
                    await self._save_engine_state()
                await self._expire_idle_agents()
                self._prune()
                if not self.engine.healthy and not self._engine_recovering():
                    self.admission.fail_waiting(EngineError("the engine is not running"))
            except Exception:  # housekeeping must survive anything one round throws
                log.exception("housekeeping round failed")

    def _update_tau(self) -> None:
        self.dispatcher.set_iteration_time(self.tau.tau_s, self.now(), **self.tau.promise_times())
        # ETAs time critical paths with the engine's fitted step time (one engine here; with
        # replicas, whichever has learned from the most steps).
        models = self.time_models.models()
        if not models:
            return
        model = max(models.values(), key=lambda m: m.samples)
        # A prior measured on this engine (a calibration, the last run's fit) keeps timing
        # ETAs until the fit has seen TRUSTED_STEPS: a fit to a burst's first few hundred
        # steps, mostly prefills, halved the rate ETAs divide by (a fresh server, live: 0.41M
        # to 0.22M units a second; the fit to the whole run gives 0.39M, the calibration
        # 0.40M), and the burst's last third was told twice its JCTs (session 16). A prior
        # measured elsewhere is worse than an early fit, for critical paths at least, and
        # is no fit: until the first refit tau times paths, as it did before any step. (The
        # built-in prior, set by whichever housekeeping tick followed the first steps, timed
        # the demo's first wave at 2.7 ms a step in some runs and tau's 10 ms in others.)
        if model.samples >= TRUSTED_STEPS:
            self.dispatcher.set_time_model(model)
        elif not self._prior_measured and model.samples > 0:
            self.dispatcher.set_time_model(model, sustains=False)

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
    ) -> AgentEntry:
        """A new agent. `metadata_json`: `metadata` already encoded (`encode_metadata`),
        by a caller that did it off the event loop."""
        self.config.quotas.check_agents(tenant, self._live_count[tenant])
        now = self.now()
        metadata = metadata or {}
        kept_prompt = prompt[:KEPT_PROMPT_CHARS]
        if metadata_json is None:
            metadata_json = encode_metadata(metadata) if metadata else b"{}"
        self.config.quotas.check_metadata(tenant, len(metadata_json))
        held = _held_bytes(kept_prompt, metadata_json)
        self.config.quotas.check_bytes(tenant, self._held_bytes[tenant], held)
        interval: tuple[float, float] | None = None
        guessed: AgentShape | None = None  # the structure a guessed cost stands for
        if predicted_cost is None:
            predicted_cost, cost_source, interval, guessed = self._predict(agent_type, prompt, tenant, metadata)
        else:
            cost_source = "request" if auto else "declared"
        agent_id = new_agent_id()
        declared = _shape(metadata)
        view = self.dispatcher.register_agent(
            agent_id, predicted_cost, now, agent_type=agent_type, tenant=tenant,
            shape=declared or self.type_shapes.typical(tenant, agent_type),
            # A learned shape: the promise covers the type's p90, the ETA expects its median.
            # With none, the ETA expects the one request a guessed cost stands for: with no
            # path at all, a fresh server's demo agents were told 0.1-0.2 s for JCTs of 2-6 s
            # (their whole cost at the engine's full rate).
            eta_shape=None if declared else (
                self.type_shapes.typical(tenant, agent_type, ETA_QUANTILE) or guessed),
            cost_p90=interval[1] if interval else None,
        )
        batch = _batch_declared(metadata, tenant)
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
            submitted_at=self._wall(),
            submitted_mono=now,
            predicted_cost=predicted_cost,
            auto=auto,
            session=session,
            lease_s=lease_s,
            cost_source=cost_source,
            cost_interval=interval,
            last_activity_mono=now,
            first_eta_s=view.eta_s,
            first_eta_interval_s=view.eta_interval_s,
            on_change=self._on_agent_change,
        )
        entry.metadata_json = metadata_json  # the bytes counted above, not encoded twice
        stages = metadata.get("stages")
        if isinstance(stages, int) and not isinstance(stages, bool):
            entry.declared_stages = stages
        entry.seq = next(self._agent_seq)
        self.agents[agent_id] = entry
        self._by_tenant.setdefault(tenant, SortedDict())[entry.seq] = entry
        self._live_count[tenant] += 1
        entry.held_bytes = held
        self._held_bytes[tenant] += held
        self._open.add(agent_id)
        self.listeners.on_agent_registered(entry)
        self._on_agent_change(entry)
        return entry

    def session_agent(self, tenant: str, session: str, agent_type: str, prompt: str) -> AgentEntry:
        """The live implicit agent of the tenant's session, registered at the session's first
        request (or its first since the last one ended): its cost is predicted from its type
        and prompt, and grows by the over-run rule as its requests run, as any agent's."""
        key = (tenant, session)
        entry = self.agents.get(self._sessions.get(key, ""))
        if entry is None or entry.terminal:
            entry = self.register(agent_type, prompt, tenant, session=session)
            self._sessions[key] = entry.id
        # A request is on its way: the idle finish must not end the agent under it.
        entry.last_activity_mono = self.now()
        return entry

    def _predict(self, agent_type: str, prompt: str, tenant: str, metadata: dict[str, Any]
                 ) -> tuple[float, CostSource, tuple[float, float] | None, AgentShape | None]:
        """The predicted cost, where it came from, its (p50, p90) interval when the
        predictor gives one (re-prediction starts from it), and the shape the cost was
        guessed as where it is a guess (a cold start or the fallback: one request of the
        prompt's size, decoding until the cost is spent)."""
        if self.predictors is not None:
            from predictors.features import estimate_tokens, submission_features

            # What the agent declared: its `features` numbers, fan-out and stage shape.
            features = submission_features(metadata)
            try:
                predictor = self.predictors.get(agent_type, tenant)
                interval = getattr(predictor, "predict_interval", None)
                bounds = interval(prompt, features) if interval is not None else None
                cost = float(predictor.predict(prompt, features))
                if not getattr(predictor, "is_cold_start", False):
                    return cost, "model", bounds, None
                # the cold start's guess is one request of the prompt's estimated tokens
                return cost, "cold_start", bounds, _one_request(estimate_tokens(prompt), cost)
            except Exception:
                log.exception("predictor for %r failed; using the request-size fallback", agent_type)
        # No predictor: a one-request agent of the prompt's size with 256 output tokens, as
        # uncertain as a cold start's guess (its promise allows for the same spread).
        p = max(1, len(prompt) // 4)
        cost = kv_cost(p, FALLBACK_OUTPUT_TOKENS)
        return cost, "fallback", (cost, cost * DEFAULT_P90_RATIO), \
            AgentShape(stages=1, critical_path_tokens=FALLBACK_OUTPUT_TOKENS)

    def get(self, agent_id: str, tenant: str) -> AgentEntry:
        entry = self.agents.get(agent_id)
        # Another tenant's agent is reported as unknown: its existence is not theirs to learn.
        if entry is None or entry.tenant != tenant:
            raise AgentNotFound(f"no agent {agent_id!r}")
        return entry

    def list(self, tenant: str) -> list[AgentEntry]:
        """The tenant's agents (live, and ended ones still kept), in registration order."""
        return list(self._by_tenant.get(tenant, {}).values())

    def page(self, tenant: str, limit: int, after: int = 0,
             state: str | None = None) -> tuple[builtins.list[AgentEntry], int | None]:
        """Up to `limit` of the tenant's agents registered after the one numbered `after`
        (`entry.seq`), and the number to continue after (None on the last page). O(log n +
        what it reads), whatever the tenant holds."""
        index = self._by_tenant.get(tenant)
        if index is None:
            return [], None
        out: list[AgentEntry] = []
        for seq in index.irange(minimum=after, inclusive=(False, True)):
            entry = index[seq]
            if state is not None and entry.state != state:
                continue
            if len(out) == limit:
                return out, out[-1].seq
            out.append(entry)
        return out, None

    def live_page(self, tenant: str, limit: int,
                  ) -> tuple[builtins.list[AgentEntry], int, int | None]:
        """The tenant's first `limit` live agents in registration order, how many more live
        agents it has, and the `seq` of the last one given (a GET /v1/agents cursor)."""
        out: list[AgentEntry] = []
        rest = 0
        for entry in self._by_tenant.get(tenant, {}).values():
            if entry.terminal:
                continue
            if len(out) < limit:
                out.append(entry)
            else:
                rest += 1
        return out, rest, out[-1].seq if out else None

    def record(self, entry: AgentEntry) -> AgentRecord:
        if entry.final_view is not None:
            view = entry.final_view
        else:
            view = self._view(entry)
        jct = entry.finished_at - entry.submitted_at if entry.state == "finished" and entry.finished_at else None
        return AgentRecord(
            id=entry.id,
            type=entry.type,
            tenant=entry.tenant,
            state=entry.state,
            predicted_cost=entry.predicted_cost,
            predicted_cost_p90=entry.cost_interval[1] if entry.cost_interval else None,
            consumed_cost=entry.consumed_kv_cost,
            requests_in_flight=entry.in_flight,
            submitted_at=entry.submitted_at,
            finished_at=entry.finished_at,
            first_eta_s=entry.first_eta_s,
            first_eta_interval_s=list(entry.first_eta_interval_s) if entry.first_eta_interval_s else None,
            session=entry.session,
            error=entry.error,
            cost_source=entry.cost_source,
            jct_s=jct,
            metadata=entry.meta(),
            metadata_dropped=entry.metadata_dropped,
            **view,
        )

    def _view(self, entry: AgentEntry) -> dict[str, Any]:
        v = self.dispatcher.view(entry.id, self.now())
        return {
            "virtual_finish": v.virtual_finish,
            "charged_cost": v.charged_cost,
            "requests_total": v.requests_total,
            "requests_done": v.requests_done,
            "fair_finish_s": v.fair_finish_s,
            "eta_s": v.eta_s,
            "eta_interval_s": v.eta_interval_s,
            "delay_bound_s": v.delay_bound_s,
            "delay_bound_terms": asdict(v.bound),
            "deadline_s": v.deadline_s,
            "promise": v.promise,
            "promise_reason": v.promise_reason,
            "promise_assumes": v.promise_assumes,
            "expected_cost": v.expected_cost,
        }

    async def finish(self, entry: AgentEntry, error: str | None = None) -> AgentEntry:
        """The agent is done: `finished`, or `failed` when its client reports an `error`
        (its code raised). Requests of it still in flight are orphans (the agent's code
        has returned or raised without them), so they are aborted, as on cancel.
        HistoryUnwritable (503) when its end cannot be made durable (docs/reliability.md)."""
        if self._refused_before(entry):
            return entry
        self.require_live(entry)
        self._check_history()
        state: AgentStateName = "finished" if error is None else "failed"
        if error is not None:
            entry.error = error[:MAX_ERROR_CHARS]
        if entry.in_flight:
            await self._cancel(entry, state)
        else:
            self._close(entry, state)
        await self._durable(entry)
        return entry

    async def cancel(self, entry: AgentEntry) -> AgentEntry:
        if self._refused_before(entry):
            return entry
        self.require_live(entry)
        self._check_history()
        await self._cancel(entry, "cancelled")
        await self._durable(entry)
        return entry

    def _refused_before(self, entry: AgentEntry) -> bool:
        """An end refused for want of a durable row, asked again: acknowledged once the row
        is written (True), refused again while it waits (HistoryUnwritable)."""
        return self._history_writer is not None and self._history_writer.refused(entry)

    def _check_history(self) -> None:
        if self._history_writer is not None:
            self._history_writer.check_writable()

    async def _durable(self, entry: AgentEntry) -> None:
        """Return once the agent's history row is committed: an agent the API reported
        ended is in the history even if the process is killed right after."""
        if self._history_writer is not None:
            await self._history_writer.durable(entry)

    async def _cancel(self, entry: AgentEntry, state: AgentStateName) -> None:
        entry.final_view = self._view(entry)
        now = self.now()
        if state in ("finished", "failed"):
            # Its GPS work stays charged (the agent ran); only its requests go.
            running = [rid for rid, r in self.dispatcher.requests.items()
                       if r.spec.agent_id == entry.id and r.status is RequestStatus.RUNNING]
            self.dispatcher.finish_agent(entry.id, now)
        else:
            running = self.dispatcher.cancel_agent(entry.id, now)
        self._close(entry, state, forget=False)
        self.admission.fail_waiting(AgentConflict(f"agent {entry.id} was {state}"), agent=entry)
        for request_id in running:
            # The engine ends the request with finish_reason "abort" and frees its KV.
            await self.engine.abort(request_id)
        self._pump()

    def require_live(self, entry: AgentEntry) -> None:
        if entry.terminal:
            raise AgentConflict(f"agent {entry.id} is {entry.state}")

    def _close(self, entry: AgentEntry, state: AgentStateName, forget: bool = True) -> None:
        """End the agent: its state changes (IllegalTransition, before anything else, if it
        had ended), the dispatcher forgets it (unless `forget` is False: the caller did),
        it leaves the live agents, and the listeners hear of it."""
        transition(entry, state, wall=self._wall(), now=self.now())
        if state == "finished" and entry.session is None and entry.first_eta_s is not None \
                and entry.finished_at is not None:
            # What the ETA intervals are calibrated on (a session's end comes after its idle
            # timeout, which no ETA forecasts).
            self.dispatcher.observe_jct(entry.first_eta_s, entry.finished_at - entry.submitted_at)
        if forget:
            entry.final_view = self._view(entry)
            self.dispatcher.finish_agent(entry.id, self.now())
        if entry.id in self._open:
            self._live_count[entry.tenant] -= 1
            self._held_bytes[entry.tenant] -= entry.held_bytes
        self._open.discard(entry.id)
        if entry.session is not None and self._sessions.get((entry.tenant, entry.session)) == entry.id:
            del self._sessions[(entry.tenant, entry.session)]
        self._ended.append(entry.id)
        self.listeners.on_agent_ended(entry)
        # The listeners have taken what they need (the history row is queued with them):
        # an ended agent keeps only what its record shows.
        entry.let_go()
        entry.touch()

    async def _expire_idle_agents(self) -> None:
        now = self.now()
        for agent_id in list(self._open):
            entry = self.agents[agent_id]
            if entry.terminal or entry.in_flight:
                continue
            if entry.session is not None and now - entry.last_activity_mono > self.config.session_idle_s:
                # A session has no finish call: its idleness is its end, a normal one.
                log.info("session agent %s finished after %.0f s idle", entry.id, now - entry.last_activity_mono)
                self._close(entry, "finished")
                continue
            lease = entry.lease_s or self.config.lease_s
            if now - entry.last_activity_mono > lease:
                log.info("agent %s expired after %.0f s without activity", entry.id,
                         now - entry.last_activity_mono)
                await self._cancel(entry, "expired")

    def _prune(self) -> None:
        now = self.now()
        while self._ended:
            entry = self.agents.get(self._ended[0])
            if entry is not None and now - entry.last_activity_mono <= self.config.retention_s:
                break
            self._ended.popleft()
            self.agents.pop(entry.id if entry else "", None)
            if entry is not None:
                index = self._by_tenant.get(entry.tenant)
                if index is not None:
                    index.pop(entry.seq, None)
                    if not index:
                        del self._by_tenant[entry.tenant]

    # -- requests -----------------------------------------------------------------
    async def run(
        self,
        entry: AgentEntry,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingOptions,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Queue one request of `entry`, wait for admission, then stream it from the engine.

        Whatever ends the request (completion, a cancelled consumer, the agent's cancel,
        an engine error) its real usage is accounted and the next requests are admitted.
        """
        self.require_live(entry)
        now = self.now()
        spec = RequestSpec(request_id, entry.id, prompt_tokens=len(prompt_token_ids),
                           max_tokens=sampling.max_tokens, n=sampling.n, prefix=self._prefix(prompt_token_ids))
        try:
            ticket = self.admission.submit(entry, spec, now)
        except QuotaExceeded:
            if entry.auto and entry.in_flight == 0:  # its one request was refused
                self._close(entry, "cancelled")
            raise
        entry.in_flight += 1
        entry.last_activity_mono = now
        entry.touch()
        last: EngineOutput | None = None
        try:
            self._pump()
            await ticket.opened.wait()
            if ticket.error is not None:
                raise ticket.error
            if entry.state == "queued":
                transition(entry, "running", wall=self._wall(), now=self.now())
                entry.touch()
            request = EngineRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling,
                priority=self.dispatcher.priority(entry.id, request_id),
            )
            async with contextlib.aclosing(self.engine.generate(request)) as outputs:
                async for out in outputs:
                    if entry.state in ABANDONED and not out.finished:
                        continue  # the engine is still flushing outputs; only the end matters
                    last = out
                    yield out
            if entry.state in ABANDONED:
                raise AgentConflict(f"agent {entry.id} was {entry.state}")
        finally:
            self._settle(ticket, last)

    def _prefix(self, prompt_token_ids: tuple[int, ...]) -> tuple[PrefixRef, ...]:
        """The prompt's whole blocks as a prefix chain (block hashes, as vLLM's prefix cache
        keys them, in units of `Dispatcher.prefix_block` tokens): requests with a common head
        share it in admission and charges. The prefix-blind ablation (and a prompt of one
        unit) skips the hashing."""
        unit = self.dispatcher.prefix_block
        if not self.dispatcher.policy.prefix_aware or len(prompt_token_ids) <= unit:
            return ()
        return block_chain(prompt_token_ids, unit)

    def _settle(self, ticket: Ticket, last: EngineOutput | None) -> None:
        """Whatever ended the request: account its real usage, log it in its agent, end an
        untagged request's agent, and admit the next requests."""
        entry = ticket.agent
        now = self.now()
        self.admission.settle(ticket)
        d = last.output_tokens if last is not None else 0  # over all its sequences
        each = tuple(q.output_tokens for q in last.sequences) if last is not None else ()
        if ticket.request_id in self.dispatcher.requests:
            self.dispatcher.on_request_finished(ticket.request_id, ticket.prompt_tokens, d, now,
                                                each=each,
                                                cached_tokens=last.cached_tokens if last is not None else None)
            # the scheduler counts what its agents consume; the entry keeps its count
            entry.consumed_kv_cost = self.dispatcher.agents[entry.id].consumed_kv
        entry.in_flight -= 1
        entry.last_activity_mono = now
        if ticket.admitted is not None:
            entry.requests.append(RequestLog(
                request_id=ticket.request_id,
                prompt_tokens=ticket.prompt_tokens,
                output_tokens=d,
                submitted_s=ticket.submitted - entry.submitted_mono,
                admitted_s=ticket.admitted - entry.submitted_mono,
                finished_s=now - entry.submitted_mono,
                finish_reason=last.finish_reason if last is not None else None,
                preemptions=last.num_preemptions if last is not None else 0,
                cached_tokens=last.cached_tokens if last is not None else None,
            ))
        if last is not None:
            self.listeners.on_request_finished(entry, last)
        entry.touch()
        if entry.auto and not entry.terminal and entry.in_flight == 0:
            self._close(entry, "finished")
        elif ticket.admitted is not None and entry.id in self.dispatcher.agents:
            self._repredict(entry, now)
        self._pump()

    def _repredict(self, entry: AgentEntry, now: float) -> None:
        """After each of its requests: re-estimate the agent's total cost from what it has
        consumed and the stages it has done (server/scheduler/reprediction.py). A stage ends
        when no request of the agent is in flight any more. ETAs use the estimate; the
        agent's tag does not move for it."""
        if entry.in_flight == 0:
            entry.stages_done += 1
        p50, p90 = entry.cost_interval or (None, None)
        total = expected_total(entry.predicted_cost, entry.consumed_kv_cost, p50=p50, p90=p90,
                               stages_done=entry.stages_done, stages=entry.declared_stages)
        self.dispatcher.repredict(entry.id, total, now)

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
        snap["time_model"] = self.time_models.describe()
        snap["recalled"] = asdict(self.recalled)
        return snap

    def _on_agent_change(self, entry: AgentEntry) -> None:
        for feed in self._feeds.get(entry.tenant, ()):
            if feed.ids is None or entry.id in feed.ids:
                feed.dirty.add(entry.id)
                feed.wake.set()

    async def watch(
        self,
        tenant: str,
        ids: frozenset[str] | None = None,
        *,
        interval_s: float = 0.25,
        heartbeat_s: float = 15.0,
        initial: builtins.list[AgentEntry] | None = None,
    ) -> AsyncIterator[builtins.list[AgentRecord] | None]:
        """The records of a tenant's agents (all, or those in `ids`) as they change: first
        the live ones, then at most one batch per `interval_s` of those that changed (None:
        heartbeat). One stream serves a whole batch of agents, so a client watching 10,000
        agents holds one connection, and the records it is sent are bounded by the number
        of agents that change, not by the number of changes."""
        feed = _Feed(tenant, ids)
        self._feeds.setdefault(tenant, set()).add(feed)
        try:
            if initial is not None:  # the caller's choice (a bounded snapshot)
                pass
            elif ids is None:
                initial = [e for e in self.list(tenant) if not e.terminal]
            else:
                initial = [e for i in ids if (e := self.agents.get(i)) and e.tenant == tenant]
            yield [self.record(e) for e in initial]
            while True:
                try:
                    await asyncio.wait_for(feed.wake.wait(), heartbeat_s)
                except TimeoutError:
                    yield None
                    continue
                await asyncio.sleep(interval_s)
                feed.wake.clear()
                dirty, feed.dirty = feed.dirty, set()
                records = [self.record(e) for i in dirty if (e := self.agents.get(i)) is not None]
                if records:
                    yield records
        finally:
            feeds = self._feeds.get(tenant)
            if feeds is not None:
                feeds.discard(feed)
                if not feeds:
                    del self._feeds[tenant]

    async def events(self, entry: AgentEntry, heartbeat_s: float = 15.0) -> AsyncIterator[AgentRecord | None]:
        """The record now and after every change, until the agent ends (None: heartbeat)."""
        while True:
            changed = entry.next_change()
            yield self.record(entry)
            if entry.terminal:
                return
            try:
                await asyncio.wait_for(changed.wait(), heartbeat_s)
            except TimeoutError:
                yield None


def _held_bytes(prompt: str, metadata_json: bytes) -> int:
    """What a live agent holds of its caller's data in memory (--max-agent-bytes): its kept
    prompt (the string's own size: 1, 2 or 4 bytes a character) and its metadata's JSON."""
    return sys.getsizeof(prompt) + sys.getsizeof(metadata_json)


def _one_request(prompt_tokens: int, cost: float) -> AgentShape:
    """The shape of one request of `prompt_tokens` whose KV cost is `cost` (the cold start
    reports its guess's cost, not the output length it assumed)."""
    return AgentShape(stages=1, critical_path_tokens=decode_for_kv_cost(prompt_tokens, cost))


def _batch_declared(metadata: dict[str, Any], tenant: str | None) -> BatchDeclaration | None:
    """The batch an agent's client declared it part of (`metadata["batch"]`: its `id`, its
    `size` and the agent's `index` in it, as the SDK sends), for the ETAs to expect the
    inputs the client still holds back; None where the declaration is missing or malformed."""
    batch = metadata.get("batch")
    if not isinstance(batch, dict):
        return None
    batch_id, size, index = batch.get("id"), batch.get("size"), batch.get("index")
    if not isinstance(batch_id, str) or not batch_id or type(size) is not int or size < 1:
        return None
    # by tenant: one tenant's declaration never counts toward another's batch of the same id
    return BatchDeclaration(f"{tenant}/{batch_id[:64]}", size,
                            index if type(index) is int and index >= 0 else None)


def _shape(metadata: dict[str, Any]) -> AgentShape | None:
    """An agent may declare its structure (`stages`, `critical_path_tokens`, and for its ETA
    `prefill_tokens`) in its metadata; the bound then covers its own critical path instead
    of a one-stage guess."""
    stages = metadata.get("stages")
    cp = metadata.get("critical_path_tokens")
    prefill = metadata.get("prefill_tokens")
    if isinstance(stages, int) and stages >= 1:
        return AgentShape(stages=stages, critical_path_tokens=cp if isinstance(cp, int) else None,
                          prefill_tokens=prefill if isinstance(prefill, int) else None)
    return None
