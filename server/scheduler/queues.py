"""Queue discipline: where pending requests wait and which one is admitted next.

The dispatcher drives every policy through one small protocol, `RequestQueue` (vLLM's
scheduler does the same with its `RequestQueue`): it pushes submitted requests, peeks at the
next one, checks that it fits, pops it and marks it running. Two implementations:

- `AgentHeapQueue` (fcfs, sjf, vtc, parrot, srjf, justitia, justitia-c, equinox): every agent
  keeps a heap of its pending requests in the policy's `request_order`, and the queue keeps a
  heap of agents ordered by `agent_key(agent, head)`. The request admitted next is the head of
  the agent with the smallest key. An agent whose key changes is pushed again under a new
  version; older entries go stale and are dropped when they reach the top (O(log n) per
  event). It supports backfill: `defer` sets the blocked agent aside so that `peek` looks past
  it, `restore` puts the set-aside agents back.
- `EwsjfState` (ewsjf.py): per-group FIFO queues and a score that grows with waiting time, so
  no static key exists; `peek` scores the group heads at `now`. No backfill (`defer` is False).

docs/architecture.md has the picture.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

from .state import AgentState, RequestState, SortKey

AgentKey = Callable[[AgentState, RequestState], SortKey]


class RequestQueue(Protocol):
    """Pending requests in admission order."""

    def push(self, agent: AgentState, req: RequestState) -> None:
        """Queue a submitted request (the agent's key is refreshed by `requeue`)."""
        ...

    def peek(self, now: float) -> RequestState | None:
        """The request admitted next at `now`, or None when nothing waits."""
        ...

    def pop(self, agent: AgentState, req: RequestState) -> None:
        """Take the request `peek` returned: it is being admitted."""
        ...

    def remove(self, agent: AgentState, req: RequestState) -> None:
        """A pending request leaves without being admitted (rejected or finished early)."""
        ...

    def remove_agent(self, agent: AgentState, pending: list[RequestState]) -> None:
        """The agent is finished or cancelled: forget its pending requests."""
        ...

    def requeue(self, agent: AgentState) -> None:
        """The agent's key or head may have changed: order it again."""
        ...

    def defer(self) -> bool:
        """Backfill: set the agent of the blocked head aside so that `peek` looks past it.
        False when the queue does not backfill (or has set aside as many as it may)."""
        ...

    def restore(self) -> None:
        """Put the agents set aside by `defer` back in line (end of an admission round)."""
        ...

    def head(self, agent: AgentState) -> RequestState | None:
        """The agent's own next request, when the queue orders agents (else None)."""
        ...

    def leader(self) -> AgentState | None:
        """The agent whose head is admitted next, when the queue orders agents (else None)."""
        ...


class AgentHeapQueue:
    """A heap of agents keyed by `key(agent, head)`, over per-agent heaps of requests."""

    def __init__(self, key: AgentKey, backfill_depth: int = 0) -> None:
        self._key = key
        self._depth = backfill_depth  # 0: strict order, never look past a blocked head
        # (key, version, agent seq, agent): keys are unique across agents (they end in a
        # sequence number), so ties never reach the AgentState.
        self._heap: list[tuple[SortKey, int, int, AgentState]] = []
        self._deferred: list[AgentState] = []

    def push(self, agent: AgentState, req: RequestState) -> None:
        heapq.heappush(agent.heap, (req.order, req.seq, req))

    def peek(self, now: float) -> RequestState | None:
        agent = self._top()
        return agent.heap[0][2] if agent is not None else None

    def pop(self, agent: AgentState, req: RequestState) -> None:
        heapq.heappop(agent.heap)
        agent.version += 1  # its heap entry is stale; `requeue` files it again
        agent.in_heap = False

    def remove(self, agent: AgentState, req: RequestState) -> None:
        agent.heap = [e for e in agent.heap if e[2] is not req]
        heapq.heapify(agent.heap)

    def remove_agent(self, agent: AgentState, pending: list[RequestState]) -> None:
        agent.heap.clear()
        agent.version += 1
        agent.in_heap = False

    def requeue(self, agent: AgentState) -> None:
        """(Re)insert the agent under its current key; its older entries go stale. An
        agent whose valid entry already has that key keeps it: most submissions leave the
        head and the key as they were, and every stale entry costs a pop later (10,000
        queued requests: about five pops of a 10,000-entry heap per decision)."""
        if agent.heap:
            key = self._key(agent, agent.heap[0][2])
            if agent.in_heap and agent.heap_key == key:
                return
            agent.version += 1
            heapq.heappush(self._heap, (key, agent.version, agent.seq, agent))
            agent.heap_key = key
            agent.in_heap = True
        else:
            agent.version += 1
            agent.in_heap = False

    def defer(self) -> bool:
        if len(self._deferred) >= self._depth:
            return False
        agent = heapq.heappop(self._heap)[3]  # the top is valid: `peek` just returned it
        agent.in_heap = False
        self._deferred.append(agent)
        return True

    def restore(self) -> None:
        for agent in self._deferred:
            self.requeue(agent)
        self._deferred.clear()

    def head(self, agent: AgentState) -> RequestState | None:
        return agent.heap[0][2] if agent.heap else None

    def leader(self) -> AgentState | None:
        return self._top()

    def _top(self) -> AgentState | None:
        """The agent whose head request is next, dropping stale entries."""
        heap = self._heap
        while heap:
            _, version, _, agent = heap[0]
            if agent.version == version and agent.in_heap and agent.heap:
                return agent
            heapq.heappop(heap)
        return None


TenantPosition = Callable[[AgentState], float]


class TenantQueue:
    """Tenants first, then agents (hierarchical fair share; tenant_clock.py).

    Each tenant's agents wait in an `AgentHeapQueue` of their own, in the policy's order;
    the tenants wait in a heap keyed by `position(leader)`: the H-GPS finish, on the top
    level's virtual scale, of the agent the tenant would serve next. A position moves only
    with an event of its own tenant, so a tenant is re-keyed when one of its agents is
    (`requeue`) and nothing else is touched. With one tenant the queue is that tenant's
    `AgentHeapQueue`, decision for decision."""

    def __init__(self, key: AgentKey, position: TenantPosition, backfill_depth: int = 0) -> None:
        self._key = key
        self._position = position
        self._depth = backfill_depth
        self._queues: dict[object, AgentHeapQueue] = {}
        self._order: dict[object, int] = {}  # tenant -> first-seen rank (ties)
        self._heap: list[tuple[float, int, int, object]] = []  # (position, version, rank, tenant)
        self._version: dict[object, int] = {}
        self._deferred: list[object] = []  # tenants with an agent set aside
        self._set_aside = 0
        self._solo: AgentHeapQueue | None = None

    def _queue(self, tenant: object) -> AgentHeapQueue:
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = AgentHeapQueue(self._key, self._depth)
            self._order[tenant] = len(self._order)
            self._version[tenant] = 0
            if len(self._queues) == 1:
                self._solo = q
            else:
                self._solo = None
                for other in self._queues:  # two tenants now: order them
                    if other != tenant:
                        self._retag(other)
        return q

    def _retag(self, tenant: object) -> None:
        if self._solo is not None:
            return
        q = self._queues[tenant]
        self._version[tenant] += 1
        leader = q.leader()
        if leader is not None:
            heapq.heappush(self._heap, (self._position(leader), self._version[tenant], self._order[tenant], tenant))

    def _top(self) -> AgentHeapQueue | None:
        if self._solo is not None:
            return self._solo
        heap = self._heap
        while heap:
            _, version, _, tenant = heap[0]
            if self._version[tenant] == version:
                return self._queues[tenant]
            heapq.heappop(heap)
        return None

    def push(self, agent: AgentState, req: RequestState) -> None:
        self._queue(agent.tenant).push(agent, req)

    def peek(self, now: float) -> RequestState | None:
        q = self._top()
        return q.peek(now) if q is not None else None

    def pop(self, agent: AgentState, req: RequestState) -> None:
        self._queue(agent.tenant).pop(agent, req)

    def remove(self, agent: AgentState, req: RequestState) -> None:
        self._queue(agent.tenant).remove(agent, req)

    def remove_agent(self, agent: AgentState, pending: list[RequestState]) -> None:
        self._queue(agent.tenant).remove_agent(agent, pending)
        self._retag(agent.tenant)

    def requeue(self, agent: AgentState) -> None:
        self._queue(agent.tenant).requeue(agent)
        self._retag(agent.tenant)

    def retag(self, tenant: object) -> None:
        """Something in the tenant's clock moved (an agent settled or left): re-key it."""
        if tenant in self._queues:
            self._retag(tenant)

    def defer(self) -> bool:
        if self._set_aside >= self._depth:
            return False
        q = self._top()
        if q is None:
            return False
        tenant = next(t for t, tq in self._queues.items() if tq is q)
        if not q.defer():
            return False
        self._set_aside += 1
        if tenant not in self._deferred:
            self._deferred.append(tenant)
        self._retag(tenant)
        return True

    def restore(self) -> None:
        for tenant in self._deferred:
            self._queues[tenant].restore()
            self._retag(tenant)
        self._deferred.clear()
        self._set_aside = 0

    def head(self, agent: AgentState) -> RequestState | None:
        return agent.heap[0][2] if agent.heap else None

    def leader(self) -> AgentState | None:
        q = self._top()
        return q.leader() if q is not None else None
