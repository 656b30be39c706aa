"""The SQLite history: rows written by a background thread, read back after a flush, kept
across reopenings (a server restart)."""

from __future__ import annotations

import threading

from server.runtime.agents import AgentEntry, RequestLog
from server.runtime.history import History
from server.scheduler import kv_cost


def finished_agent(i: int, n_requests: int = 2) -> AgentEntry:
    entry = AgentEntry(id=f"agt-{i}", type="hist_agent", tenant="t", prompt=f"prompt {i}",
                       metadata={"i": i}, submitted_at=1000.0 + i, submitted_mono=0.0,
                       predicted_cost=123.0)
    entry.requests = [RequestLog(request_id=f"r{i}-{j}", prompt_tokens=10 + j, output_tokens=5,
                                 submitted_s=0.0, admitted_s=0.1, finished_s=0.5,
                                 finish_reason="length", preemptions=0)
                      for j in range(n_requests)]
    entry.state = "finished"
    entry.finished_at = 1001.0 + i
    return entry


def test_rows_written_from_many_threads_are_all_read_back(tmp_path) -> None:
    history = History(tmp_path / "h.sqlite3")
    threads = [threading.Thread(target=lambda k=k: [history.record(finished_agent(100 * k + i))
                                                    for i in range(50)]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = history.samples("hist_agent")
    assert len(samples) == 200 == history.count()
    one = history.get("agt-7")
    assert one["prompt"] == "prompt 7" and one["metadata"] == {"i": 7}
    assert one["cost"] == kv_cost(10, 5) + kv_cost(11, 5)
    assert [r["prompt_tokens"] for r in one["requests"]] == [10, 11]
    history.close()


def test_close_commits_what_is_queued_and_a_reopened_history_has_it(tmp_path) -> None:
    history = History(tmp_path / "h.sqlite3")
    for i in range(300):
        history.record(finished_agent(i, n_requests=1))
    history.close()  # no flush before: close must not lose the queue
    reopened = History(tmp_path / "h.sqlite3")
    assert reopened.count() == 300
    assert reopened.get("agt-299")["n_requests"] == 1
    reopened.close()


def test_rows_past_the_retention_are_deleted(tmp_path) -> None:
    import sqlite3
    import time as _time

    path = tmp_path / "h.sqlite3"
    history = History(path)
    history.close()
    db = sqlite3.connect(path)
    now = _time.time()
    for i, age in enumerate([10, 100_000]):
        db.execute("INSERT INTO agents (id, type, tenant, state, prompt, metadata, submitted_at,"
                   " finished_at, predicted_cost, cost, n_requests, prompt_tokens, output_tokens,"
                   " requests) VALUES (?, 't', 'x', 'finished', 'p', '{}', ?, ?, 1, 1, 1, 1, 1, '[]')",
                   (f"a{i}", now - age, now - age))
    db.commit()
    db.close()
    kept = History(path, retention_s=3600)
    assert [s["agent_id"] for s in kept.samples()] == ["a0"]
    kept.close()
