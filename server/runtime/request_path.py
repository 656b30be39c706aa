"""One request of an agent: queue it, wait for admission, stream it from the engine, settle.

Whatever ends the request (completion, a cancelled consumer, the agent's cancel, an engine
error) its real usage is accounted in the dispatcher and in its agent, its agent's total
cost is re-estimated, and the next requests are admitted. An admitted request goes to the
engine with an int priority from its agent's rank, so that if the engine must preempt
anyway it preempts the lowest-ranked agent.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

from server.engine.base import Engine, EngineOutput, EngineRequest, EngineTimes, SamplingOptions
from server.runtime.admission import Admission, Ticket
from server.runtime.agent_listeners import AgentListeners
from server.runtime.agents import AgentEntry, AgentStatus, RequestLog
from server.runtime.lifecycle import ABANDONED, AgentConflict, transition
from server.runtime.limits import QuotaExceeded
from server.scheduler import Dispatcher, RequestSpec
from server.scheduler.prefix import PrefixRef, block_chain
from server.scheduler.reprediction import expected_total

if TYPE_CHECKING:
    from server.runtime.retain import LiveRetention


class RequestPath:
    def __init__(self, dispatcher: Dispatcher, admission: Admission, engine: Engine,
                 listeners: AgentListeners, *, now: Callable[[], float], wall: Callable[[], float],
                 close: Callable[[AgentEntry, AgentStatus], None]) -> None:
        self.dispatcher = dispatcher
        self.admission = admission
        self.engine = engine
        self.listeners = listeners
        self.now = now
        self._wall = wall
        self._close = close  # ends an agent (an untagged request's own, when the request ends)
        self.retention: LiveRetention | None = None  # kept contexts (server/runtime/retain.py)

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
        if entry.terminal:
            raise AgentConflict(f"agent {entry.id} is {entry.state}")
        now = self.now()
        spec = RequestSpec(request_id, entry.id, prompt_tokens=len(prompt_token_ids),
                           max_tokens=sampling.max_tokens, n=sampling.n, prefix=self._prefix(prompt_token_ids))
        try:
            ticket = self.admission.submit(entry, spec, now)
        except QuotaExceeded:
            if entry.auto and entry.in_flight == 0:  # its one request was refused
                self._close(entry, AgentStatus.CANCELLED)
            raise
        entry.in_flight += 1
        entry.last_activity_mono = now
        if entry.state is AgentStatus.PAUSED:  # back from its pause: its next stage starts
            transition(entry, AgentStatus.RUNNING, wall=self._wall(), now=now)
            if self.retention is not None:
                self.retention.resumed(entry.id, entry.type, prompt_token_ids)
        entry.touch()
        last: EngineOutput | None = None
        try:
            self.admission.pump()
            await ticket.opened.wait()
            if ticket.error is not None:
                raise ticket.error
            if entry.state is AgentStatus.QUEUED:
                transition(entry, AgentStatus.RUNNING, wall=self._wall(), now=self.now())
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
            if self.retention is not None and last is not None and last.finished:
                self.retention.request_done(entry.id, prompt_token_ids, last)
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
                **engine_parts(last.times if last is not None else None),
            ))
        if last is not None:
            self.listeners.on_request_finished(entry, last)
        if entry.state is AgentStatus.RUNNING and entry.in_flight == 0 and not entry.auto:
            # Nothing left in flight: the agent is between its stages (a tool call, a
            # user's think time) until it sends again or ends.
            transition(entry, AgentStatus.PAUSED, wall=self._wall(), now=now)
            if self.retention is not None:
                self.retention.paused(entry.id)
        entry.touch()
        if entry.auto and not entry.terminal and entry.in_flight == 0:
            self._close(entry, AgentStatus.FINISHED)
        elif ticket.admitted is not None and entry.id in self.dispatcher.agents:
            self._repredict(entry, now)
        self.admission.pump()


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


def engine_parts(times: EngineTimes | None) -> dict[str, float]:
    """A request log's fields of its time inside the engine (all None: not reported)."""
    if times is None:
        return {}
    return {"to_engine_s": times.to_engine_s, "engine_queued_s": times.queued_s, "prefill_s": times.prefill_s,
            "decode_s": times.decode_s, "from_engine_s": times.from_engine_s}
