"""Retention on the live server: a paused agent's context kept in vLLM's prefix cache while
the scheduler core's rule (server/scheduler/retention.py) says keeping it pays.

vLLM offers no pin. It keeps a finished request's blocks cached, on a free queue, and takes
the *least recently released* of them first when it needs memory. Two things therefore keep
a paused agent's context resident:

* **Admission leaves room for it.** The context's blocks are charged in the KV ledger
  (`KvLedger.pinned_kv`) for as long as it is kept, so the dispatcher never admits work that
  needs that memory: the engine's free blocks always include them.
* **It stays recently used.** Leaving room is not enough: a request admitted into free memory
  takes the blocks at the head of vLLM's free queue, which are the paused context's once the
  blocks released before it are used up (those released after it queue behind it). So the
  server counts the memory admitted since the context was last put at the tail (the free
  memory then, less its own blocks, is what stands ahead of it) and, when half of that is
  used, *touches* it: a one-token request of the context itself (`max_tokens=1`), whose
  prefill hits the cache and whose end releases the blocks again at the tail.

When the rule stops keeping it (the pause outlasted what pays), when the agent comes back
(its next request finds the context cached; what it resent is learned per type), or when an
agent ahead of it in virtual-finish order has waited long enough for the memory
(`pins_to_release`), the charge
ends and the tokens held times the seconds held are charged to the agent's KV token-time.
With `never` (policy `justitia-noretain`, or a policy that does not keep contexts) nothing is
kept, and a paused agent's context is left to vLLM's LRU.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.engine.base import Engine, EngineOutput, EngineRequest, SamplingOptions
from server.scheduler import Dispatcher
from server.scheduler.policies import FOOTPRINT
from server.scheduler.retention import (
    Pin,
    Retention,
    charge_retained,
    check_mode,
    fair_order,
    head_need,
    hold_charge,
    pins_to_release,
)
from server.scheduler.time_model import TimeModelBank

log = logging.getLogger("justitia.retain")

# A kept context is touched once the memory admitted since it was last put at the tail of
# vLLM's free queue reaches this share of what stood ahead of it then (a margin for the
# engine's report lagging a step and for footprints that are estimates).
TOUCH_AT = 0.5


@dataclass
class _Kept:
    sequences: list[tuple[int, ...]]
    tokens: int  # KV tokens charged (whole blocks)
    since: float
    until: float
    ahead: float  # free KV tokens ahead of it in vLLM's free queue when it was last released
    admitted_at: int  # the admitted-token count then
    timer: asyncio.TimerHandle | None = None


@dataclass
class LiveRetention:
    """The kept contexts of one live server."""

    rule: Retention
    dispatcher: Dispatcher
    engine: Engine
    now: Callable[[], float]
    block_size: int
    # What the engine can say of its free memory (None: the ledger's estimate is used).
    free_kv: Callable[[], float | None] = lambda: None
    # The engine's prefill time per token (its fitted step-time model, else the prior).
    prefill_token_s: Callable[[], float] = lambda: 0.0
    # The engine's fixed time per step: a touch runs one step after it is sent at the soonest.
    step_s: Callable[[], float] = lambda: 0.0
    kept: dict[str, _Kept] = field(default_factory=dict)
    # The sequences each agent's current stage left (prompt and generated ids), and their
    # sizes, until its next stage starts.
    stage_sequences: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    admitted_tokens: int = 0  # footprints admitted since the start
    touches: int = 0
    yields: int = 0
    blocked: tuple[str, float] | None = None  # the head of the queue that did not fit, since when
    held_token_s: float = 0.0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _ids: Any = field(default_factory=itertools.count)

    @classmethod
    def of(cls, mode: str, dispatcher: Dispatcher, engine: Engine, time_models: TimeModelBank,
           now: Callable[[], float]) -> LiveRetention:
        """The live server's: `mode` for policies that keep contexts (never for the others),
        c from the engine's fitted step-time model (the one with the most steps, else the
        prior), free memory as the engine reports it (cached blocks no request holds are
        free)."""
        mode = check_mode(mode) if dispatcher.policy.retains else "never"

        def model() -> Any:
            models = time_models.models()
            return max(models.values(), key=lambda m: m.samples) if models else time_models.prior

        def prefill_token_s() -> float:
            return max(0.0, float(model().per_prefill_token_s))

        def step_s() -> float:
            return max(0.0, float(model().base_s))

        def free_kv() -> float:
            return (1.0 - engine.stats().kv_usage) * dispatcher.kv_capacity

        return cls(Retention(mode, dispatcher.pauses), dispatcher, engine, now, engine.info.block_size,
                   free_kv=free_kv, prefill_token_s=prefill_token_s, step_s=step_s)

    @property
    def active(self) -> bool:
        return self.rule.active

    # -- what the request path tells ------------------------------------------------------
    def request_done(self, agent_id: str, prompt: tuple[int, ...], out: EngineOutput) -> None:
        """A request of the agent finished: its sequence is what a kept context holds."""
        if not self.active or out.finish_reason == "abort":
            return
        seqs = out.each()
        generated = seqs[0].token_ids if len(seqs) == 1 else ()
        self.stage_sequences.setdefault(agent_id, []).append(tuple(prompt) + tuple(generated))

    def paused(self, agent_id: str) -> None:
        """The agent has nothing in flight: keep what its stage left while the rule says so."""
        self._release(agent_id)
        if self.active:
            self._keep(agent_id)

    def _keep(self, agent_id: str) -> None:
        agent = self.dispatcher.agents.get(agent_id)
        sequences = self.stage_sequences.get(agent_id)
        if agent is None or not sequences:
            return
        now = self.now()
        until = self._until(agent_id)
        if until is None or until <= now:
            return
        tokens = sum(self._blocks(len(s) - 1) for s in sequences)
        if tokens <= 0:
            return
        kept = _Kept(sequences, tokens, since=now, until=until, ahead=0.0, admitted_at=self.admitted_tokens)
        self._mark_released(kept)
        self.kept[agent_id] = kept
        self.dispatcher.ledger.pinned_kv += tokens
        self._schedule_expiry(agent_id, kept)

    def reconsider(self, agent_id: str) -> None:
        """Something changed what the pause is expected to be (a tool call announced, which
        its client does as the pause begins): keep the context from now if the rule now says
        so, let it go if it no longer does."""
        kept = self.kept.get(agent_id)
        if kept is None:
            agent = self.dispatcher.agents.get(agent_id)
            if self.active and agent is not None and agent.idle_since is not None:
                self._keep(agent_id)
            return
        until = self._until(agent_id)
        if until is None or until <= self.now():
            self._release(agent_id)
            return
        kept.until = until
        self._schedule_expiry(agent_id, kept)

    def resumed(self, agent_id: str, agent_type: str | None, prompt: tuple[int, ...]) -> None:
        """The agent sends its next request: learn how much of what it left it resends, and
        let its context go (the request finds it cached, and is admitted in its order)."""
        sequences = self.stage_sequences.pop(agent_id, None)
        if sequences:
            left = sum(len(s) for s in sequences)
            resent = max(_common_prefix(prompt, s) for s in sequences)
            self.rule.reuse.observe(agent_type, resent, left)
        self._release(agent_id)

    def forget(self, agent_id: str, finished_type: str | None = None) -> None:
        """The agent ended: nothing of it is kept, nothing more is charged. An agent that
        finished (`finished_type`: its type) after a pause resent nothing of what its last
        stage left: that pause counts as one without reuse, so a type whose agents end
        after a single request (or whose last pause is the end) is not kept for a resend
        that never comes."""
        sequences = self.stage_sequences.pop(agent_id, None)
        if sequences and finished_type is not None:
            self.rule.reuse.observe(finished_type, 0, sum(len(s) for s in sequences))
        kept = self.kept.pop(agent_id, None)
        if kept is not None:
            self._unpin(kept)

    # -- admission ---------------------------------------------------------------------------
    def make_way(self, now: float) -> bool:
        """The head of the queue does not fit: the kept contexts of agents behind it in the
        fair order give way, the furthest behind first, as few as suffice, once it has waited
        for memory long enough (`pins_to_release`). True when some did."""
        if not self.kept:
            return False
        d = self.dispatcher
        head = head_need(d, now)
        if head is None:
            return False
        agent_id, need = head
        footprint = d.policy.admission == FOOTPRINT
        free = d.ledger.budget(d.kv_capacity, footprint, None)
        if need <= free:
            return False
        if self.blocked is None or self.blocked[0] != agent_id:
            self.blocked = (agent_id, now)
        pins = [Pin(a, k.tokens, fair_order(d, a)) for a, k in self.kept.items()
                if a != agent_id and a in d.agents]
        running = d.ledger.reserved_kv if footprint else d.ledger.reserved_prompt
        out = pins_to_release(pins, fair_order(d, agent_id) if agent_id in d.agents else math.inf, need, free,
                              now - self.blocked[1], self.prefill_token_s(), running)
        for a in out:
            self._release(a, now)  # the caller admits at `now`: the charge must not pass it
        self.yields += len(out)
        return bool(out)

    def admitted(self, footprints: int) -> None:
        """Requests took `footprints` KV tokens: kept contexts whose blocks those may reach
        at the head of vLLM's free queue are touched."""
        self.admitted_tokens += footprints
        # A touch that cannot run before the rule lets the context go protects nothing: it
        # would only add a request to the engine's step (a type kept for a sliver of the
        # break-even, say, whose agents seldom resend).
        last_useful = self.now() + self.step_s()
        for agent_id, kept in list(self.kept.items()):
            if kept.until > last_useful and self.admitted_tokens - kept.admitted_at >= TOUCH_AT * kept.ahead:
                self._touch(agent_id, kept)

    # -- the pieces --------------------------------------------------------------------------
    def _until(self, agent_id: str) -> float | None:
        agent = self.dispatcher.agents.get(agent_id)
        if agent is None:
            return None
        return self.rule.keep_until_for(agent, self.dispatcher.kv_capacity, self.prefill_token_s())

    def _blocks(self, tokens: int) -> int:
        b = self.block_size
        return -(-max(0, tokens) // b) * b

    def _mark_released(self, kept: _Kept) -> None:
        """The context's blocks were just put at the tail of the free queue: what is free
        besides them stands ahead."""
        d = self.dispatcher
        free = self.free_kv()
        if free is None:
            free = d.kv_capacity - d.ledger.reserved_kv
        kept.ahead = max(0.0, free - kept.tokens)
        kept.admitted_at = self.admitted_tokens

    def _touch(self, agent_id: str, kept: _Kept) -> None:
        """A one-token request of each kept sequence: its blocks become the most recently
        released. It bypasses the queue: its memory is charged already."""
        self._mark_released(kept)  # not touched again before this one has run
        self.touches += 1
        for seq in kept.sequences:
            request = EngineRequest(f"touch-{agent_id}-{next(self._ids)}", seq[:-1] or seq,
                                    SamplingOptions(max_tokens=1, temperature=0.0),
                                    priority=self.dispatcher.priority(agent_id))
            task = asyncio.get_running_loop().create_task(self._run_touch(request, kept))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_touch(self, request: EngineRequest, kept: _Kept) -> None:
        try:
            async with contextlib.aclosing(self.engine.generate(request)) as outputs:
                async for _ in outputs:
                    pass
        except Exception as exc:  # a touch is best effort: the context may be prefilled again
            log.debug("touch %s failed: %s", request.request_id, exc)
        self._mark_released(kept)  # released again now, at the tail

    def _schedule_expiry(self, agent_id: str, kept: _Kept) -> None:
        if kept.timer is not None:
            kept.timer.cancel()
        kept.timer = None
        if math.isfinite(kept.until):
            delay = max(0.0, kept.until - self.now())
            kept.timer = asyncio.get_running_loop().call_later(delay, self._expire, agent_id)

    def _expire(self, agent_id: str) -> None:
        kept = self.kept.get(agent_id)
        if kept is not None and self.now() >= kept.until - 1e-6:
            self._release(agent_id)

    def _release(self, agent_id: str, now: float | None = None) -> None:
        """End the agent's kept context and charge what it held (up to `now`, by default
        the present)."""
        kept = self.kept.pop(agent_id, None)
        if kept is None:
            return
        self._unpin(kept)
        now = self.now() if now is None else now
        charge = hold_charge(kept.tokens, kept.since, min(now, kept.until))
        self.held_token_s += charge
        charge_retained(self.dispatcher, agent_id, charge, now)

    def _unpin(self, kept: _Kept) -> None:
        if kept.timer is not None:
            kept.timer.cancel()
        self.dispatcher.ledger.pinned_kv -= kept.tokens

    async def close(self) -> None:
        for agent_id in list(self.kept):
            self.forget(agent_id)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    def summary(self) -> dict[str, Any]:
        return {"retain": self.rule.mode, "kept_contexts": len(self.kept),
                "kept_kv": self.dispatcher.ledger.pinned_kv, "touches": self.touches,
                "retention_yields": self.yields, "retained_kv_token_s": self.held_token_s}


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
