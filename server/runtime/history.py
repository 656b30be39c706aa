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
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from predictors.history import HISTORY_QUERY, history_sample
from server.runtime.agents import AgentEntry, RequestLog
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
    error TEXT,
    size INTEGER
);
CREATE INDEX IF NOT EXISTS agents_type ON agents(type, state);
CREATE TABLE IF NOT EXISTS engine_state (
    engine TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    saved_at REAL NOT NULL
);
"""

_COLUMNS = ("id, type, tenant, state, prompt, metadata, submitted_at, finished_at, "
            "predicted_cost, cost, n_requests, prompt_tokens, output_tokens, requests, error, size")
_INSERT = f"INSERT OR REPLACE INTO agents ({_COLUMNS}) VALUES ({','.join('?' * 16)})"
_STOP = None
#: What a row costs beyond its text columns (numbers, the id, SQLite's own overhead): the
#: `size` of a row is this plus the lengths of its prompt, metadata, requests and error.
ROW_OVERHEAD_BYTES = 160
_SIZE_SQL = (f"{ROW_OVERHEAD_BYTES} + length(prompt) + length(metadata) + length(requests) "
             "+ coalesce(length(error), 0) + length(id) + length(type) + length(tenant)")
DEFAULT_MAX_ROWS = 1_000_000
#: Rows that failed to commit are kept for a retry up to this many.
MAX_UNWRITTEN_ROWS = 10_000
DEFAULT_MAX_BYTES = 1 << 30
#: Once over a bound, the oldest rows go until the history is this fraction of it, so that
#: trimming happens once per tenth of the bound, not at every commit.
TRIM_TO = 0.9
#: A failed commit is retried after 1 s, doubling up to this (a full disk or a locked file
#: clears in seconds to minutes; the rows wait in memory, MAX_UNWRITTEN_ROWS at most).
MAX_RETRY_S = 30.0



@dataclass
class _Row:
    values: tuple
    done: Future[None]
    urgent: bool = True


class History:
    batch_window_s = 0.1  # rows nobody waits for (untagged requests' agents)
    urgent_window_s = 0.002  # a row whose finish call waits for it

    prune_every_s = 600.0

    def __init__(self, path: str | Path, retention_s: float | None = None,
                 max_rows: int | None = DEFAULT_MAX_ROWS, max_bytes: int | None = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        #: Rows older than this (seconds since they ended) are deleted; None keeps them all.
        self.retention_s = retention_s
        #: The most rows, and bytes of rows, kept (None: no bound): the oldest go first.
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        #: Where an unreadable history file was moved before starting afresh (None: it was fine).
        self.recovered_from: Path | None = None
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:
            self.recovered_from = self._move_aside(exc)
            self._db = self._open()
        #: Rows whose commit failed (disk full, I/O error), retried with backoff.
        self.unwritten = 0
        self.last_error: str | None = None
        self._unwritten_ids: set[str] = set()  # the agents of those rows
        #: Rows kept for a retry at most (the oldest nobody waits for go past it), and how
        #: many went that way.
        self.max_unwritten_rows = MAX_UNWRITTEN_ROWS
        self.dropped = 0
        self._last_prune = 0.0
        self._lock = threading.Lock()  # one statement or transaction at a time
        #: Rows and bytes of rows held (the `size` column's sum), kept up to date by the writer.
        self.rows, self.bytes = self._totals()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_forever, name="justitia-history",
                                        daemon=True)
        self._writer.start()
        self._prune()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a commit is not an fsync
            db.executescript(_SCHEMA)
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check}")
            self._migrate(db)
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _move_aside(self, exc: Exception) -> Path:
        """An unreadable history must not keep the server from starting: it is moved aside
        (with its WAL files) for inspection, and a new one begins."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                src.rename(str(moved) + suffix)
        log.error("THE HISTORY FILE %s IS UNREADABLE (%s): moved to %s, starting a new one; "
                  "finished agents recorded before are in the moved file", self.path, exc, moved)
        return moved

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Histories written before failed agents had an error column gain it (NULL)."""
        columns = {row[1] for row in db.execute("PRAGMA table_info(agents)")}
        if "error" not in columns:
            db.execute("ALTER TABLE agents ADD COLUMN error TEXT")
        if "size" not in columns:  # rows written before the history was bounded in bytes
            db.execute("ALTER TABLE agents ADD COLUMN size INTEGER")
            db.execute(f"UPDATE agents SET size = {_SIZE_SQL}")

    def _totals(self) -> tuple[int, int]:
        with self._lock:
            rows, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM agents").fetchone()
        return int(rows), int(size)

    @property
    def failing(self) -> str | None:
        """Why the history cannot be written now (rows are waiting for a retry), else None."""
        return (self.last_error or "unknown error") if self.unwritten else None

    def unwritten_agent(self, agent_id: str) -> bool:
        """Whether the agent's row is among those waiting for a retry."""
        with self._lock:
            return agent_id in self._unwritten_ids

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
                              entry.metadata_json.decode(), entry.submitted_at, entry.finished_at,
                              entry.predicted_cost, list(entry.requests), entry.error), done,
                             urgent))
        return done

    def flush(self) -> None:
        """Return once everything queued so far is committed."""
        self._queue.join()

    def _write_forever(self) -> None:
        failed: list[_Row] = []  # rows whose commit failed, tried again first
        retry_s = 1.0
        while True:
            try:
                batch = [self._queue.get(timeout=retry_s if failed else None)]
            except queue.Empty:
                batch = []
            if batch:
                # A moment for more rows to queue: one commit per burst instead of one per
                # agent (each commit is a WAL write and a lock round trip). Short when a
                # finish call waits for the row, ~100 ms under a load of untagged requests.
                first = batch[0]
                urgent = first is _STOP or first.urgent
                time.sleep(self.urgent_window_s if urgent else self.batch_window_s)
                while True:  # everything queued meanwhile goes into the same transaction
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
            items = failed + [item for item in batch if item is not _STOP]
            error = self._commit(items)
            if error is None:
                failed, retry_s = [], 1.0
            else:
                failed, retry_s = self._keep_for_retry(items), min(MAX_RETRY_S, retry_s * 2)
            with self._lock:  # before the callers learn of it: they ask which rows wait
                self._unwritten_ids = {item.values[0] for item in failed}
                self.unwritten = len(failed)
            _settle(items, error)
            if error is None:
                self._prune()
                self._trim()
            for _ in batch:
                self._queue.task_done()
            if any(item is _STOP for item in batch):
                return

    def _keep_for_retry(self, items: list[_Row]) -> list[_Row]:
        """The rows to retry, bounded: past MAX_UNWRITTEN_ROWS the oldest rows nobody waits
        for (untagged requests' agents) go; rows whose end a caller waits for all stay."""
        excess = len(items) - self.max_unwritten_rows
        if excess <= 0:
            return items
        kept: list[_Row] = []
        for item in items:
            if excess > 0 and not item.urgent:
                excess -= 1
                self.dropped += 1
                continue
            kept.append(item)
        log.error("the history cannot be written: %d rows of untagged requests' agents dropped "
                  "so far to bound the memory of the rows waiting for a retry", self.dropped)
        return kept

    def _commit(self, items: list[_Row]) -> sqlite3.Error | None:
        if not items:
            return None
        rows = [_row(item.values) for item in items]
        try:
            with self._lock:
                self._db.execute("BEGIN")
                self._db.executemany(_INSERT, rows)
                self._db.execute("COMMIT")
                self.rows += len(rows)
                self.bytes += sum(row[-1] for row in rows)
        except sqlite3.Error as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("could not write %d finished agents to the history (%s); retrying",
                      len(items), exc)
            with self._lock:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
            return exc
        self.last_error = None
        return None

    def _prune(self) -> None:
        """Delete rows past the retention, at most every `prune_every_s`."""
        now = time.time()
        if self.retention_s is None or now - self._last_prune < self.prune_every_s:
            return
        self._last_prune = now
        try:
            with self._lock:
                gone = self._db.execute("DELETE FROM agents WHERE finished_at < ?",
                                        (now - self.retention_s,)).rowcount
        except sqlite3.Error as exc:
            log.warning("could not prune the history: %s", exc)
            return
        if gone:
            log.info("history: %d agents older than the retention deleted", gone)

    def _trim(self) -> None:
        """Over --history-max-rows or --history-max-bytes: the oldest rows go, until the
        history is at TRIM_TO of its bounds."""
        over_rows = self.max_rows is not None and self.rows > self.max_rows
        over_bytes = self.max_bytes is not None and self.bytes > self.max_bytes
        if not (over_rows or over_bytes):
            return
        drop_rows = self.rows - int(self.max_rows * TRIM_TO) if over_rows and self.max_rows else 0
        drop_bytes = self.bytes - int(self.max_bytes * TRIM_TO) if over_bytes and self.max_bytes else 0
        try:
            with self._lock:
                last, rows, size = 0, 0, 0
                while rows < drop_rows or size < drop_bytes:
                    chunk = self._db.execute("SELECT rowid, size FROM agents WHERE rowid > ? "
                                             "ORDER BY rowid LIMIT 1000", (last,)).fetchall()
                    if not chunk:
                        break
                    for rowid, row_size in chunk:
                        last, rows, size = rowid, rows + 1, size + (row_size or 0)
                        if rows >= drop_rows and size >= drop_bytes:
                            break
                self._db.execute("DELETE FROM agents WHERE rowid <= ?", (last,))
        except sqlite3.Error as exc:
            log.warning("could not trim the history: %s", exc)
            return
        self.rows, self.bytes = self._totals()
        log.info("history over its bounds (--history-max-rows %s, --history-max-bytes %s): the "
                 "oldest %d agents deleted", self.max_rows, self.max_bytes, rows)

    def sample_rows(self, agent_type: str | None, tenant: str | None, n: int, after: int,
                    flush: bool = True) -> list[tuple[int, dict[str, Any]]]:
        """Up to `n` finished agents written after row `after`, as (row, training sample).
        Blocking."""
        if flush:
            self.flush()
        rows = self._rows_after(agent_type, tenant, after, n)
        return [(row[7], history_sample(row)) for row in rows]

    def _rows_after(self, agent_type: str | None, tenant: str | None, after: int, n: int) -> list[Any]:
        """Up to `n` history rows written after row `after`, of a type and tenant if given."""
        sql = HISTORY_QUERY
        args: list[Any] = [after]
        if agent_type is not None:
            sql += " AND type = ?"
            args.append(agent_type)
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        sql += " ORDER BY rowid LIMIT ?"
        args.append(n)
        with self._lock:
            return self._db.execute(sql, args).fetchall()

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
        rows = self._rows_after(agent_type, tenant, after, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        return [history_sample(row) for row in rows], (rows[-1][7] if more else None)

    def get(self, agent_id: str) -> dict[str, Any] | None:
        self.flush()
        with self._lock:
            cur = self._db.execute("SELECT * FROM agents WHERE id = ?", (agent_id,))
            row = cur.fetchone()
            names = [c[0] for c in cur.description]
        if row is None:
            return None
        rec = dict(zip(names, row, strict=True))
        rec["metadata"] = json.loads(rec["metadata"])
        rec["requests"] = json.loads(rec["requests"])
        return rec

    def recent_registrations(self, limit: int = 4096) -> list[tuple[float, float]]:
        """(submitted_at, predicted_cost) of the last `limit` agents to have been submitted,
        oldest first: the arrivals a restarted server replays (server/runtime/relearn.py). Blocking."""
        self.flush()
        with self._lock:
            rows = self._db.execute("SELECT submitted_at, predicted_cost FROM agents "
                                    "ORDER BY submitted_at DESC LIMIT ?", (limit,)).fetchall()
        return [(float(t), float(c)) for t, c in reversed(rows)]

    def recent_finished(self, per_type: int = 50) -> list[tuple[str, str, list[RequestLog]]]:
        """(tenant, type, requests) of the last `per_type` finished agents of each tenant and
        type, oldest first: the shapes a restarted server learns again. Blocking."""
        self.flush()
        sql = ("SELECT a.tenant, a.type, a.requests FROM agents AS a JOIN ("
               " SELECT rowid AS k, ROW_NUMBER() OVER (PARTITION BY tenant, type ORDER BY rowid DESC) AS n"
               " FROM agents WHERE state = 'finished') AS last ON a.rowid = last.k "
               "WHERE last.n <= ? ORDER BY a.rowid")
        with self._lock:
            rows = self._db.execute(sql, (per_type,)).fetchall()
        return [(tenant, type_, _request_logs(reqs)) for tenant, type_, reqs in rows]

    def save_engine_state(self, engine: str, state: dict[str, Any]) -> None:
        """Keep what the server measured of the engine (its fitted time model, its tau:
        server/runtime/relearn.py), keyed by what identifies the engine. Blocking."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO engine_state (engine, state, saved_at) VALUES (?, ?, ?)",
                             (engine, json.dumps(state), time.time()))

    def engine_state(self, engine: str) -> dict[str, Any] | None:
        """What was last saved of the engine (None: nothing, or unreadable). Blocking."""
        with self._lock:
            row = self._db.execute("SELECT state FROM engine_state WHERE engine = ?", (engine,)).fetchone()
        try:
            state = json.loads(row[0]) if row is not None else None
        except ValueError:
            return None
        return state if isinstance(state, dict) else None

    def count(self) -> int:
        self.flush()
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM agents").fetchone()[0])


def _settle(items: list[_Row], error: sqlite3.Error | None) -> None:
    """Tell the callers waiting for these rows how their first commit went (a failed row
    is kept and retried; its caller learns of the failure now)."""
    for item in items:
        if not item.done.done():
            if error is None:
                item.done.set_result(None)
            else:
                item.done.set_exception(error)


_REQUEST_FIELDS = frozenset(f.name for f in fields(RequestLog))


def _request_logs(text: str) -> list[RequestLog]:
    """A row's requests as written by `_row`; keys this version does not know are skipped, a
    row that cannot be read gives none."""
    try:
        return [RequestLog(**{k: v for k, v in r.items() if k in _REQUEST_FIELDS}) for r in json.loads(text)]
    except (TypeError, ValueError, AttributeError):
        return []


def _row(item: tuple) -> tuple:
    (agent_id, type_, tenant, state, prompt, metadata, submitted_at, finished_at,
     predicted_cost, reqs, error) = item
    requests = json.dumps([asdict(r) for r in reqs])
    # as SQL's length() counts: characters
    size = (ROW_OVERHEAD_BYTES + len(prompt) + len(metadata) + len(requests) + len(error or "")
            + len(agent_id) + len(type_) + len(tenant))
    return (
        agent_id, type_, tenant, state, prompt, metadata, submitted_at, finished_at,
        predicted_cost, sum(kv_cost(r.prompt_tokens, r.output_tokens) for r in reqs), len(reqs),
        sum(r.prompt_tokens for r in reqs), sum(r.output_tokens for r in reqs),
        requests, error, size,
    )
