"""Admission: which pending requests enter the engine now, in the policy's order.

One loop over the dispatcher's queue: compute the memory budget, then peek at the next
request, check that it fits, pop it and mark it running.

- Footprint policies reserve p + expected d against min(M - reserved, engine free) and stop
  at the first request that does not fit (strict order), or look past it (backfill).
- With several engine replicas, room in the sum is not enough (a request cannot span
  replicas): `place(spec, footprint)` must also find it a replica, and reserves there.
- Prompt policies admit while the prompt fits in free memory (the engine's report, or M minus
  admitted prompts) and leave preemption to the engine.
- An idle engine takes the head whatever its size: nothing would ever free room for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .policies import FOOTPRINT
from .state import RequestSpec

if TYPE_CHECKING:
    from .dispatcher import Dispatcher


def admit_in_order(d: Dispatcher, now: float, engine_free_kv_tokens: int | None,
                   engine_free_slots: int | None,
                   place: Callable[[RequestSpec, int], bool] | None) -> list[RequestSpec]:
    """The requests to hand to the engine now, in order (each marked running)."""
    footprint = d.policy.admission == FOOTPRINT
    ledger = d.ledger
    free = ledger.budget(d.kv_capacity, footprint, engine_free_kv_tokens)
    slots = engine_free_slots
    queue = d.queue
    out: list[RequestSpec] = []
    while slots is None or slots > 0:
        req = queue.peek(now)
        if req is None:
            break
        need = ledger.need(req, footprint)
        fits = need <= free
        if fits and footprint and place is not None:
            fits = place(req.spec, req.footprint)  # reserves on the replica it found
        if not fits and (ledger.running_count or out):
            if queue.defer():  # backfill: look past the blocked agent (restored below)
                continue
            break
        agent = d.agents[req.spec.agent_id]
        queue.pop(agent, req)
        d.mark_running(agent, req, now)
        queue.requeue(agent)
        free -= need
        if slots is not None:
            slots -= 1
        out.append(req.spec)
    queue.restore()
    return out
