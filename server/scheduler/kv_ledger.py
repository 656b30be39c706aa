"""The KV ledger: what the engine's memory holds and what waits for it.

The dispatcher admits a request against the memory left (`budget`) by what it needs
(`need`), and reserves it (`admit`) until it finishes (`release`). The ledger counts, in KV
tokens:

- `reserved_kv`: the footprints (prompt + expected output, whole blocks) of the admitted,
  unfinished requests, a shared prefix that several of them hold counted once (`holds`);
- `reserved_prompt`: their prompts, the same way (what prompt-admission policies fill);
- `running_footprint`: their footprints as if nothing were shared (`kv_shared_now` is the
  difference);
- `pending_kv`: the footprints of the requests waiting (the load an ETA expects);
- `pinned_kv`: paused agents' contexts kept in the engine's prefix cache (the live server's
  retention, server/runtime/retain.py sets it): admission leaves that memory to them.

Invariant: every count returns to zero once every request has finished or been dropped
(`is_empty`). The ledger knows requests, not agents, and never reads a clock.
"""

from __future__ import annotations

from .prefix import PrefixHolds, shared_tokens
from .state import RequestState, RequestStatus

RUNNING = RequestStatus.RUNNING
DONE = RequestStatus.DONE


class KvLedger:
    """Reservations of the running requests and the footprint of the pending ones."""

    def __init__(self) -> None:
        self.reserved_kv = 0  # footprints of admitted, unfinished requests
        self.reserved_prompt = 0  # prompts of admitted, unfinished requests
        self.holds = PrefixHolds()  # shared prefixes of running requests, each counted once
        self.running_footprint = 0  # footprints of running requests as if nothing were shared
        self.kv_saved_total = 0  # KV tokens not reserved again thanks to shared prefixes (sum)
        # Prompt tokens of finished requests, and how many of them the engine served from its
        # prefix cache (when it reports it): the prefix-hit rate.
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.pending_count = 0
        self.pending_kv = 0  # footprints of pending requests
        self.pinned_kv = 0  # kept contexts of paused agents
        # The admitted, unfinished requests by seq: when their memory frees (an ETA's wait
        # for memory, eta.py `MemoryDrain`).
        self.running: dict[int, RequestState] = {}

    @property
    def running_count(self) -> int:
        """Admitted, unfinished requests."""
        return len(self.running)

    # -- pending ----------------------------------------------------------------
    def enqueue(self, req: RequestState) -> None:
        """A request joined the queue."""
        self.pending_count += 1
        self.pending_kv += req.footprint

    def dequeue(self, req: RequestState) -> None:
        """A pending request left the queue (admitted or dropped)."""
        self.pending_count -= 1
        self.pending_kv -= req.footprint

    # -- admission --------------------------------------------------------------
    def budget(self, capacity: int, footprint: bool, engine_free_kv_tokens: int | None) -> int:
        """Memory the next admissions may take: footprints against `capacity` (and what the
        engine reports free), or prompts against the engine's free memory."""
        if footprint:
            free = capacity - self.reserved_kv - self.pinned_kv
        else:
            free = capacity - self.reserved_prompt - self.pinned_kv
        if engine_free_kv_tokens is not None:
            free = min(free, engine_free_kv_tokens) if footprint else engine_free_kv_tokens
        return free

    def need(self, req: RequestState, footprint: bool) -> int:
        """Memory a request takes when admitted now: its footprint (footprint policies) or its
        prompt and one token (prompt policies), shared prefixes that running requests hold
        taken out."""
        if not req.segments:
            return req.footprint if footprint else req.spec.prompt_tokens + 1
        held = self.holds.marginal(req.segments)
        if footprint:
            return req.private_footprint + held
        return req.spec.prompt_tokens - shared_tokens(req.segments) + held + 1

    def admit(self, req: RequestState) -> None:
        """A pending request enters the engine: it leaves the queue and its footprint is
        reserved (the part of its shared prefixes no running request holds, plus its own)."""
        req.status = RUNNING
        self.dequeue(req)
        self.running[req.seq] = req
        self.running_footprint += req.footprint
        if req.segments:
            held = self.holds.add(req.segments)
            self.reserved_kv += req.private_footprint + held
            self.reserved_prompt += req.spec.prompt_tokens - shared_tokens(req.segments) + held
            self.kv_saved_total += req.footprint - req.private_footprint - held
        else:
            self.reserved_kv += req.footprint
            self.reserved_prompt += req.spec.prompt_tokens

    def release(self, req: RequestState) -> None:
        """A running request left the engine: its reservation is freed."""
        self.running_footprint -= req.footprint
        if req.segments:
            freed = self.holds.remove(req.segments)
            self.reserved_kv -= req.private_footprint + freed
            self.reserved_prompt -= req.spec.prompt_tokens - shared_tokens(req.segments) + freed
        else:
            self.reserved_kv -= req.footprint
            self.reserved_prompt -= req.spec.prompt_tokens
        self.running.pop(req.seq, None)
        req.status = DONE

    # -- the engine's prefix cache ------------------------------------------------
    def observe_cached(self, prompt_tokens: int, cached_tokens: int) -> int:
        """A finished request's prompt and the part the engine served from its prefix cache;
        returns that part, clamped to the prompt."""
        cached = max(0, min(int(cached_tokens), int(prompt_tokens)))
        self.prompt_tokens_total += int(prompt_tokens)
        self.cached_tokens_total += cached
        return cached

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens served from the engine's prefix cache over all prompt tokens of the
        finished requests it reported on (None before any)."""
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else None

    @property
    def kv_shared_now(self) -> int:
        """KV tokens the running requests would reserve again if nothing were shared."""
        return self.running_footprint - self.reserved_kv

    def is_empty(self) -> bool:
        """Nothing reserved, held, pending or running."""
        return (
            self.reserved_kv == 0
            and self.reserved_prompt == 0
            and self.running_footprint == 0
            and len(self.holds) == 0
            and self.pending_count == 0
            and not self.running
        )
