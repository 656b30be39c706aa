"""Shared prompt prefixes: the one cost model of prefix sharing (server and simulator).

A request may name the prompt prefixes it shares with other requests (DESIGN section 8,
additions): a chain of `(id, tokens)` pairs, shortest first, each one extending the one
before (`[("fewshot", 1800), ("a17/ctx", 2310)]`: the first 1,800 prompt tokens are the
few-shot prompt every agent of a type sends, the next 510 the agent's own context). The
engine stores a shared prefix once (vLLM's prefix cache shares whole KV blocks), so:

* **Admission** (`PrefixHolds`): the footprint of the set of running requests is the union of
  their prefix blocks plus each one's private tokens. A request's marginal need is its
  private footprint plus the part of its prefix chain no running request holds yet.
* **Cost** (`PrefixLedger`): a prefix held by several requests of one agent at the same time
  is charged once, for the longest time any of them holds it: the agent's KV token-time for
  a segment of L tokens held by requests decoding d_1..d_k tokens side by side is
  L * max(d_i), not L * sum(d_i). Requests are charged in submission order with the rectangle
  they add to the agent's hold (L x d minus the overlap with what the agent already holds),
  so that the sum over a stage is exactly that maximum whatever the order. Sharing *across*
  agents is not discounted in the charge: an agent's charge is what it would cost if it held
  its prefixes alone, an upper bound of its fair share of a prefix held with others
  (docs/concepts.md, "Shared prefixes", argues why the delay bound stays honest with it).
* **Prefill**: a prompt token found in the cache is not computed again (`uncached_prompt`);
  the time model's prefill term counts computed tokens only (time_model.py).

Segments are floored to whole KV blocks: the engine shares full blocks only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .cost import kv_cost

PrefixRef = tuple[str, int]  # (prefix id, tokens): the first `tokens` prompt tokens are the prefix's


class Segment(NamedTuple):
    """Prompt tokens [start, end) of a request, shared under prefix `key` (a tuple: the
    admission loops unpack it, faster than attribute reads)."""

    key: str
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


def segments(chain: Sequence[PrefixRef], block_size: int = 1) -> tuple[Segment, ...]:
    """A prefix chain (shortest first) as the whole-block segments it shares."""
    bs = max(1, int(block_size))
    out: list[Segment] = []
    start = 0
    for key, tokens in chain:
        end = int(tokens) // bs * bs
        if end > start:
            out.append(Segment(key, start, end))
            start = end
    return tuple(out)


def shared_tokens(segs: Sequence[Segment]) -> int:
    """Prompt tokens a request shares (its chain covers [0, end of the last segment))."""
    return segs[-1].end if segs else 0


def private_kv_cost(prompt_tokens: int, output_tokens: int, shared: int) -> float:
    """KV token-time of a request without its shared prefix: (p - s) * d + d(d+1)/2."""
    return kv_cost(prompt_tokens, output_tokens) - float(shared * output_tokens)


def uncached_prompt(prompt_tokens: int, cached_tokens: int) -> int:
    """Prompt tokens the engine computes: what its prefix cache did not hold."""
    return max(0, int(prompt_tokens) - max(0, int(cached_tokens)))


class PrefixHolds:
    """The prefix blocks held by running requests, each prefix counted once.

    Per prefix id, one entry `[top, start, holders, ends]`: the longest end any running
    holder reaches, the segment's start, how many hold it, and how many reach each end
    (None while every holder reaches `top`, as with the live server's fixed-size units:
    then a hold is one counter). The extent held is
    `top - start`; `reserved` is the sum of the extents: what the set of running requests
    takes for its prefixes. One dictionary lookup per segment: the live server's chains have
    a segment per hashing unit, and admission and release walk them.
    """

    def __init__(self) -> None:
        self._held: dict[str, list[Any]] = {}  # key -> [top, start, holders, {end: holders} | None]
        self.reserved = 0

    def _top(self, key: str, start: int) -> int:
        e = self._held.get(key)
        return e[0] if e is not None else start

    def marginal(self, segs: Sequence[Segment]) -> int:
        """Tokens of `segs` that no running request holds yet.

        A long chain (block hashes) is searched, not walked: holders hold whole chains from
        their start, so the segments held fully form a head of the chain, and past the first
        one held partly or not at all, none is held (a block's hash covers every token before
        it). The search gallops from the chain's start (1, 2, 4, ... segments), then bisects:
        O(log k) dictionary lookups for a held head of k segments, one when nothing is held."""
        held = self._held
        if len(segs) <= 4:
            out = 0
            for key, start, end in segs:
                e = held.get(key)
                top = e[0] if e is not None else start
                if end > top:
                    out += end - top
            return out
        n = len(segs)
        lo, hi, step = 0, n, 1  # segs[:lo] are held in full; the first that is not lies in [lo, hi)
        while lo < hi:
            mid = min(lo + step - 1, hi - 1) if step else (lo + hi) // 2
            key, start, end = segs[mid]
            e = held.get(key)
            if e is not None and e[0] >= end:
                lo = mid + 1
                step = step * 2 if step else 0
            else:
                hi = mid
                step = 0  # past the held head: bisect what is left
        if lo == n:
            return 0
        key, start, end = segs[lo]
        e = held.get(key)
        top = e[0] if e is not None else start
        return segs[-1].end - max(start, min(end, top))

    def covered(self, segs: Iterable[Segment]) -> int:
        """Tokens of `segs` that running requests already hold (what the engine has cached)."""
        return sum(max(0, min(end, self._top(key, start)) - start) for key, start, end in segs)

    def add(self, segs: Iterable[Segment]) -> int:
        """A request holding `segs` starts running: returns the tokens newly reserved."""
        held = self._held
        added = 0
        for key, start, end in segs:
            e = held.get(key)
            if e is None:
                held[key] = [end, start, 1, None]
                added += end - start
                continue
            e[2] += 1
            if end == e[0] and e[3] is None:
                continue
            ends = e[3]
            if ends is None:  # holders of different ends: count each end from now on
                ends = e[3] = {e[0]: e[2] - 1}
            ends[end] = ends.get(end, 0) + 1
            if end > e[0]:
                added += end - e[0]
                e[0] = end
        self.reserved += added
        return added

    def remove(self, segs: Iterable[Segment]) -> int:
        """A request holding `segs` stopped running: returns the tokens no longer reserved."""
        held = self._held
        freed = 0
        for key, _, end in segs:
            e = held.get(key)
            if e is None:
                continue
            ends = e[3]
            if ends is None:
                if end != e[0]:
                    continue  # not a holder
            else:
                left = ends.get(end, 0) - 1
                if left < 0:
                    continue  # not a holder
                if left:
                    ends[end] = left
                else:
                    del ends[end]
            e[2] -= 1
            if e[2] == 0:
                freed += e[0] - e[1]
                del held[key]
            elif ends is not None and end == e[0] and end not in ends:
                top = max(ends)
                freed += end - top
                e[0] = top
        self.reserved -= freed
        return freed

    def __len__(self) -> int:
        return len(self._held)


@dataclass
class PrefixLedger:
    """One agent's holds of its shared prefixes, for its charges (see the module docstring).

    Per prefix id: the rectangle (tokens x decode steps) its unfinished requests hold, and
    how many hold it. A request is charged the area its own rectangle adds."""

    _holds: dict[str, list[int]] = field(default_factory=dict)  # key -> [tokens, steps, holders]

    def charge(self, segs: Iterable[Segment], output_tokens: int) -> float:
        """KV token-time of `segs` for a request decoding `output_tokens`, net of what the
        agent's other unfinished requests already hold (and record its hold)."""
        d = int(output_tokens)
        total = 0.0
        for s in segs:
            hold = self._holds.get(s.key)
            if hold is None:
                self._holds[s.key] = [s.tokens, d, 1]
                total += s.tokens * d
                continue
            total += s.tokens * d - min(s.tokens, hold[0]) * min(d, hold[1])
            hold[0] = max(hold[0], s.tokens)
            hold[1] = max(hold[1], d)
            hold[2] += 1
        return float(total)

    def release(self, segs: Iterable[Segment]) -> None:
        """A request holding `segs` finished (or was dropped)."""
        for s in segs:
            hold = self._holds.get(s.key)
            if hold is None:
                continue
            hold[2] -= 1
            if hold[2] <= 0:
                del self._holds[s.key]

    def __len__(self) -> int:
        return len(self._holds)


