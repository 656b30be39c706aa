"""A continuous-batching engine model (vLLM-like), advanced event to event.

The model: a KV cache of M tokens; every running request produces one token per iteration
(its first iteration also prefills its prompt, or, after a preemption, its prompt and the
tokens it had generated: recompute); a request holding p prompt tokens and k generated tokens
uses p + k tokens of KV. Before an iteration, every running request needs room for one more
token; when the cache cannot hold that, the engine preempts (by recompute, no swap) the
lowest-priority running request (under FCFS: the newest), as vLLM does, and puts it at the
front of its waiting queue. Waiting (preempted) requests resume before new ones are admitted.

Between events (a request finishing, memory running out, the next external arrival) nothing
changes but the token counts, so `step` runs a whole stretch of decode iterations at once:
their total duration is an arithmetic series in the KV in use.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .profiles import EngineProfile


@dataclass
class SimRequest:
    request_id: str
    agent_id: str
    prompt_tokens: int
    output_tokens: int  # exact length (the replay uses ignore_eos + max_tokens)
    priority: int = 0
    admit_seq: int = 0
    generated: int = 0
    prefill: int = 0  # tokens to prefill in the next iteration

    @property
    def kv(self) -> int:
        return self.prompt_tokens + self.generated


class EngineModel:
    """KV cache, running batch, preemption by recompute and iteration timing."""

    def __init__(self, profile: EngineProfile, kv_tokens: int, preempt_newest: bool) -> None:
        self.profile = profile
        self.capacity = int(kv_tokens)
        self.preempt_newest = preempt_newest  # FCFS: newest first; else lowest priority
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()  # preempted, resumed first
        self.kv_used = 0
        self.iterations = 0
        self.preemptions = 0
        self._seq = 0

    @property
    def free_kv(self) -> int:
        return self.capacity - self.kv_used

    @property
    def free_slots(self) -> int:
        return self.profile.max_num_seqs - len(self.running)

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, req: SimRequest) -> None:
        """Admit a new request: its prompt is allocated and prefilled next iteration."""
        self._seq += 1
        req.admit_seq = self._seq
        req.prefill = req.prompt_tokens
        self.kv_used += req.prompt_tokens
        self.running.append(req)

    def resume(self) -> None:
        """Bring preempted requests back (front first) while they fit."""
        while self.waiting and self.free_slots > 0:
            req = self.waiting[0]
            if req.kv + 1 > self.free_kv and self.running:
                break
            self.waiting.popleft()
            req.prefill = req.kv  # recompute prompt and generated tokens
            self.kv_used += req.kv
            self.running.append(req)

    def _make_room(self) -> None:
        while len(self.running) > 1 and self.kv_used + len(self.running) > self.capacity:
            if self.preempt_newest:
                victim = max(self.running, key=lambda r: r.admit_seq)
            else:
                victim = max(self.running, key=lambda r: (r.priority, r.admit_seq))
            self.running.remove(victim)
            self.kv_used -= victim.kv
            victim.prefill = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def step(self, now: float, until: float) -> tuple[float, list[SimRequest]]:
        """Run one iteration, or a stretch of decode iterations ending at the first event
        (a finish, memory exhaustion, or the first iteration boundary at/after `until`).
        Returns the new time and the requests that finished."""
        self._make_room()
        batch = len(self.running)
        if batch == 0:
            return now, []
        prof = self.profile
        prefill = sum(r.prefill for r in self.running)
        if prefill:
            n = 1
            dt = prof.iteration_s(batch, prefill, self.kv_used)
            for r in self.running:
                r.prefill = 0
        else:
            n = min(r.output_tokens - r.generated for r in self.running)
            n = min(n, max(1, (self.capacity - self.kv_used) // batch))
            a = prof.base_s + prof.per_seq_s * batch + prof.per_kv_token_s * self.kv_used
            c = prof.per_kv_token_s * batch  # growth of the KV term per iteration
            if until < math.inf:
                n = min(n, _iterations_to_reach(until - now, a, c))
            dt = n * a + c * n * (n - 1) / 2.0
        for r in self.running:
            r.generated += n
        self.kv_used += batch * n
        self.iterations += n
        done = [r for r in self.running if r.generated >= r.output_tokens]
        if done:
            self.running = [r for r in self.running if r.generated < r.output_tokens]
            for r in done:
                self.kv_used -= r.kv
        return now + dt, done


def _iterations_to_reach(gap: float, a: float, c: float) -> int:
    """Smallest n >= 1 with n*a + c*n*(n-1)/2 >= gap (a > 0, c >= 0)."""
    if gap <= 0:
        return 1
    if c <= 0:
        return max(1, math.ceil(gap / a))
    # c/2 n^2 + (a - c/2) n - gap = 0
    b = a - c / 2.0
    n = (-b + math.sqrt(b * b + 2.0 * c * gap)) / c
    n = max(1, math.ceil(n - 1e-9))
    while n > 1 and (n - 1) * a + c * (n - 1) * (n - 2) / 2.0 >= gap:
        n -= 1
    return n
