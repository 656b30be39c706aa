"""Retention: whether a paused agent's context is kept in the engine's KV cache.

An agent paused between its stages (a tool call, pauses.py) usually resends its conversation
when it comes back. Left to the engine's LRU prefix cache, that context is evicted as soon as
other work needs the memory, and the next turn prefills it again. Keeping it costs memory
that others could use while the agent is away. The rule weighs the two:

* **Prefilling it again** costs the engine `K x c` seconds for K tokens (c: the engine's
  prefill time per token, measured): every running request waits through that prefill.
* **Holding it** for the rest of the pause R takes K of the M tokens of KV memory: at
  saturation the engine's throughput is proportional to the memory in use, so holding costs
  `K / M x R` seconds of the whole engine.

Holding pays while `R < M x c` (the *break-even pause*; K cancels). R is not known: the rule
takes the expected remaining pause given the time already paused, from the pauses seen for
the agent's type (a heavy-tailed pause that has lasted long is expected to last longer), and
scales the saving by the share of a context that agents of that type resent (`ReuseStats`:
an agent whose next stage does not resend its context gains nothing from its being kept).
So a context is kept while `E[R - elapsed | R > elapsed] < reuse x M x c`.

A context may be judged in *parts* whose resend shares differ: the prefixes a stage's
requests shared (a system prompt, the question every sample answered) are resent by the next
stage far more often than each request's own output (the samples a vote reads only in part).
Judged as one, the share of the whole is small and nothing is kept; judged apart, each part
is kept while it pays by its own share (K cancels per part just as for the whole).

Kept memory is charged to the agent's KV token-time (tokens x seconds held, counted in engine
iterations), as if it were running, moving its tag from where it stands; a kept context gives
way when an agent ahead of it in virtual-finish order needs the memory and has waited for it
as long as prefilling the context again would stall the engine (`pins_to_release`), so
retention costs the agents the fair order favours no more than losing the context would.

Modes: `auto` (the rule), `always` (keep through every pause; yields still apply), `never`.
Pure: callers pass the times and the engine's figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .cost import KV
from .pauses import PauseStats, expected_remaining_s
from .policy_base import FOOTPRINT

if TYPE_CHECKING:
    from .dispatcher import Dispatcher
    from .state import AgentState

__all__ = ["OWN", "RETAIN_MODES", "SHARED", "Pin", "ReuseStats", "Retention", "break_even_pause_s", "charge_retained",
           "expected_remaining_s", "fair_order", "head_need", "hold_charge", "keep_until_s",
           "pins_to_release"]

RETAIN_MODES = ("auto", "always", "never")
# The parts a context is judged in: the prompt prefixes the stage's requests named (shared
# with each other or with agents of the type: system prompts, a question, the conversation
# they extended) and what each request added of its own (the rest of its prompt, its output).
SHARED, OWN = "shared", "own"
# A type's resend rate starts from this many resends out of as many pauses (optimistic: keep
# until the type shows its contexts are not resent).
REUSE_PRIOR = 1.0
# The horizon is this times the break-even pause, scaled by the resend share; and a kept
# context gives way to an agent ahead once that agent has waited for memory YIELD_WAIT times
# the seconds prefilling the context again would take (pins_to_release: the prefill stalls
# every running request, the wait only the one). Chosen together on the simulator's tuning
# seeds (benchmarks/retention_sim.py: scales 0.5, 1, 2 x waits 1, 4, 16, best mean JCT over
# the multi-turn and agentic mixes): a wait of 16 halved the agentic mix's re-prefill against
# 1 and gained up to 5 points of its mean JCT; scales 2 and 1 within half a point of each other.
HORIZON_SCALE = 2.0
YIELD_WAIT = 16.0


def check_mode(mode: str) -> str:
    if mode not in RETAIN_MODES:
        raise ValueError(f"retain must be one of {', '.join(RETAIN_MODES)}, not {mode!r}")
    return mode


def break_even_pause_s(kv_capacity_tokens: float, prefill_token_s: float) -> float:
    """The pause below which holding a context costs less than prefilling it again: M x c."""
    return max(0.0, float(kv_capacity_tokens) * float(prefill_token_s))


def keep_until_s(seen: Sequence[float], horizon_s: float) -> float:
    """How long into a pause a context is kept: the first elapsed time at which the expected
    remaining pause reaches `horizon_s` (the rule's threshold). With no pause seen, the
    horizon itself (a pause no longer than the break-even pays whatever it is).

    Between two pauses seen, the expected remaining pause falls as time passes (the same
    pauses are still ahead); it jumps up as each one is passed. So the first elapsed time
    at which it reaches the horizon is 0 or just past one of the pauses seen."""
    if horizon_s <= 0.0:
        return 0.0
    if not seen:
        return horizon_s
    xs = sorted(seen)
    n = len(xs)
    suffix = [0.0] * (n + 1)
    for k in range(n - 1, -1, -1):
        suffix[k] = suffix[k + 1] + xs[k]
    if suffix[0] / n >= horizon_s:
        return 0.0
    for k, x in enumerate(xs):
        # just past xs[k]: the pauses ahead are those after it (equal ones passed too)
        j = k + 1
        while j < n and xs[j] <= x:
            j += 1
        if j == n:
            return x  # past every pause seen: nothing says it ends soon
        if suffix[j] / (n - j) - x >= horizon_s:
            return x
    return xs[-1]


@dataclass
class ReuseStats:
    """Per agent type and part of a context (None: the whole of it): the share of what a
    paused agent left that its next stage resent (tokens resent over tokens left), averaged
    over its pauses."""

    # (type, part) -> [sum of shares, pauses]
    _counts: dict[tuple[str | None, str | None], list[float]] = field(default_factory=dict)

    def observe(self, agent_type: str | None, resent_tokens: float, context_tokens: float,
                part: str | None = None) -> None:
        if context_tokens <= 0:
            return
        c = self._counts.setdefault((agent_type, part), [0.0, 0.0])
        c[0] += min(1.0, max(0.0, resent_tokens / context_tokens))
        c[1] += 1.0

    def rate(self, agent_type: str | None, part: str | None = None) -> float:
        resent, pauses = self._counts.get((agent_type, part), (0.0, 0.0))
        return (resent + REUSE_PRIOR) / (pauses + REUSE_PRIOR)


class Retention:
    """The retention rule of one scheduler: mode, pauses seen and resend rates."""

    def __init__(self, mode: str, pauses: PauseStats) -> None:
        self.mode = check_mode(mode)
        self.pauses = pauses
        self.reuse = ReuseStats()

    @property
    def active(self) -> bool:
        return self.mode != "never"

    def horizon_s(self, agent_type: str | None, kv_capacity_tokens: float, prefill_token_s: float,
                  part: str | None = None) -> float:
        """The expected remaining pause below which the agent's context (or that part of it)
        is worth keeping."""
        return (HORIZON_SCALE * self.reuse.rate(agent_type, part)
                * break_even_pause_s(kv_capacity_tokens, prefill_token_s))

    def keep_until(self, agent_type: str | None, paused_since: float, kv_capacity_tokens: float,
                   prefill_token_s: float, part: str | None = None) -> float:
        """The time until which a context (or that part of it) left at `paused_since` is kept
        (inf: always; equal to `paused_since`: not kept)."""
        if self.mode == "never":
            return paused_since
        if self.mode == "always":
            return float("inf")
        horizon = self.horizon_s(agent_type, kv_capacity_tokens, prefill_token_s, part)
        return paused_since + keep_until_s(self.pauses.seen(agent_type), horizon)

    def keep_until_for(self, agent: AgentState, kv_capacity_tokens: float, prefill_token_s: float,
                       part: str | None = None) -> float | None:
        """`keep_until` for a paused agent as the scheduler sees it (None: not paused): in a
        tool call its client announced, judged from that tool's calls; with a declared
        length L, kept when L is under the horizon, until L plus the horizon (overrunning
        the horizon's length costs what one prefill would)."""
        basis = self.pauses.pause_basis(agent)
        if basis is None:
            return None
        since, seen, declared = basis
        if self.mode != "auto":
            return self.keep_until(agent.agent_type, since, kv_capacity_tokens, prefill_token_s, part)
        horizon = self.horizon_s(agent.agent_type, kv_capacity_tokens, prefill_token_s, part)
        if declared is not None:
            return since + declared + horizon if declared < horizon else since
        return since + keep_until_s(seen, horizon)

    def keeps(self, agent_type: str | None, paused_since: float, now: float, kv_capacity_tokens: float,
              prefill_token_s: float) -> bool:
        return now < self.keep_until(agent_type, paused_since, kv_capacity_tokens, prefill_token_s)


@dataclass(frozen=True)
class Pin:
    """A kept context: whose, how many tokens, and its owner's place in the fair order."""

    agent_id: str
    tokens: int
    order: float  # the owner's virtual finish


def pins_to_release(pins: Sequence[Pin], ahead_of: float, need_tokens: int, free_tokens: int,
                    waited_s: float = float("inf"), prefill_token_s: float = 0.0,
                    running_tokens: float = float("inf")) -> list[str]:
    """The owners whose kept contexts give way so that a request of an agent at virtual
    finish `ahead_of` that needs `need_tokens` fits where `free_tokens` are free: pins of
    agents behind it in the fair order, the furthest behind first, as few as suffice; none
    when releasing all of them would not make it fit.

    A pin gives way only once the agent ahead has waited for memory (`waited_s`) YIELD_WAIT
    times as long as the engine would stall prefilling that context again (its tokens x
    `prefill_token_s`): while the engine is busy, memory frees as running requests finish,
    usually before that, and a context given up sooner stalls every running request, the
    agents ahead among them, for longer than the wait it saved. Waiting pays only while the
    running requests (`running_tokens` of memory) hold more than the pins behind it do: kept
    contexts holding more give way at once, or the memory each finished request frees would
    go to the next pin while the engine runs dry."""
    if need_tokens <= free_tokens:
        return []
    behind = [p for p in pins if p.order > ahead_of]
    if sum(p.tokens for p in behind) < running_tokens:
        behind = [p for p in behind if YIELD_WAIT * p.tokens * prefill_token_s <= waited_s]
    behind.sort(key=lambda p: p.order, reverse=True)
    if free_tokens + sum(p.tokens for p in behind) < need_tokens:
        return []
    out: list[str] = []
    for p in behind:
        if free_tokens >= need_tokens:
            break
        out.append(p.agent_id)
        free_tokens += p.tokens
    return out


def hold_charge(tokens: int, since: float, until: float) -> float:
    """KV token-time of a context held from `since` to `until`."""
    return float(tokens) * max(0.0, until - since)


# -- what retention asks of the dispatcher ----------------------------------------------------
def head_need(d: Dispatcher, now: float) -> tuple[str, int] | None:
    """The agent whose request is admitted next and the memory it needs (None: nothing
    queued): what a kept context gives way to."""
    req = d.queue.peek(now)
    if req is None:
        return None
    return req.spec.agent_id, d.ledger.need(req, d.policy.admission == FOOTPRINT)


def fair_order(d: Dispatcher, agent_id: str) -> float:
    """The agent's place in the fair order: its virtual finish tag."""
    return float(d.agents[agent_id].virtual_finish)


def charge_retained(d: Dispatcher, agent_id: str, kv_token_s: float, now: float) -> None:
    """Charge KV token-time held for the agent while it was paused (its kept context) as if
    it had been running: tokens x seconds, in the cost model's unit (a token held for one
    engine iteration of `d.tau` seconds). Its tag moves by it from where it stands: a paused
    agent keeps its place in virtual time, so a charge never sends it back to the virtual
    clock's present (the over-run rule's re-arrival would cost an agent the fair order
    favours its whole lead for a few kept tokens). Its promise moves with its tag."""
    agent = d.agents.get(agent_id)
    if agent is None or kv_token_s <= 0 or d.policy.cost_model != KV or d.tau <= 0:
        return
    units = kv_token_s / d.tau
    now = max(now, d.clock.now)  # a charge read off a clock a step behind still lands in order
    agent.consumed_cost += units
    agent.committed_cost += units
    agent.charged_cost += units
    agent.virtual_finish = d.clock.shift(agent_id, agent.virtual_finish, units, now)
    agent.fair_at = None  # its tag moved: the cached projection no longer applies
    d.promises.bound(agent)
    d.promises.promise(agent, now)
    d.queue.requeue(agent)
