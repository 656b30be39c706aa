"""A continuous-batching engine model (vLLM-like), advanced event to event.

The model: a KV cache of M tokens; every running request produces one token per iteration
(its first iteration also prefills its prompt, or, after a preemption, its prompt and the
tokens it had generated: recompute); a request holding p prompt tokens and k generated tokens
uses p + k tokens of KV. Before an iteration, every running request needs room for one more
token; when the cache cannot hold that, the engine preempts (by recompute, no swap) the
lowest-priority running request (under FCFS: the newest), as vLLM does, and puts it at the
front of its waiting queue. Waiting (preempted) requests resume before new ones are admitted.

The prefix cache (vLLM's automatic prefix caching): a request may name the prompt prefixes it
shares (its `segments`, server/scheduler/prefix.py). A prefix is stored once, whoever holds
it; a request allocates only the part of its chain not cached yet and prefills only its
uncached prompt tokens (a hit counts from the start of the chain up to the first miss, as
vLLM's chained block hashes do). A prefix no running request references stays cached and
is evicted (least recently released first) when memory runs short, before any preemption.
Free memory, as the engine reports it, counts such unreferenced prefixes as free.

An iteration's time is the profile's function of the batch, the prompt tokens it prefills
and the context tokens its sequences attend over: each running request its whole prompt and
what it has generated, a shared prefix once per request that reads it. Memory counts a shared
prefix once; attention does not (16 requests over one shared 2,048-token head step 5.4 ms
slower than over 16-token heads on the CPU engine, docs/benchmarks.md).

Between events (a request finishing, memory running out, the next external arrival) nothing
changes but the token counts, so `step` runs a whole stretch of decode iterations at once:
their total duration is an arithmetic series in the context attended.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from server.scheduler.prefix import Segment, shared_tokens, uncached_prompt
from server.shared.profiles import EngineProfile


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
    segments: tuple[Segment, ...] = ()  # shared prompt prefixes (stored in the prefix cache)
    cached: int = 0  # prompt tokens found in the prefix cache when it was admitted

    @property
    def kv(self) -> int:
        """KV tokens it holds of its own (its shared prefixes are the cache's)."""
        return self.prompt_tokens - shared_tokens(self.segments) + self.generated

    @property
    def context(self) -> int:
        """Tokens its attention reads: its whole prompt, shared or not, and its output."""
        return self.prompt_tokens + self.generated


@dataclass
class _Prefix:
    """One cached prefix: tokens [start, end) of the prompts naming it, and its holders."""

    start: int
    end: int
    refs: int = 0
    ends: dict[int, int] = field(default_factory=dict)  # how many holders reach each end

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class PrefixCache:
    """Prefixes stored once; unreferenced ones kept until memory is needed (LRU)."""

    entries: dict[str, _Prefix] = field(default_factory=dict)
    unreferenced: dict[str, None] = field(default_factory=dict)  # release order: LRU first
    tokens: int = 0  # KV tokens of every cached prefix
    evictable: int = 0  # of the unreferenced ones
    prompt_tokens: int = 0  # prompts admitted (hit-rate denominator)
    hit_tokens: int = 0  # of which found cached
    # Evicted prefixes (id -> the end they had) and the prompt tokens prefilled again because
    # of an eviction: what keeping every context warm could have saved at most.
    evicted: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0

    def attach(self, segs: tuple[Segment, ...]) -> tuple[int, int]:
        """A request holding `segs` runs: returns (tokens found cached, tokens allocated,
        negative when it freed more than it took)."""
        hits = alloc = 0
        contiguous = warm = True  # warm: still a hit had nothing been evicted
        for s in segs:
            e = self.entries.get(s.key)
            before = self.evicted.pop(s.key, 0) if e is None else e.end
            if e is None:
                e = self.entries[s.key] = _Prefix(s.start, s.start)
            elif e.refs == 0:
                self.unreferenced.pop(s.key, None)
                self.evictable -= e.tokens
            hit = max(0, min(s.end, e.end) - s.start) if contiguous else 0
            contiguous = contiguous and hit == s.tokens
            hits += hit
            would = max(0, min(s.end, before) - s.start) if warm else 0
            warm = warm and would == s.tokens
            self.recomputed_tokens += max(0, would - hit)
            if e.refs == 0 and e.end > s.end:
                # a cached tail no holder reaches: freed (vLLM keeps such blocks only as
                # evictable ones; the model frees them rather than pin them)
                alloc -= e.end - s.end
                e.end = s.end
            if s.end > e.end:
                alloc += s.end - e.end
                e.end = s.end
            e.refs += 1
            e.ends[s.end] = e.ends.get(s.end, 0) + 1
        self.tokens += alloc
        return hits, alloc

    def detach(self, segs: tuple[Segment, ...]) -> int:
        """A request holding `segs` stopped: returns the tokens freed at once (the tail of
        a prefix that only it reached, while others still hold its head: vLLM frees blocks
        one by one, so that tail is not kept whole)."""
        freed = 0
        for s in segs:
            e = self.entries[s.key]
            e.refs -= 1
            e.ends[s.end] -= 1
            if e.ends[s.end] == 0:
                del e.ends[s.end]
            if e.refs == 0:
                self.unreferenced[s.key] = None
                self.evictable += e.tokens
            elif (top := max(e.ends)) < e.end:
                freed += e.end - top
                e.end = top
        self.tokens -= freed
        return freed

    def marginal(self, segs: tuple[Segment, ...]) -> int:
        """Tokens of `segs` not cached now (what attaching them would allocate)."""
        out = 0
        for s in segs:
            e = self.entries.get(s.key)
            top = e.end if e is not None else s.start
            out += max(0, s.end - max(top, s.start))
        return out

    def evict(self, tokens: int) -> int:
        """Drop unreferenced prefixes, least recently released first, until `tokens` are
        freed (or none is left): returns the tokens freed."""
        freed = 0
        while freed < tokens and self.unreferenced:
            key = next(iter(self.unreferenced))
            del self.unreferenced[key]
            e = self.entries.pop(key)
            self.evicted[key] = e.end
            freed += e.tokens
        self.tokens -= freed
        self.evictable -= freed
        return freed


class EngineModel:
    """KV cache, running batch, preemption by recompute and iteration timing."""

    def __init__(self, profile: EngineProfile, kv_tokens: int, preempt_newest: bool) -> None:
        self.profile = profile
        self.capacity = int(kv_tokens)
        self.preempt_newest = preempt_newest  # FCFS: newest first; else lowest priority
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()  # preempted, resumed first
        self.kv_used = 0  # running requests' own tokens and every cached prefix
        self.attended = 0  # running requests' contexts (a shared prefix once per request)
        self.cache = PrefixCache()
        self.iterations = 0
        self.preemptions = 0
        self._seq = 0

    @property
    def free_kv(self) -> int:
        """Free memory, unreferenced cached prefixes included (they are evicted on demand)."""
        return self.capacity - self.kv_used + self.cache.evictable

    def holds_nothing(self) -> bool:
        """Nothing running or waiting, and no cached prefix referenced."""
        return self.idle() and self.kv_used == self.cache.tokens == self.cache.evictable

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache over all admitted prompt tokens."""
        c = self.cache
        return c.hit_tokens / c.prompt_tokens if c.prompt_tokens else None

    def _allocate(self, tokens: int) -> None:
        over = self.kv_used + tokens - self.capacity
        if over > 0:
            self.kv_used -= self.cache.evict(over)
        self.kv_used += tokens

    def _attach(self, req: SimRequest) -> int:
        """Allocate a request's KV (its prompt's uncached prefixes and private tokens):
        returns the prompt tokens found cached."""
        hits, alloc = self.cache.attach(req.segments) if req.segments else (0, 0)
        self._allocate(alloc + req.kv)
        return hits

    @property
    def free_slots(self) -> int:
        return self.profile.max_num_seqs - len(self.running)

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, req: SimRequest) -> None:
        """Admit a new request: its prompt is allocated and prefilled next iteration."""
        self._seq += 1
        req.admit_seq = self._seq
        hits = self._attach(req)
        req.cached = hits
        # vLLM computes at least the last prompt token, however much of the prompt is cached
        req.prefill = max(1, uncached_prompt(req.prompt_tokens, hits))
        self.cache.prompt_tokens += req.prompt_tokens
        self.cache.hit_tokens += min(hits, req.prompt_tokens - 1)
        self.running.append(req)
        self.attended += req.context

    def resume(self) -> None:
        """Bring preempted requests back (front first) while they fit."""
        while self.waiting and self.free_slots > 0:
            req = self.waiting[0]
            if req.kv + 1 + self.cache.marginal(req.segments) > self.free_kv and self.running:
                break
            self.waiting.popleft()
            hits = self._attach(req)
            # recompute the prompt (what the cache lost of it too) and the generated tokens
            req.prefill = max(1, req.prompt_tokens + req.generated - hits)
            self.running.append(req)
            self.attended += req.context

    def _release(self, req: SimRequest) -> None:
        self.kv_used -= req.kv
        self.attended -= req.context
        if req.segments:
            self.kv_used -= self.cache.detach(req.segments)

    def _make_room(self) -> None:
        over = self.kv_used + len(self.running) - self.capacity
        if over > 0:  # unreferenced prefixes go first
            self.kv_used -= self.cache.evict(over)
        while len(self.running) > 1 and self.kv_used + len(self.running) > self.capacity:
            if self.preempt_newest:
                victim = max(self.running, key=lambda r: r.admit_seq)
            else:
                victim = max(self.running, key=lambda r: (r.priority, r.admit_seq))
            self.running.remove(victim)
            self._release(victim)
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
            dt = prof.iteration_s(batch, prefill, self.attended)
            for r in self.running:
                r.prefill = 0
        else:
            n = min(r.output_tokens - r.generated for r in self.running)
            n = min(n, max(1, self.free_kv // batch))
            over = self.kv_used + batch * n - self.capacity
            if over > 0:  # the stretch needs memory that unreferenced prefixes hold
                self.kv_used -= self.cache.evict(over)
            a = prof.base_s + prof.per_seq_s * batch + prof.per_kv_token_s * self.attended
            c = prof.per_kv_token_s * batch  # growth of the attended context per iteration
            if until < math.inf:
                n = min(n, _iterations_to_reach(until - now, a, c))
            dt = n * a + c * n * (n - 1) / 2.0
        for r in self.running:
            r.generated += n
        self.kv_used += batch * n
        self.attended += batch * n
        self.iterations += n
        done = [r for r in self.running if r.generated >= r.output_tokens]
        if done:
            self.running = [r for r in self.running if r.generated < r.output_tokens]
            for r in done:
                self._release(r)
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
