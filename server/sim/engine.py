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
what it has generated, a shared prefix once per request that reads it. A prompt longer than
the engine's token budget per step adds its chunked prefill's extra
(`EngineProfile.chunked_prefill_s`), charged in the one iteration that prefills it: vLLM
spreads it over as many steps as it has chunks, with the other requests' decodes in each,
which moves time within the stretch but not its sum. Memory counts a shared
prefix once; attention does not (16 requests over one shared 2,048-token head step 5.4 ms
slower than over 16-token heads on the CPU engine, docs/benchmarks.md).

Conversations (`cache_sequences`, on when a workload resends contexts or pauses): a finished
request's whole sequence (prompt and output, whole blocks) stays cached as vLLM keeps it, under
its `ctx` id (the next turn of that conversation extends it) or an id of its own; eviction then
takes whole blocks from the tail of the least recently released entry (vLLM frees a request's
blocks tail first), and the tail of an entry that a shorter holder does not reach stays
cached. An entry may be *pinned* (a paused agent's context kept, retention.py): it is not
evictable and not free; a pin gives way before any preemption. `reprefill_tokens` counts, per
agent, prompt tokens prefilled that the same agent had computed or had cached before (its
context lost while it paused); recompute after a preemption is not counted.

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
    ctx: str | None = None  # the conversation its sequence extends (workload `ctx`)
    kept_key: str | None = None  # the cache entry its sequence was kept under when it finished

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
    block_size: int = 1  # > 1: eviction trims entries from the tail in whole blocks
    # kept entries (id -> how many pins), oldest pin first: never evicted, even unreferenced
    pinned: dict[str, int] = field(default_factory=dict)
    # (agent, id) -> the end of that entry the agent has computed or had cached
    seen: dict[tuple[str, str], int] = field(default_factory=dict)
    reprefill: dict[str, int] = field(default_factory=dict)  # agent -> tokens prefilled again
    # Keep a cached tail that no holder reaches (vLLM keeps such blocks cached, evictable):
    # with conversations, a shorter holder must not cut a longer context's head.
    tails: bool = False

    def keeps_tail(self, key: str) -> bool:
        return self.tails or key in self.pinned

    def attach(self, segs: tuple[Segment, ...], agent: str | None = None, count: bool = True) -> tuple[int, int]:
        """A request of `agent` holding `segs` runs: returns (tokens found cached, tokens
        allocated, negative when it freed more than it took). `count`: tokens the agent had
        before and lost count as its re-prefill (not on a resume after preemption)."""
        hits = alloc = 0
        contiguous = warm = mine_warm = True  # warm: still a hit had nothing been evicted
        for s in segs:
            e = self.entries.get(s.key)
            before = max(e.end if e is not None else 0, self.evicted.get(s.key, 0))
            if e is None:
                e = self.entries[s.key] = _Prefix(s.start, s.start)
            elif e.refs == 0 and s.key not in self.pinned:
                self.unreferenced.pop(s.key, None)
                self.evictable -= e.tokens
            hit = max(0, min(s.end, e.end) - s.start) if contiguous else 0
            contiguous = contiguous and hit == s.tokens
            hits += hit
            would = max(0, min(s.end, before) - s.start) if warm else 0
            warm = warm and would == s.tokens
            self.recomputed_tokens += max(0, would - hit)
            if agent is not None:
                had = self.seen.get((agent, s.key), s.start)
                mine = max(0, min(s.end, had) - s.start) if mine_warm else 0
                mine_warm = mine_warm and mine == s.tokens
                if count and mine > hit:
                    self.reprefill[agent] = self.reprefill.get(agent, 0) + mine - hit
                self.seen[(agent, s.key)] = max(had, s.end)
            if e.refs == 0 and e.end > s.end and not self.keeps_tail(s.key):
                # a cached tail no holder reaches: freed (vLLM keeps such blocks only as
                # evictable ones; the model frees them rather than pin them)
                alloc -= e.end - s.end
                e.end = s.end
            if s.end > e.end:
                alloc += s.end - e.end
                e.end = s.end
                if e.end >= self.evicted.get(s.key, e.end):
                    self.evicted.pop(s.key, None)
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
                if s.key not in self.pinned:
                    self.unreferenced[s.key] = None
                    self.evictable += e.tokens
            elif (top := max(e.ends)) < e.end and not self.keeps_tail(s.key):
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
        freed (or none is left): returns the tokens freed. With blocks (`block_size` > 1)
        the last entry it reaches loses only the whole blocks of its tail it must."""
        freed = 0
        bs = self.block_size
        while freed < tokens and self.unreferenced:
            key = next(iter(self.unreferenced))
            e = self.entries[key]
            cut = -(-(tokens - freed) // bs) * bs
            if bs > 1 and cut < e.tokens:
                self.evicted[key] = max(self.evicted.get(key, 0), e.end)
                e.end -= cut
                freed += cut
                break
            del self.unreferenced[key]
            del self.entries[key]
            self.evicted[key] = max(self.evicted.get(key, 0), e.end)
            freed += e.tokens
        self.tokens -= freed
        self.evictable -= freed
        return freed

    def keep(self, key: str, start: int, end: int, agent: str | None) -> int:
        """A finished request's sequence [start, end) stays cached under `key` (extending
        that entry when it exists and nothing holds it), most recently released: returns
        the tokens newly cached."""
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Prefix(start, start)
        elif e.refs > 0:
            return 0
        added = max(0, end - e.end)
        e.end += added
        self.tokens += added
        if key not in self.pinned:
            self.unreferenced.pop(key, None)
            self.unreferenced[key] = None
            self.evictable += added
        if agent is not None:
            self.seen[(agent, key)] = max(self.seen.get((agent, key), 0), e.end)
        return added

    def pin(self, key: str) -> int:
        """Keep an entry (one more pin): not evictable, nor free, while any pin holds it.
        Returns the tokens this pin takes out of the free memory (0: already kept, held by
        a running request, or not cached)."""
        e = self.entries.get(key)
        if e is None:
            return 0
        count = self.pinned.get(key, 0)
        self.pinned[key] = count + 1
        if count or e.refs > 0:
            return 0
        self.unreferenced.pop(key, None)
        self.evictable -= e.tokens
        return e.tokens

    def unpin(self, key: str, every: bool = False) -> int:
        """End a pin (`every`: all of them): once none is left, an unreferenced entry is
        evictable again, first in line (it was released before everything else cached).
        Returns the tokens freed that way."""
        count = self.pinned.get(key, 0)
        if count == 0:
            return 0
        if count > 1 and not every:
            self.pinned[key] = count - 1
            return 0
        del self.pinned[key]
        e = self.entries.get(key)
        if e is None or e.refs > 0:
            return 0
        self.evictable += e.tokens
        self.unreferenced = {key: None, **self.unreferenced}
        return e.tokens


class EngineModel:
    """KV cache, running batch, preemption by recompute and iteration timing."""

    def __init__(self, profile: EngineProfile, kv_tokens: int, preempt_newest: bool,
                 block_size: int = 1, cache_sequences: bool = False) -> None:
        self.profile = profile
        self.capacity = int(kv_tokens)
        self.preempt_newest = preempt_newest  # FCFS: newest first; else lowest priority
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()  # preempted, resumed first
        self.kv_used = 0  # running requests' own tokens and every cached prefix
        self.attended = 0  # running requests' contexts (a shared prefix once per request)
        self.cache = PrefixCache(block_size=max(1, int(block_size)), tails=cache_sequences)
        self.cache_sequences = cache_sequences
        self.pins_broken = 0  # pins given up so that running requests could grow
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

    def _free_up(self, over: int) -> None:
        """Evict `over` tokens of unreferenced prefixes; pins give way (oldest first) when
        that is not enough, before anything is preempted."""
        if over > 0:
            over -= self._evict(over)
        while over > 0 and self.cache.pinned:
            self.cache.unpin(next(iter(self.cache.pinned)), every=True)
            self.pins_broken += 1
            over -= self._evict(over)

    def _evict(self, tokens: int) -> int:
        freed = self.cache.evict(tokens)
        self.kv_used -= freed
        return freed

    def _allocate(self, tokens: int) -> None:
        self._free_up(self.kv_used + tokens - self.capacity)
        self.kv_used += tokens

    def _attach(self, req: SimRequest, count: bool = True) -> int:
        """Allocate a request's KV (its prompt's uncached prefixes and private tokens):
        returns the prompt tokens found cached."""
        hits, alloc = self.cache.attach(req.segments, req.agent_id, count) if req.segments else (0, 0)
        self._allocate(alloc + req.kv)
        return hits

    def reprefill_tokens(self, agent_id: str) -> int:
        return self.cache.reprefill.get(agent_id, 0)

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
            hits = self._attach(req, count=False)
            # recompute the prompt (what the cache lost of it too) and the generated tokens
            req.prefill = max(1, req.prompt_tokens + req.generated - hits)
            self.running.append(req)
            self.attended += req.context

    def _release(self, req: SimRequest, finished: bool = False) -> None:
        self.kv_used -= req.kv
        self.attended -= req.context
        if req.segments:
            self.kv_used -= self.cache.detach(req.segments)
        if finished and self.cache_sequences:
            self._keep_sequence(req)

    def _keep_sequence(self, req: SimRequest) -> None:
        """A finished request's whole blocks (prompt and output; the last token's KV is never
        computed) stay cached, under its conversation's id or one of its own."""
        key = req.ctx or f"seq/{req.request_id}"
        start = next((s.start for s in req.segments if s.key == key), shared_tokens(req.segments))
        bs = self.cache.block_size
        end = (req.prompt_tokens + req.generated - 1) // bs * bs
        if end > start:
            added = self.cache.keep(key, start, end, req.agent_id)
            self._allocate(added)
            req.kept_key = key

    def _make_room(self) -> None:
        # unreferenced prefixes go first, then pins
        self._free_up(self.kv_used + len(self.running) - self.capacity)
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
                if r.prefill:
                    dt += prof.chunked_prefill_s(r.prefill)
                r.prefill = 0
        else:
            n = min(r.output_tokens - r.generated for r in self.running)
            n = min(n, max(1, self.free_kv // batch))
            # the stretch needs memory that unreferenced prefixes hold
            self._free_up(self.kv_used + batch * n - self.capacity)
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
                self._release(r, finished=True)
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
