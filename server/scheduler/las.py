"""las's queue: the llm-d program-aware fairness plugin's score over backlogged agents.

The plugin (llm-d-router PR #1534, `strategy_las.go`) picks, among the programs that have a
queued request, the one with the highest

    score = w_s * (1 - norm(service)) + w_w * norm(head wait)

where norm(x) = (x - min) / (max - min) over those programs (0.5 for all when max = min),
service is the decayed attained service and head wait the age of the program's oldest queued
request (w_s = 0.8, w_w = 0.2 by default). Both terms depend on `now` and on who else is
backlogged, so no static heap key exists: `peek` scores every backlogged agent, O(n) per
admission, as the plugin's `Pick` does. With w_w = 0 the order is static and the policy uses
the ordinary `AgentHeapQueue` instead (O(log n)).

Service enters only through norm(), and decay multiplies every agent's service by the same
factor, so the score needs no clock reading of its own: it is computed from the agents'
log-space service (`AgentState.las_service`, policies.LAS) relative to the largest.
"""

from __future__ import annotations

import heapq
import math

from .state import AgentState, RequestState


def log2_add(a: float, b: float) -> float:
    """log2(2^a + 2^b), without forming either power."""
    hi, lo = (a, b) if a >= b else (b, a)
    if lo == -math.inf:
        return hi
    return hi + math.log2(1.0 + 2.0 ** (lo - hi))


class LasScoreQueue:
    """Backlogged agents, each with its pending requests in arrival order; the next request
    is the head of the best-scoring agent (ties: the oldest head). No backfill."""

    def __init__(self, service_weight: float, wait_weight: float) -> None:
        self._ws = service_weight
        self._ww = wait_weight
        self._backlogged: dict[int, AgentState] = {}  # agent seq -> agent with pending requests
        self._leader: AgentState | None = None  # the agent of the last `peek`

    def push(self, agent: AgentState, req: RequestState) -> None:
        heapq.heappush(agent.heap, (req.order, req.seq, req))
        self._backlogged[agent.seq] = agent

    def peek(self, now: float) -> RequestState | None:
        self._leader = self._best(now)
        return self._leader.heap[0][2] if self._leader is not None else None

    def pop(self, agent: AgentState, req: RequestState) -> None:
        heapq.heappop(agent.heap)
        self._forget_if_empty(agent)

    def remove(self, agent: AgentState, req: RequestState) -> None:
        agent.heap = [e for e in agent.heap if e[2] is not req]
        heapq.heapify(agent.heap)
        self._forget_if_empty(agent)

    def remove_agent(self, agent: AgentState, pending: list[RequestState]) -> None:
        agent.heap.clear()
        self._forget_if_empty(agent)

    def requeue(self, agent: AgentState) -> None:
        """Nothing to do: scores are computed at `peek`."""

    def defer(self) -> bool:
        return False

    def restore(self) -> None:
        """No backfill, nothing set aside."""

    def head(self, agent: AgentState) -> RequestState | None:
        return agent.heap[0][2] if agent.heap else None

    def leader(self) -> AgentState | None:
        if self._leader is not None and not self._leader.heap:
            self._leader = None
        return self._leader

    def _forget_if_empty(self, agent: AgentState) -> None:
        if not agent.heap:
            self._backlogged.pop(agent.seq, None)
            if self._leader is agent:
                self._leader = None

    def _best(self, now: float) -> AgentState | None:
        agents = list(self._backlogged.values())
        if not agents:
            return None
        top = max(a.las_service for a in agents)
        low = min(a.las_service for a in agents)
        # service relative to the largest: 2^(L - top) in [0, 1], no overflow, decay-free
        floor = 2.0 ** (low - top) if top > -math.inf else 1.0
        span = 1.0 - floor
        waits = [now - a.heap[0][2].submitted_at for a in agents]
        w_lo, w_span = min(waits), max(waits) - min(waits)
        best, best_key = None, (-math.inf, 0)
        for a, wait in zip(agents, waits, strict=True):
            rel = 2.0 ** (a.las_service - top) if top > -math.inf else 1.0
            n_service = (rel - floor) / span if span > 0 else 0.5
            n_wait = (wait - w_lo) / w_span if w_span > 0 else 0.5
            key = (self._ws * (1.0 - n_service) + self._ww * n_wait, -a.heap[0][2].seq)
            if key > best_key:
                best, best_key = a, key
        return best