def stage_kv_cost(requests: Sequence[tuple[int, int, Sequence[PrefixRef]]], block_size: int = 1) -> float:
    """KV token-time of one stage (requests running side by side) with its shared prefixes
    charged once per agent: what the dispatcher charges an agent that submits the stage."""
    ledger = PrefixLedger()
    total = 0.0
    for p, d, chain in requests:
        segs = segments(chain, block_size)
        total += private_kv_cost(p, d, shared_tokens(segs)) + ledger.charge(segs, d)
    return total


def block_chain(token_ids: Sequence[int], block_size: int, salt: str = "") -> tuple[PrefixRef, ...]:
    """The prefix chain of a prompt by hashing its whole blocks, each hash covering every
    token before it (as vLLM's prefix cache does): two prompts with a common head of k whole
    blocks share the first k ids of their chains. Used by the live server, which sees token
    ids, not prefix names. The last block is left out when the prompt ends on it: vLLM
    recomputes at least the last prompt token, so that block is never a full cache hit."""
    bs = max(1, int(block_size))
    n = (len(token_ids) - 1) // bs
    out: list[PrefixRef] = []
    h = hash(salt)
    for k in range(n):
        h = hash((h, tuple(token_ids[k * bs:(k + 1) * bs])))
        out.append((f"b{h & 0xFFFFFFFFFFFFFFFF:x}", (k + 1) * bs))
    return tuple(out)
