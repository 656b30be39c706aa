"""The history of completed agents: an embedded SQLite file that survives restarts.

Every finished agent is written once, with its prompt, the p and d of each of its
requests, its real cost and its timings. `justitia train-predictor --from-server URL`
reads it back as training samples (`GET /v1/history`).

Writes leave the event loop: `record` queues a row and a writer thread commits whatever has
queued in one transaction. Under load (every untagged request is a one-request agent) that
is one commit per burst instead of one SQLite write per request on the loop that serves
everyone. Reads first wait for the queue to drain, so a caller reads its own writes; `close`
commits everything queued before it returns.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from server.agents import AgentEntry
from server.scheduler.cost import kv_cost

log = logging.getLogger("justitia.history")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS agents (
    id TEXT PRIMARY KEY,
    type TEXT NOT NULL,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL,
    prompt TEXT NOT NULL,
    metadata TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    finished_at REAL,
    predicted_cost REAL NOT NULL,
    cost REAL NOT NULL,
    n_requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    requests TEXT NOT NULL,
    error TEXT
);
CREATE INDEX IF NOT EXISTS agents_type ON agents(type, state);
"""

_COLUMNS = ("id, type, tenant, state, prompt, metadata, submitted_at, finished_at, "
            "predicted_cost, cost, n_requests, prompt_tokens, output_tokens, requests, error")
_INSERT = f"INSERT OR REPLACE INTO agents ({_COLUMNS}) VALUES ({','.join('?' * 15)})"
_STOP = None


@dataclass
class _Row:
    values: tuple
    done: Future[None]
    urgent: bool = True


class History:
    batch_window_s = 0.1  # rows nobody waits for (untagged requests' agents)
    urgent_window_s = 0.002  # a row whose finish call waits for it

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a commit is not an fsync
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._lock = threading.Lock()  # one statement or transaction at a time
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_forever, name="justitia-history",
                                        daemon=True)
        self._writer.start()

    def _migrate(self) -> None:
        """Histories written before failed agents had an error column gain it (NULL)."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(agents)")}
        if "error" not in columns:
            self._db.execute("ALTER TABLE agents ADD COLUMN error TEXT")

    def close(self) -> None:
        self._queue.put(_STOP)
        self._writer.join()
        self._db.close()

    def record(self, entry: AgentEntry, *, urgent: bool = True) -> Future[None]:
        """Queue the ended agent's row; the future completes once the writer thread has
        committed it (a committed row survives the server's process being killed: SQLite's
        WAL is written before the commit returns)."""
        done: Future[None] = Future()
        self._queue.put(_Row((entry.id, entry.type, entry.tenant, entry.state, entry.prompt,
                              dict(entry.metadata), entry.submitted_at, entry.finished_at,
                              entry.predicted_cost, list(entry.requests), entry.error), done,
                             urgent))
        return done

    def flush(self) -> None:
        """Return once everything queued so far is committed."""
        self._queue.join()

    def _write_forever(self) -> None:
        while True:
            batch = [self._queue.get()]
            # A moment for more rows to queue: one commit per burst instead of one per agent
            # (each commit is a WAL write and a lock round trip). Short when a finish call
            # waits for the row, ~100 ms under a load of untagged requests.
            first = batch[0]
            urgent = first is _STOP or first.urgent
            time.sleep(self.urgent_window_s if urgent else self.batch_window_s)
            while True:  # everything queued meanwhile goes into the same transaction
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            items = [item for item in batch if item is not _STOP]
            error: BaseException | None = None
            try:
                if items:
                    with self._lock:
                        self._db.execute("BEGIN")
                        self._db.executemany(_INSERT, [_row(item.values) for item in items])
                        self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                error = exc
                log.exception("could not write %d agents to the history", len(items))
                with self._lock:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
            finally:
                for item in items:
                    if error is None:
                        item.done.set_result(None)
                    else:
                        item.done.set_exception(error)
                for _ in batch:
                    self._queue.task_done()
            if any(item is _STOP for item in batch):
                return

    def samples(self, agent_type: str | None = None, tenant: str | None = None,
                limit: int = 100_000) -> list[dict[str, Any]]:
        """Finished agents as predictor training samples (the samples file format)."""
        return self.samples_page(agent_type, tenant, limit)[0]

    def samples_page(self, agent_type: str | None = None, tenant: str | None = None,
                     limit: int = 100_000, after: int = 0) -> tuple[list[dict[str, Any]], int | None]:
        """Up to `limit` finished agents written after row `after`, as training samples,
        and the row to continue after (None on the last page). Blocking: call it from a
        worker thread, not the event loop."""
        self.flush()
        sql = ("SELECT type, prompt, cost, n_requests, prompt_tokens, output_tokens, id, rowid "
               "FROM agents WHERE state = 'finished' AND n_requests > 0 AND rowid > ?")
        args: list[Any] = [after]
        if agent_type is not None:
            sql += " AND type = ?"
            args.append(agent_type)
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        sql += " ORDER BY rowid LIMIT ?"
        args.append(limit + 1)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        more = len(rows) > limit
        rows = rows[:limit]
        samples = [
            {
                "agent_type": t, "prompt": prompt, "cost": cost, "agent_id": agent_id,
                "features": {"n_requests": n, "prompt_tokens": p, "output_tokens": d},
            }
            for t, prompt, cost, n, p, d, agent_id, _ in rows
        ]
        return samples, (rows[-1][7] if more else None)

    def get(self, agent_id: str) -> dict[str, Any] | None:
        self.flush()
        with self._lock:
            cur = self._db.execute("SELECT * FROM agents WHERE id = ?", (agent_id,))
            row = cur.fetchone()
            names = [c[0] for c in cur.description]
        if row is None:
            return None
        rec = dict(zip(names, row))
        rec["metadata"] = json.loads(rec["metadata"])
        rec["requests"] = json.loads(rec["requests"])
        return rec

    def count(self) -> int:
        self.flush()
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM agents").fetchone()[0])


def _row(item: tuple) -> tuple:
    (agent_id, type_, tenant, state, prompt, metadata, submitted_at, finished_at,
     predicted_cost, reqs, error) = item
    return (
        agent_id, type_, tenant, state, prompt, json.dumps(metadata), submitted_at, finished_at,
        predicted_cost, sum(kv_cost(r.prompt_tokens, r.output_tokens) for r in reqs), len(reqs),
        sum(r.prompt_tokens for r in reqs), sum(r.output_tokens for r in reqs),
        json.dumps([asdict(r) for r in reqs]), error,
    )
