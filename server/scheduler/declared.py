"""Work a client has declared and holds back: the rest of a batch it submits a few at a time.

A batch of N inputs run at concurrency C registers C agents at once; the other N - C wait in
the client and register one by one as slots free up. Measured arrivals see only the first C,
so the first agents' ETAs would count none of the N - C still to come, though under fair
sharing each of those that is cheaper than what an agent has left goes ahead of it. A client
that declares the batch (`metadata["batch"] = {"id", "size", "index", ...}`, as the SDK does)
lets the ETAs expect it: the work still held back is the declared inputs not yet registered
times the mean cost of those that were, and it arrives as the engine serves the batch (a slot
frees when an agent ends), at the rate the engine serves work (`WorkArrivals.freeze`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Batches remembered at once (a bounded table whatever the clients declare).
MAX_BATCHES = 256
#: Inputs a batch may declare still to come: a larger declaration counts as this many.
MAX_HELD_BACK = 100_000
#: A batch none of whose inputs registered for this long is taken for ended (a client
#: interrupted it, or its last inputs failed before registering): it is forgotten.
IDLE_S = 120.0


@dataclass
class _Batch:
    size: int
    registered: int = 0  # inputs seen: the highest index registered, plus one
    work: float = 0.0  # summed cost of the registrations seen
    registrations: int = 0
    last: float = 0.0


@dataclass
class DeclaredBatches:
    """The batches clients declared, by id (see the module docstring)."""

    idle_s: float = IDLE_S
    _batches: dict[str, _Batch] = field(default_factory=dict)

    def add(self, t: float, cost: float, batch_id: str, size: int, index: int | None) -> int:
        """An agent of a declared batch registered at `t`, its cost `cost`; `index` its input
        (None: counted in order). Returns the batch's registrations so far."""
        entry = self._batches.get(batch_id)
        if entry is None:
            if len(self._batches) >= MAX_BATCHES:  # forget the one idle longest
                del self._batches[min(self._batches, key=lambda b: self._batches[b].last)]
            entry = self._batches[batch_id] = _Batch(size=max(0, size))
        seen = entry.registered + 1 if index is None else index + 1
        entry.registered = max(entry.registered, min(seen, entry.size))
        entry.work += cost
        entry.registrations += 1
        entry.last = max(entry.last, t)
        return entry.registrations

    def held_back(self, now: float) -> float:
        """Work declared and not yet registered (cost units); forgets ended batches."""
        total = 0.0
        for batch_id in list(self._batches):
            entry = self._batches[batch_id]
            left = min(MAX_HELD_BACK, entry.size - entry.registered)
            if left <= 0 or now - entry.last > self.idle_s:
                del self._batches[batch_id]
                continue
            total += left * entry.work / entry.registrations
        return total

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._batches

    def __len__(self) -> int:
        return len(self._batches)


@dataclass(frozen=True)
class BatchDeclaration:
    """What a registration says of its batch: its id, its size, and which input it is."""

    batch_id: str
    size: int
    index: int | None = None
