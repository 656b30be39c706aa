"""One client's dashboard stream: frames of what changed, for what its tenant may see.

A frame is a JSON object; every key is optional except `t`:

- `reset`: true on the first frame (the client drops what it had);
- `info`: policy, V, M, tau, the time model, the predictors (when it changed);
- `counts`: live, queued, running and paused agents, requests, finished agents (when changed);
- `order`: the ids of the queue's top rows in the policy's order (when it changed);
- `rows`: `{id: row}` for the rows that are new or changed since the last frame, a row being
  `[position, type, tenant, state, pending, running, predicted, consumed, virtual_finish,
  eta_s, fair_finish_s, deadline_s, promise, paused_since]` (tenant: null unless the caller is
  admin; paused_since: when a paused agent's pause began, on the clock of the frames' `t`,
  null unless it is paused: the page shows for how long);
- `kv`: the KV/throughput samples taken since the last frame;
- `finished`: agents finished since the last frame, `[id, type, jct_s, first_eta_s, deadline_s]`.

Only the top `MAX_ROWS` of the queue are sent, and rows are re-sent only when a value the
page shows changes (rounded as the page shows it), so that the stream stays small with
thousands of agents queued (docs/dashboard.md has the measured numbers).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio

from server.api.dashboard import DashboardHub, _r
from server.scheduler.views import server_promise

MAX_ROWS = 200
INTERVAL_S = 0.5  # at most two frames a second per stream
HEARTBEAT_S = 15.0
# The row's projected times (ETA, fair finish, deadline; indexes 9-11) move with the clock
# for every waiting agent; alone, such a change is re-sent at most this often.
TIMES_REFRESH_S = 2.0
_TIMES = slice(9, 12)


def _worth_sending(row: list[Any], before: tuple[list[Any], float] | None, now: float) -> bool:
    """New rows and changes of what the agent is or holds go at once; drifting times wait."""
    if before is None:
        return True
    old, sent_at = before
    if row == old:
        return False
    if row[:9] != old[:9] or row[12:] != old[12:]:
        return True
    return now - sent_at >= TIMES_REFRESH_S


class DashboardFeed:
    def __init__(self, hub: DashboardHub, tenant: str, admin: bool, max_rows: int = MAX_ROWS) -> None:
        self.hub = hub
        self.tenant = tenant
        self.admin = admin
        self.max_rows = max_rows
        self._sent_rows: dict[str, tuple[list[Any], float]] = {}  # row, when it was sent
        self._sent_order: list[str] | None = None
        self._sent_info: str | None = None
        self._sent_counts: dict[str, int] | None = None
        self._sample_seq = 0
        self._finished_seq = 0
        self._first = True

    def _visible(self, entry_tenant: str) -> bool:
        return self.admin or entry_tenant == self.tenant

    def frame(self) -> dict[str, Any] | None:
        """What changed since the last frame (None: nothing)."""
        s = self.hub.scheduler
        out: dict[str, Any] = {}
        if self._first:
            out["reset"] = True
            self._first = False
        self._info(out)
        top, visible_live = self._queue(out)
        self._counts(out, top, visible_live)
        self._kv(out)
        self._finished(out)
        if not out:
            return None
        out["t"] = round(s.now(), 2)
        return out

    def _info(self, out: dict[str, Any]) -> None:
        s = self.hub.scheduler
        d = s.dispatcher
        gps = d.clock.peek(s.now())
        registry = s.predictors
        info = {
            "policy": d.policy.name, "V": _r(gps.V, 1), "M": d.kv_capacity, "tau": _r(d.tau, 4),
            "bound_tau": _r(d.bound_tau, 4), "rate": _r(d.rate, 1),
            "promise": server_promise(d),
            "promise_reason": d.uncertainty or "", "paused": s.paused, "backlog": gps.backlog,
            "time_model": _time_model(s.time_models.describe()),
            "predictors": sorted(getattr(registry, "agent_types", [])) if registry is not None else [],
            "admin": self.admin, "tenant": None if self.admin else self.tenant,
        }
        text = json.dumps(info, sort_keys=True)
        if text != self._sent_info:
            self._sent_info = text
            out["info"] = info

    def _queue(self, out: dict[str, Any]) -> tuple[list[str], int]:
        ids, positions = self.hub.order()
        live = self.hub.live
        visible = ids if self.admin else [i for i in ids if (e := live.get(i)) is not None and e.tenant == self.tenant]
        top = visible[:self.max_rows]
        if top != self._sent_order:
            self._sent_order = top
            out["order"] = top
        rows: dict[str, list[Any]] = {}
        now = self.hub.scheduler.now()
        sent: dict[str, tuple[list[Any], float]] = {}
        for agent_id in top:
            row = self._row(agent_id, positions.get(agent_id, 0), now)
            before = self._sent_rows.get(agent_id)
            if row is not None and _worth_sending(row, before, now):
                rows[agent_id] = row
                sent[agent_id] = (row, now)
            elif before is not None:
                sent[agent_id] = before
        self._sent_rows = sent
        if rows:
            out["rows"] = rows
        return top, len(visible)

    def _row(self, agent_id: str, position: int, now: float) -> list[Any] | None:
        s = self.hub.scheduler
        entry = self.hub.live.get(agent_id)
        agent = s.dispatcher.agents.get(agent_id)
        if entry is None or agent is None:
            return None
        v = s.dispatcher.view(agent_id, now)
        return [position, entry.type, entry.tenant if self.admin else None, entry.state,
                agent.pending, agent.running, round(entry.predicted_cost), round(entry.consumed_kv_cost),
                _r(v.virtual_finish, 0), _r(v.eta_s, 1), _r(v.fair_finish_s, 1), _r(v.deadline_s, 1), v.promise,
                _r(entry.paused_mono, 2)]  # as `t` is: t - paused_since is never negative

    def _counts(self, out: dict[str, Any], top: list[str], visible_live: int) -> None:
        d = self.hub.scheduler.dispatcher
        live = self.hub.live.values()
        mine = [e for e in live if self._visible(e.tenant)] if not self.admin else list(live)
        totals = self.hub.finished_total
        counts = {
            "live": visible_live,
            "queued": sum(1 for e in mine if e.state == "queued"),
            "running": sum(1 for e in mine if e.state == "running"),
            "paused": sum(1 for e in mine if e.state == "paused"),
            "shown": len(top),
            "finished": sum(totals.values()) if self.admin else totals.get(self.tenant, 0),
            # the server's load, as GET /v1/scheduler shows it to every tenant
            "pending_requests": d.ledger.pending_count, "running_requests": d.ledger.running_count,
            "all_live": len(self.hub.live),
        }
        if counts != self._sent_counts:
            self._sent_counts = counts
            out["counts"] = counts

    def _kv(self, out: dict[str, Any]) -> None:
        new = self.hub.samples_after(self._sample_seq)
        if not new:
            return
        self._sample_seq = new[-1][0]
        points = [p for _, p in new]
        if not self.admin:  # replica ids and URLs are the operator's (GET /v1/admin/replicas)
            points = [{**p, "replicas": [{**r, "id": f"replica {n}"} for n, r in enumerate(p["replicas"], 1)]}
                      if "replicas" in p else p for p in points]
        out["kv"] = points

    def _finished(self, out: dict[str, Any]) -> None:
        new = self.hub.finished_after(self._finished_seq, None if self.admin else self.tenant)
        last = self.hub.finished[-1].seq if self.hub.finished else 0
        self._finished_seq = max(self._finished_seq, last)
        if new:
            out["finished"] = [f.row() for f in new]

    async def stream(self, interval_s: float = INTERVAL_S, heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[str]:
        """Server-sent events: `event: frame` at most once per `interval_s`, a keep-alive
        comment when nothing changed for `heartbeat_s`."""
        quiet = 0.0
        while True:
            frame = self.frame()
            if frame is not None:
                quiet = 0.0
                yield f"event: frame\ndata: {json.dumps(frame, separators=(',', ':'))}\n\n"
            else:
                quiet += interval_s
                if quiet >= heartbeat_s:
                    quiet = 0.0
                    yield ": keep-alive\n\n"
            await anyio.sleep(interval_s)


def _time_model(described: dict[str, Any]) -> dict[str, Any]:
    """The time model the ETAs use: the engine's fitted model with the most samples, or the
    prior; its coefficients rounded for display."""
    engines = described.get("engines") or {}
    name: str | None = None
    if engines:
        name, model = max(engines.items(), key=lambda kv: kv[1].get("samples", 0))
    else:
        model = described.get("prior") or {}
    return {"engine": name, **{k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in model.items()}}
