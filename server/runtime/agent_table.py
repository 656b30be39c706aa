"""The table of agents the live server knows: live ones, and ended ones kept readable.

Per tenant, its agents in registration order (the pages of GET /v1/agents), how many are
live (the max_agents quota) and the bytes of its callers' data they hold (--max-agent-bytes);
the implicit agent of each (tenant, session id). Housekeeping stays O(live agents) however
many ended agents are kept: live ones are a set, ended ones a queue in the order they ended,
pruned from the front.
"""

from __future__ import annotations

import builtins
import collections
import itertools
import sys

from sortedcontainers import SortedDict

from server.runtime.agents import AgentEntry
from server.runtime.lifecycle import AgentNotFound


class AgentTable:
    def __init__(self) -> None:
        self.agents: dict[str, AgentEntry] = {}
        self._open: set[str] = set()
        self._ended: collections.deque[str] = collections.deque()
        self._by_tenant: dict[str, SortedDict] = {}
        self._live_count: collections.Counter[str] = collections.Counter()
        self._held_bytes: collections.Counter[str] = collections.Counter()
        # (tenant, session id) -> the id of its implicit agent (live, or ended and replaced
        # at the session's next request); the tenant in the key keeps sessions apart.
        self._sessions: dict[tuple[str, str], str] = {}
        self._seq = itertools.count(1)

    # -- registration and ending ----------------------------------------------------
    def add(self, entry: AgentEntry, held_bytes: int) -> None:
        """A new live agent, holding `held_bytes` of its caller's data."""
        entry.seq = next(self._seq)
        self.agents[entry.id] = entry
        self._by_tenant.setdefault(entry.tenant, SortedDict())[entry.seq] = entry
        self._live_count[entry.tenant] += 1
        entry.held_bytes = held_bytes
        self._held_bytes[entry.tenant] += held_bytes
        self._open.add(entry.id)

    def ended(self, entry: AgentEntry) -> None:
        """The agent ended: it leaves the live agents (and its session) and waits to be pruned."""
        if entry.id in self._open:
            self._live_count[entry.tenant] -= 1
            self._held_bytes[entry.tenant] -= entry.held_bytes
        self._open.discard(entry.id)
        if entry.session is not None and self._sessions.get((entry.tenant, entry.session)) == entry.id:
            del self._sessions[(entry.tenant, entry.session)]
        self._ended.append(entry.id)

    def prune(self, now: float, retention_s: float) -> None:
        """Forget the ended agents idle for more than `retention_s`."""
        while self._ended:
            entry = self.agents.get(self._ended[0])
            if entry is not None and now - entry.last_activity_mono <= retention_s:
                break
            self._ended.popleft()
            self.agents.pop(entry.id if entry else "", None)
            if entry is not None:
                index = self._by_tenant.get(entry.tenant)
                if index is not None:
                    index.pop(entry.seq, None)
                    if not index:
                        del self._by_tenant[entry.tenant]

    # -- what a tenant holds ----------------------------------------------------------
    def live_count(self, tenant: str) -> int:
        return self._live_count[tenant]

    def held_bytes(self, tenant: str) -> int:
        return self._held_bytes[tenant]

    def open_entries(self) -> builtins.list[AgentEntry]:
        """The agents that have not ended (a copy: the caller may end them)."""
        return [self.agents[agent_id] for agent_id in list(self._open)]

    # -- sessions -------------------------------------------------------------------------
    def session(self, tenant: str, session: str) -> AgentEntry | None:
        """The agent last bound to the tenant's session (it may have ended)."""
        return self.agents.get(self._sessions.get((tenant, session), ""))

    def bind_session(self, tenant: str, session: str, entry: AgentEntry) -> None:
        self._sessions[(tenant, session)] = entry.id

    # -- lookups --------------------------------------------------------------------------
    def get(self, agent_id: str, tenant: str) -> AgentEntry:
        entry = self.agents.get(agent_id)
        # Another tenant's agent is reported as unknown: its existence is not theirs to learn.
        if entry is None or entry.tenant != tenant:
            raise AgentNotFound(f"no agent {agent_id!r}")
        return entry

    def list(self, tenant: str) -> builtins.list[AgentEntry]:
        """The tenant's agents (live, and ended ones still kept), in registration order."""
        return builtins.list(self._by_tenant.get(tenant, {}).values())

    def page(self, tenant: str, limit: int, after: int = 0,
             state: str | None = None) -> tuple[builtins.list[AgentEntry], int | None]:
        """Up to `limit` of the tenant's agents registered after the one numbered `after`
        (`entry.seq`), and the number to continue after (None on the last page). O(log n +
        what it reads), whatever the tenant holds."""
        index = self._by_tenant.get(tenant)
        if index is None:
            return [], None
        out: builtins.list[AgentEntry] = []
        for seq in index.irange(minimum=after, inclusive=(False, True)):
            entry = index[seq]
            if state is not None and entry.state != state:
                continue
            if len(out) == limit:
                return out, out[-1].seq
            out.append(entry)
        return out, None

    def live_page(self, tenant: str, limit: int) -> tuple[builtins.list[AgentEntry], int, int | None]:
        """The tenant's first `limit` live agents in registration order, how many more live
        agents it has, and the `seq` of the last one given (a GET /v1/agents cursor)."""
        out: builtins.list[AgentEntry] = []
        rest = 0
        for entry in self._by_tenant.get(tenant, {}).values():
            if entry.terminal:
                continue
            if len(out) < limit:
                out.append(entry)
            else:
                rest += 1
        return out, rest, out[-1].seq if out else None


def held_bytes_of(prompt: str, metadata_json: bytes) -> int:
    """What a live agent holds of its caller's data in memory (--max-agent-bytes): its kept
    prompt (the string's own size: 1, 2 or 4 bytes a character) and its metadata's JSON."""
    return sys.getsizeof(prompt) + sys.getsizeof(metadata_json)
