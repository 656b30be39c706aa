"""The dispatcher: holds pending requests and hands them to the engine in policy order.

One object drives both the simulator and the live server. It never reads a clock and does no
I/O: callers pass `now` (seconds, non-decreasing) and the engine's state when they have it.

Life of an agent, as the live server sees it (it does not know future stages):

    disp = Dispatcher("justitia", kv_capacity_tokens=45_000, iteration_time_s=0.025)
    view = disp.register_agent("a17", predicted_cost=3.2e6, now=t)    # tag F = V(t) + C
    disp.submit(RequestSpec("r1", "a17", prompt_tokens=812, max_tokens=256), now=t)
    for spec in disp.admit(now=t, engine_free_kv_tokens=free):          # in order
        engine.add(spec, priority=disp.priority(spec.agent_id, spec.request_id))
    disp.on_request_finished("r1", prompt_tokens=812, output_tokens=120, now=t2)
    disp.finish_agent("a17", now=t3)   # or: ids = disp.cancel_agent("a17", now); engine.abort(ids)

A request is PENDING in the policy's queue (queues.py), RUNNING once admitted (its footprint
reserved), and leaves the table when it finishes or its agent goes (state.py). `admit` is one
loop over the queue: compute the budget, then peek at the next request, check that it fits,
pop it and mark it running.

Accounting: `reserved_kv` (footprints of admitted, unfinished requests), the pending queue and
the agent table return to zero once every agent is finished or cancelled.

Over-runs: an agent is charged its predicted cost when it arrives. Every request adds its
estimated cost to the agent's *committed* cost when submitted, and is corrected to its real
cost when it finishes. Whenever committed exceeds charged, the excess is charged too, with
WFQ's rule for new work: F = max(F, V(now)) + excess. So an agent that under-predicts falls
back in the queue as soon as the excess is visible; it never runs ahead for free. Under-runs
are not refunded (an agent's GPS share is fixed once charged).

Stateful policies (vtc, ewsjf, equinox) get their own instance (`Policy.bind(seed)`) and hear
about every request through hooks: `on_submit`, `on_admit`, `on_finish` (with the true lengths
and `now`), `on_drop`. The hooks receive the dispatcher as a `SchedulerContext` (tau,
compute_per_kv, leader), nothing more. `is_idle()` also asks the policy whether its own
bookkeeping (queued requests, provisional charges) is back to zero.

Events (register, submit, admit, finish, cancel) advance the virtual clock to `now`; reads
(`view`, `fair_finish_time`, `snapshot`) do not. docs/architecture.md shows the modules.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from .bounds import AgentShape, BoundLimits, delay_bound
from .cost import COMPUTE, compute_cost, cost_function, kv_cost, kv_footprint
from .policies import FOOTPRINT, Policy, get_policy
from .queues import RequestQueue
from .state import (
    AgentState,
    AgentView,
    CostMix,
    ObservedLimits,
    RequestSpec,
    RequestState,
    RequestStatus,
)
from .virtual_clock import VirtualClock

__all__ = ["AgentState", "AgentView", "Dispatcher", "RequestSpec", "RequestState", "RequestStatus"]

RUNNING = RequestStatus.RUNNING
DONE = RequestStatus.DONE


class Dispatcher:
    """Policy-ordered admission of requests into an engine with M tokens of KV cache."""

    def __init__(
        self,
        policy: str | Policy,
        kv_capacity_tokens: int,
        iteration_time_s: float,
        *,
        limits: BoundLimits | None = None,
        backfill: bool = False,
        backfill_depth: int = 32,
        now: float = 0.0,
        block_size: int = 1,
        seed: int = 0,
    ) -> None:
        # A stateful policy (ewsjf, equinox) gets an instance of its own, seeded.
        self.policy = (get_policy(policy) if isinstance(policy, str) else policy).bind(seed)
        self._hooked = self.policy.hooked
        if kv_capacity_tokens <= 0 or iteration_time_s <= 0:
            raise ValueError("kv_capacity_tokens and iteration_time_s must be positive")
        self.kv_capacity = int(kv_capacity_tokens)
        self.tau = float(iteration_time_s)
        self.backfill = backfill
        # A paged engine allocates whole blocks: a request holds ceil((p + d) / block) blocks,
        # so footprints are rounded up to blocks, or the engine runs out before M does.
        self.block_size = max(1, int(block_size))
        self.backfill_depth = backfill_depth
        self._declared_limits = limits
        self._observed = ObservedLimits()
        self._cost = cost_function(self.policy.cost_model)
        # justitia-c keeps its clock in compute tokens; its rate is M/tau converted with the
        # compute/KV ratio of the requests submitted so far (1/256 before any).
        self._mix = CostMix()
        self.clock = VirtualClock(rate=self._rate(), now=now)
        self.agents: dict[str, AgentState] = {}
        self.requests: dict[str, RequestState] = {}
        self._seq = itertools.count()
        self.queue: RequestQueue = self.policy.make_queue(self, backfill_depth if backfill else 0)
        self.reserved_kv = 0  # footprints of admitted, unfinished requests
        self.reserved_prompt = 0  # prompts of admitted, unfinished requests
        self.pending_count = 0
        self.running_count = 0

    # -- rate and capacity ------------------------------------------------------
    def _rate(self) -> float:
        rate = self.kv_capacity / self.tau
        if self.policy.cost_model == COMPUTE:
            rate *= self.compute_per_kv
        return rate

    @property
    def compute_per_kv(self) -> float:
        """Compute tokens (p + 2d) per unit of KV token-time over the requests submitted so
        far (1/256 before any): converts one cost model into the other."""
        return self._mix.compute_per_kv

    @property
    def rate(self) -> float:
        """R: cost units per second at full memory."""
        return self.clock.rate

    def set_iteration_time(self, tau: float, now: float) -> None:
        """A new measured iteration time: R = M / tau from `now` on."""
        if tau <= 0:
            raise ValueError("tau must be positive")
        self.tau = float(tau)
        self.clock.set_rate(self._rate(), now)

    def set_kv_capacity(self, kv_capacity_tokens: int, now: float) -> None:
        """Replicas added or removed: new M (and R) from `now` on."""
        if kv_capacity_tokens <= 0:
            raise ValueError("kv capacity must be positive")
        self.kv_capacity = int(kv_capacity_tokens)
        self.clock.set_rate(self._rate(), now)

    @property
    def limits(self) -> BoundLimits:
        """Declared workload limits, or the largest costs seen so far."""
        if self._declared_limits is not None:
            return self._declared_limits
        return self._observed.as_limits()

    # -- agents -----------------------------------------------------------------
    def register_agent(
        self,
        agent_id: str,
        predicted_cost: float,
        now: float,
        *,
        agent_type: str | None = None,
        predicted_compute_cost: float | None = None,
        shape: AgentShape | None = None,
    ) -> AgentView:
        """Admit an agent with its predicted KV cost: its tag is F = V(now) + cost."""
        if agent_id in self.agents:
            raise ValueError(f"agent {agent_id!r} is already registered")
        predicted_cost = max(0.0, float(predicted_cost))
        charge = predicted_cost
        if self.policy.cost_model == COMPUTE:
            if predicted_compute_cost is None:
                predicted_compute_cost = predicted_cost * self.compute_per_kv
            charge = max(0.0, float(predicted_compute_cost))
        self._observed.max_agent_cost = max(self._observed.max_agent_cost, predicted_cost)
        shape = shape or AgentShape()
        tag = self.clock.arrive(agent_id, charge, now)
        agent = AgentState(
            agent_id=agent_id,
            seq=next(self._seq),
            agent_type=agent_type,
            submitted_at=now,
            predicted_cost=predicted_cost,
            charged_cost=charge,
            virtual_finish=tag,
            bound=delay_bound(self.limits, shape, self.kv_capacity, self.tau),
            shape=shape,
        )
        self.agents[agent_id] = agent
        return self.view(agent_id, now)

    def finish_agent(self, agent_id: str, now: float) -> AgentView:
        """The agent is done: forget it (pending requests, if any, are dropped)."""
        self._agent(agent_id)
        self.clock.advance(now)  # an event, like every update: the clock moves to `now`
        view = self.view(agent_id, now)
        self._drop(agent_id, now, cancel=False)
        return view

    def cancel_agent(self, agent_id: str, now: float) -> list[str]:
        """Cancel an agent: returns the ids of its running requests, to abort in the engine."""
        return self._drop(agent_id, now, cancel=True)

    def _drop(self, agent_id: str, now: float, cancel: bool) -> list[str]:
        agent = self._agent(agent_id)
        running: list[str] = []
        pending: list[RequestState] = []
        for rid in sorted(agent.request_ids, key=lambda r: self.requests[r].seq):
            req = self.requests.pop(rid)
            if self._hooked:
                self.policy.on_drop(self, agent, req)
            if req.status is RUNNING:
                running.append(rid)
                self._release(req)
            else:
                self.pending_count -= 1
                pending.append(req)
        self.queue.remove_agent(agent, pending)
        for req in pending:
            req.status = DONE
        agent.pending = 0
        agent.request_ids.clear()
        agent.running = 0
        if cancel:
            self.clock.remove(agent_id, now)  # its GPS work disappears
        self.clock.forget(agent_id)
        del self.agents[agent_id]
        return running

    # -- requests ---------------------------------------------------------------
    def submit(self, spec: RequestSpec, now: float) -> None:
        """Queue a request of a registered agent."""
        agent = self._agent(spec.agent_id)
        if spec.request_id in self.requests:
            raise ValueError(f"request {spec.request_id!r} already submitted")
        p, d, n = int(spec.prompt_tokens), spec.expected_tokens, spec.n
        req = RequestState(
            spec=spec,
            seq=next(self._seq),
            submitted_at=now,
            footprint=n * (-(-kv_footprint(p, d) // self.block_size) * self.block_size),
            est_cost=n * self._cost(p, d),
            est_kv_cost=n * kv_cost(p, d),
        )
        req.order = self.policy.request_order(req)
        self._mix.compute += n * compute_cost(p, d)
        self._mix.kv += req.est_kv_cost
        if self.policy.cost_model == COMPUTE:
            self.clock.set_rate(self._rate(), now)
        observed = self._observed
        observed.max_request_cost = max(observed.max_request_cost, req.est_kv_cost)
        observed.max_output_tokens = max(observed.max_output_tokens, spec.max_tokens)
        self.requests[spec.request_id] = req
        agent.request_ids.add(spec.request_id)
        agent.requests_total += 1
        first = agent.pending == 0
        agent.pending += 1
        self.pending_count += 1
        self.queue.push(agent, req)
        if self._hooked:
            self.policy.on_submit(self, agent, req, now, first)
        self._commit(agent, req.est_cost, now)
        self.queue.requeue(agent)

    def on_request_finished(self, request_id: str, prompt_tokens: int, output_tokens: int,
                            now: float, each: Sequence[int] = ()) -> bool:
        """A request left the engine: release its reservation and account its real cost.

        `output_tokens` is the total over the request's sequences; `each` the output of each
        sequence when it sampled several (`n` > 1): each one is charged as one request.

        Returns False (and does nothing) for an id the dispatcher no longer knows: a request
        of a cancelled agent whose abort raced with its completion.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        agent = self._agent(req.spec.agent_id)
        agent.request_ids.discard(request_id)
        if req.status is RUNNING:
            self._release(req)
            agent.running -= 1
            if self._hooked:
                self.policy.on_finish(self, agent, req, prompt_tokens, output_tokens, now)
        else:  # finished without being admitted (e.g. rejected): just drop it
            if self._hooked:
                self.policy.on_drop(self, agent, req)
            self.queue.remove(agent, req)
            req.status = DONE
            agent.pending -= 1
            self.pending_count -= 1
        lengths = each or (output_tokens,)
        real = sum(self._cost(prompt_tokens, d) for d in lengths)
        agent.consumed_cost += real
        agent.consumed_kv += sum(kv_cost(prompt_tokens, d) for d in lengths)
        agent.requests_done += 1
        self._commit(agent, real - req.est_cost, now)
        self.queue.requeue(agent)
        return True

    def _commit(self, agent: AgentState, delta: float, now: float) -> None:
        """Add to the agent's committed cost; charge any excess over what it was charged."""
        agent.committed_cost += delta
        excess = agent.committed_cost - agent.charged_cost
        if excess > 1e-9 * max(1.0, agent.charged_cost):
            agent.virtual_finish = self.clock.extend(agent.agent_id, agent.virtual_finish, excess, now)
            agent.charged_cost += excess
            agent.bound = delay_bound(self.limits, agent.shape, self.kv_capacity, self.tau)

    # -- admission --------------------------------------------------------------
    def admit(
        self,
        now: float,
        engine_free_kv_tokens: int | None = None,
        engine_free_slots: int | None = None,
        place: Callable[[RequestSpec, int], bool] | None = None,
    ) -> list[RequestSpec]:
        """The requests to hand to the engine now, in order.

        Footprint policies reserve p + expected d against min(M - reserved, engine free) and
        stop at the first request that does not fit (strict order; optional backfill).
        With several engine replicas, room in the sum is not enough (a request cannot span
        replicas): `place(spec, footprint)` must also find it a replica, and reserves there.
        Prompt policies admit while the prompt fits in free memory (the engine's report, or M
        minus admitted prompts) and leave preemption to the engine.
        """
        self.clock.advance(now)
        footprint = self.policy.admission == FOOTPRINT
        free = self._budget(footprint, engine_free_kv_tokens)
        slots = engine_free_slots
        queue = self.queue
        out: list[RequestSpec] = []
        while slots is None or slots > 0:
            req = queue.peek(now)
            if req is None:
                break
            need = req.footprint if footprint else req.spec.prompt_tokens + 1
            fits = need <= free
            if fits and footprint and place is not None:
                # several replicas: one of them must hold the whole request (it reserves there)
                fits = place(req.spec, req.footprint)
            # An idle engine takes the head whatever its size: nothing would ever free room.
            if not fits and (self.running_count or out):
                if queue.defer():  # backfill: look past the blocked agent (restored below)
                    continue
                break
            agent = self.agents[req.spec.agent_id]
            queue.pop(agent, req)
            self._mark_running(agent, req, now)
            queue.requeue(agent)
            free -= need
            if slots is not None:
                slots -= 1
            out.append(req.spec)
        queue.restore()
        return out

    def _budget(self, footprint: bool, engine_free_kv_tokens: int | None) -> int:
        """Memory the next admissions may take: footprints against M (and what the engine
        reports free), or prompts against the engine's free memory."""
        if footprint:
            free = self.kv_capacity - self.reserved_kv
        else:
            free = self.kv_capacity - self.reserved_prompt
        if engine_free_kv_tokens is not None:
            free = min(free, engine_free_kv_tokens) if footprint else engine_free_kv_tokens
        return free

    def _mark_running(self, agent: AgentState, req: RequestState, now: float) -> None:
        req.status = RUNNING
        agent.pending -= 1
        agent.running += 1
        self.pending_count -= 1
        self.running_count += 1
        self.reserved_kv += req.footprint
        self.reserved_prompt += req.spec.prompt_tokens
        if self._hooked:
            self.policy.on_admit(self, agent, req, now)

    def _release(self, req: RequestState) -> None:
        self.reserved_kv -= req.footprint
        self.reserved_prompt -= req.spec.prompt_tokens
        self.running_count -= 1
        req.status = DONE

    def leader(self) -> AgentState | None:
        """The agent whose head request is admitted next (agent-keyed queues), or None."""
        return self.queue.leader()

    # -- views ------------------------------------------------------------------
    def _agent(self, agent_id: str) -> AgentState:
        try:
            return self.agents[agent_id]
        except KeyError:
            raise KeyError(f"unknown agent {agent_id!r}") from None

    def priority(self, agent_id: str, request_id: str | None = None) -> int:
        """An int rank for vLLM's priority scheduling; lower runs first."""
        agent = self._agent(agent_id)
        req = self.requests.get(request_id) if request_id is not None else None
        return self.policy.priority(agent, req)

    def fair_finish_time(self, agent_id: str, now: float) -> float:
        """GPS finish time of the agent projected from now (no further arrivals).
        A read: the clock does not move."""
        agent = self._agent(agent_id)
        return self.clock.finish_time(agent_id, agent.virtual_finish, now)

    def eta_time(self, agent_id: str, now: float) -> float:
        """Projected finish under the running policy: the work ordered at or before the
        agent, served at R, and no sooner than its own remaining critical path."""
        agent = self._agent(agent_id)
        key = self.policy.static_key(agent)
        ahead = 0.0
        for other in self.agents.values():
            if other is agent or self.policy.static_key(other) <= key:
                ahead += max(0.0, other.charged_cost - other.consumed_cost)
        own = agent.bound.critical_path_s * (1.0 - agent.requests_done / max(1, agent.requests_total))
        return now + max(ahead / self.rate, own)

    def view(self, agent_id: str, now: float) -> AgentView:
        """The agent's record: tag, costs and times (seconds from its submission)."""
        agent = self._agent(agent_id)
        fair = self.fair_finish_time(agent_id, now) - agent.submitted_at
        bound = agent.bound.total_s
        return AgentView(
            agent_id=agent_id,
            agent_type=agent.agent_type,
            submitted_at=agent.submitted_at,
            predicted_cost=agent.predicted_cost,
            charged_cost=agent.charged_cost,
            consumed_cost=agent.consumed_cost,
            virtual_finish=agent.virtual_finish,
            fair_finish_s=fair,
            eta_s=self.eta_time(agent_id, now) - agent.submitted_at,
            delay_bound_s=bound,
            deadline_s=fair + bound,
            bound=agent.bound,
            requests_total=agent.requests_total,
            requests_done=agent.requests_done,
            pending=agent.pending,
            running=agent.running,
        )

    def snapshot(self, now: float, max_queue: int = 50) -> dict:
        """Plain-data state: policy, V, M, tau, backlog, queue (head first) with tags.
        A read: the clock does not move."""
        gps = self.clock.peek(now)
        queued = sorted((a for a in self.agents.values() if a.pending), key=self._queue_key)
        return {
            "policy": self.policy.name,
            "now": now,
            "V": gps.V,
            "M": self.kv_capacity,
            "tau": self.tau,
            "rate": self.rate,
            "backlog": gps.backlog,
            "agents": len(self.agents),
            "pending_requests": self.pending_count,
            "running_requests": self.running_count,
            "reserved_kv": self.reserved_kv,
            "limits": dataclasses.asdict(self.limits),
            "queue": [
                {
                    "agent_id": a.agent_id,
                    "virtual_finish": a.virtual_finish,
                    "priority": self.policy.priority(a, self.queue.head(a)),
                    "pending": a.pending,
                    "running": a.running,
                }
                for a in queued[:max_queue]
            ],
        }

    def _queue_key(self, agent: AgentState) -> Any:
        head = self.queue.head(agent)
        if head is not None:
            return self.policy.agent_key(agent, head)
        return self.policy.static_key(agent)  # a queue of requests, not agents (ewsjf)

    def is_idle(self) -> bool:
        """True when no agent, request or reservation is left (accounting back to zero)."""
        return (
            not self.agents
            and not self.requests
            and self.reserved_kv == 0
            and self.reserved_prompt == 0
            and self.pending_count == 0
            and self.running_count == 0
            and self.policy.is_idle()
        )
