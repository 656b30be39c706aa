"""Retention in the simulator: the scheduler core's rule (server/scheduler/retention.py)
applied to the engine model's prefix cache.

When an agent pauses between stages, the sequences its last stage left cached (its context,
`EngineModel` with `cache_sequences`) are pinned for as long as the rule keeps them: not
evictable, not free, so admission does not hand their memory to others. The context is judged
in two parts, each kept while its own resend share makes it pay: the prefixes its requests
named (`SHARED`) and the sequences they left under their own ids (`OWN`). The pin of a part
ends when the agent's next request is admitted (it finds its context cached), or at once when
that request does not resend it, when the rule stops keeping it (`keep_until`), when an agent
ahead of it in the fair order has waited long enough for the memory (`pins_to_release`; the
wait counts from the first admission round that found that agent's request not fitting), or, in the engine, before
any running request would be preempted. The tokens held times the seconds held are charged
to the agent's KV token-time.

The rule is the scheduler core's; the pins are the engine model's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from server.scheduler import Dispatcher
from server.scheduler.policies import FOOTPRINT
from server.scheduler.retention import (
    OWN,
    SHARED,
    Pin,
    Retention,
    charge_retained,
    fair_order,
    head_need,
    hold_charge,
    pins_to_release,
)

from .engine import EngineModel


@dataclass
class _Held:
    keys: dict[str, tuple[int, float]]  # entry -> (tokens its pin took from free memory, kept until)
    since: float

    @property
    def tokens(self) -> int:
        return sum(t for t, _ in self.keys.values())


@dataclass
class SimRetention:
    """Pins of one simulated run (mode `never`: records resends, pins nothing)."""

    rule: Retention
    disp: Dispatcher
    engine: EngineModel
    kv_tokens: int
    prefill_token_s: float
    pins: dict[str, _Held] = field(default_factory=dict)
    last_keys: dict[str, list[str]] = field(default_factory=dict)  # agent -> its last stage's kept sequences
    last_heads: dict[str, list[str]] = field(default_factory=dict)  # agent -> the prefixes those extend
    sizes: dict[str, dict[str, int]] = field(default_factory=dict)  # agent -> tokens of each of those
    held_token_s: float = 0.0  # KV token-time charged for kept contexts
    yielded: int = 0  # pins given up for an agent ahead in the fair order
    blocked: tuple[str, float] | None = None  # the head of the queue that did not fit, since when

    def request_kept(self, agent_id: str, key: str | None, heads: Iterable[str] = ()) -> None:
        """A finished request's sequence stayed cached under `key`, after the prefixes
        `heads` (which its context needs too: a cache hit runs from the first token)."""
        if key is not None:
            self.last_keys.setdefault(agent_id, []).append(key)
            heads = [h for h in heads if h != key]
            self.last_heads.setdefault(agent_id, []).extend(heads)
            sizes = self.sizes.setdefault(agent_id, {})
            for k in (*heads, key):
                e = self.engine.cache.entries.get(k)
                if e is not None:
                    sizes[k] = max(sizes.get(k, 0), e.tokens)

    def pause(self, agent_id: str, agent_type: str, now: float) -> None:
        """The agent paused with nothing in flight: pin each part of its context while the
        rule keeps that part."""
        if not self.rule.active:
            return
        entries = self.engine.cache.entries
        shared = [k for k in dict.fromkeys(self.last_heads.get(agent_id, [])) if k in entries]
        own = [k for k in dict.fromkeys(self.last_keys.get(agent_id, [])) if k in entries and k not in shared]
        kept: dict[str, tuple[int, float]] = {}
        limit = float("inf")
        for part, keys in ((SHARED, shared), (OWN, own)):
            # a sequence is found cached only with the prefixes before it: kept no longer
            until = min(limit, self.rule.keep_until(agent_type, now, self.kv_tokens, self.prefill_token_s, part))
            if until > now:
                kept.update((k, (self.engine.cache.pin(k), until)) for k in keys)
            limit = until if keys else limit
        if kept:
            self.pins[agent_id] = _Held(kept, now)

    def resume(self, agent_id: str, agent_type: str, next_keys: Iterable[str], now: float) -> None:
        """The agent's next stage is submitted (`next_keys`: the prefixes it names): learn,
        per part, how much of its context it resent; what it does not resend is let go now,
        the rest is kept until its request is admitted."""
        resent = set(next_keys)
        own = set(self.last_keys.pop(agent_id, []))
        shared = set(self.last_heads.pop(agent_id, [])) - own
        sizes = self.sizes.pop(agent_id, {})
        for part, keys in ((SHARED, shared), (OWN, own)):
            left = {k: t for k, t in sizes.items() if k in keys}
            self.rule.reuse.observe(agent_type, sum(t for k, t in left.items() if k in resent),
                                    sum(left.values()), part)
        held = self.pins.get(agent_id)
        if held is None:
            return
        self._let_go(agent_id, held, [k for k in held.keys if k not in resent], now)
        if agent_id in self.pins:
            held.keys = {k: (t, float("inf")) for k, (t, _) in held.keys.items()}

    def release(self, agent_id: str, now: float) -> None:
        """End the agent's pin (whatever is left of it) and charge what it held."""
        held = self.pins.get(agent_id)
        if held is not None:
            self._let_go(agent_id, held, list(held.keys), now)

    def expire(self, now: float) -> None:
        """Parts the rule no longer keeps (the pause outlasted what pays for them)."""
        for agent_id, held in list(self.pins.items()):
            self._let_go(agent_id, held, [k for k, (_, until) in held.keys.items() if until <= now], now)

    def _let_go(self, agent_id: str, held: _Held, keys: list[str], now: float) -> None:
        """Unpin those entries of the agent's kept context and charge what they held."""
        if not keys:
            return
        charge = 0.0
        for k in keys:
            tokens, until = held.keys.pop(k)
            self.engine.cache.unpin(k)
            charge += hold_charge(tokens, held.since, min(now, until))
        if not held.keys:
            del self.pins[agent_id]
        self.held_token_s += charge
        charge_retained(self.disp, agent_id, charge, now)

    def make_way(self, now: float) -> bool:
        """The head of the queue does not fit: pins of agents behind it give way (True when
        some did; admission should run again)."""
        if not self.pins:
            return False
        head = head_need(self.disp, now)
        if head is None:
            return False
        agent_id, need = head
        if self.disp.policy.admission == FOOTPRINT and self.disp.kv_capacity - self.disp.ledger.reserved_kv < need:
            return False  # its reservation does not fit anyway: memory held by pins is not why
        if self.blocked is None or self.blocked[0] != agent_id:
            self.blocked = (agent_id, now)
        pins = [Pin(a, h.tokens, fair_order(self.disp, a)) for a, h in self.pins.items() if a != agent_id]
        engine = self.engine
        running = engine.kv_used - engine.cache.evictable - sum(h.tokens for h in self.pins.values())
        out = pins_to_release(pins, fair_order(self.disp, agent_id), need, engine.free_kv,
                              now - self.blocked[1], self.prefill_token_s, running)
        for a in out:
            self.release(a, now)
        self.yielded += len(out)
        return bool(out)

    def summary(self) -> dict:
        return {"retain": self.rule.mode, "retained_kv_token_s": self.held_token_s,
                "retention_yields": self.yielded, "retention_pins_broken": self.engine.pins_broken}
