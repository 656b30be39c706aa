"""What a restarted server learns again from its history (server/runtime/relearn.py): its types'
shapes and the episodes of arrivals its ETAs forecast from. Both lived in memory only; a
restart made a taught server fresh again."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3

import httpx
import pytest

from server.engine.base import EngineInfo
from server.runtime.agents import AgentEntry, RequestLog
from server.runtime.history import History
from server.runtime.relearn import HistoryReading, recall
from server.runtime.type_shapes import TypeShapes
from server.scheduler import Dispatcher
from tests.support.agents import complete, register
from tests.support.clients import local_client
from tests.support.fake_engine import FAKE_MODEL, FakeEngine, FakeServer


def burst(start: float, n: int = 40, cost: float = 5_000.0) -> list[tuple[float, float]]:
    return [(start + 0.05 * i, cost) for i in range(n)]


def test_a_restarted_dispatcher_forecasts_the_next_burst_as_one_that_was_up_all_along() -> None:
    """The same burst seen live, or replayed from the history at its times on the restarted
    clock (before its start: negative), gives the next burst's first agent the same ETA."""
    up = Dispatcher("justitia", 10_000, 0.1)
    for i, (t, cost) in enumerate(burst(0.0)):
        up.register_agent(f"old{i}", cost, t)
    for i in range(40):  # they ended
        up.cancel_agent(f"old{i}", 40.0)
    restarted = Dispatcher("justitia", 10_000, 0.1)
    now = 5.0  # 300 s after the old burst began, 5 s after the restart
    assert restarted.recall_registrations(burst(now - 300.0) + [(now + 1.0, 1.0)], now) == 40  # not the future
    fresh = Dispatcher("justitia", 10_000, 0.1)
    etas = {}
    for name, d, t in (("up", up, 300.0), ("restarted", restarted, now), ("fresh", fresh, now)):
        d.register_agent("new", 20_000.0, t)
        d.refresh_etas(t)
        etas[name] = d.view("new", t).eta_s
        assert d.arrivals.episodes == (0 if name == "fresh" else 1)
    # the remembered burst of 40 smaller agents is expected again: they go ahead of this one
    assert etas["restarted"] == pytest.approx(etas["up"], rel=1e-6)
    assert etas["restarted"] > 1.5 * etas["fresh"]


def test_the_history_gives_back_the_last_agents_of_each_type_and_the_registrations(tmp_path) -> None:
    history = History(tmp_path / "h.sqlite3")

    def agent(i: int, type_: str, state: str = "finished") -> AgentEntry:
        entry = AgentEntry(id=f"a{i}", type=type_, tenant="t", prompt="", metadata={},
                           submitted_at=1000.0 + i, submitted_mono=0.0, predicted_cost=10.0 * i)
        entry.requests = [RequestLog(f"r{i}", prompt_tokens=100, output_tokens=5, submitted_s=0.0,
                                     admitted_s=0.0, finished_s=1.0, finish_reason="length",
                                     cached_tokens=60)]
        entry.state = state
        return entry

    for i in range(5):
        history.record(agent(i, "x"))
    history.record(agent(5, "y", state="failed"))
    history.record(agent(6, "y"))
    finished = history.recent_finished(per_type=3)
    assert [(t, n, len(r)) for t, n, r in finished] == [("t", "x", 1)] * 3 + [("t", "y", 1)]
    assert finished[0][2][0].cached_tokens == 60
    assert history.recent_registrations(limit=4) == [(1003.0, 30.0), (1004.0, 40.0), (1005.0, 50.0), (1006.0, 60.0)]
    # a row written by a later version (an unknown key) or mangled: its requests are skipped
    history.flush()
    with contextlib.closing(sqlite3.connect(history.path)) as db, db:  # the file, as another writer
        db.execute("UPDATE agents SET requests = ? WHERE id = 'a4'",
                   (json.dumps([{"request_id": "r", "prompt_tokens": 1, "output_tokens": 2,
                                 "submitted_s": 0, "admitted_s": 0, "finished_s": 1,
                                 "finish_reason": None, "new_field": 1}]),))
        db.execute("UPDATE agents SET requests = 'not json' WHERE id = 'a3'")
    reading = HistoryReading.read(history, 50, 100, EngineInfo(FAKE_MODEL, 4096, 32, 2048, 512))
    shapes = TypeShapes()
    got = recall(reading, shapes, Dispatcher("justitia", 10_000, 0.1), now=10.0, wall_now=1010.0)
    assert (got.agents, got.types, got.registrations) == (5, 2, 7)  # a3 gave no requests
    history.close()


def test_a_restarted_server_bounds_a_type_by_the_stages_it_learned_before(tmp_path) -> None:
    def three_stages(c: httpx.Client) -> None:
        rec = register(c, type_="looper")
        for _ in range(3):
            assert complete(c, rec["id"], 6).status_code == 200
        assert c.post(f"/v1/agents/{rec['id']}/finish").status_code == 200

    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=20) as c:
        assert complete(c, None, 6).status_code == 200  # a request seen: observed limits
        fresh = register(c, type_="looper")
        for _ in range(3):
            three_stages(c)
        taught = register(c, type_="looper")
    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=20) as c:
        recalled = c.get("/v1/scheduler").json()["recalled"]
        assert complete(c, None, 6).status_code == 200
        again = register(c, type_="looper")
        other = register(c, type_="never_seen")
    # registrations: the untagged request's agent and the three loopers (the history keeps
    # agents that ended: `fresh` and `taught` were still waiting when the server stopped)
    assert recalled == {"agents": 3, "types": 1, "registrations": 4, "time_model_steps": 0, "tau_s": None}
    assert taught["delay_bound_s"] > fresh["delay_bound_s"]
    assert again["delay_bound_s"] > other["delay_bound_s"]  # three stages, as before the restart


def test_a_restarted_server_starts_from_the_time_model_and_the_tau_its_last_run_measured(tmp_path) -> None:
    """Saved at shutdown once fitted to TRUSTED_STEPS steps (tau: once measured), keyed by
    the engine: the next run on that engine starts from the model as from a calibration (it
    sets the ETAs' rate at once) and continues the tau, not its 10 ms guess; a calibration
    given to the run wins over the model; another engine takes neither."""
    from server.runtime.engine_upkeep import TRUSTED_STEPS
    from server.scheduler.time_model import StepSample

    def snapshot(srv: FakeServer) -> dict:
        with local_client(base_url=srv.url, timeout=20) as c:
            assert complete(c, None, 100, prompt="x" * 499).status_code == 200  # a mix to sustain
            return c.get("/v1/scheduler").json()

    with FakeServer(tmp_path) as srv:
        first = snapshot(srv)
        bank = srv.app.state.scheduler.time_models
        for k in range(TRUSTED_STEPS):  # an engine of 2 ms + 5 us a sequence + 0.3 us a context token
            seqs, kv = 1 + k % 16, 100 * (k % 40)
            bank.observe("local", StepSample(0.002 + 5e-6 * seqs + 3e-7 * kv, seqs, 0, kv))
        fitted = bank.models()["local"]
        tau = srv.app.state.scheduler.tau
        for _ in range(200):  # steps of 4 ms with the cache full: tau 4 ms
            tau.observe_step(0.004, 4096, 4096)
        measured_tau = tau.tau_s
    assert first["recalled"]["time_model_steps"] == 0
    assert first["time_model"]["prior"]["source"] == "prior: cpu-tiny profile"
    with FakeServer(tmp_path) as srv:
        again = snapshot(srv)
    prior = again["time_model"]["prior"]
    assert again["recalled"]["time_model_steps"] == TRUSTED_STEPS
    assert again["recalled"]["tau_s"] == pytest.approx(measured_tau) and 0.004 <= measured_tau < 0.005
    assert first["tau"] == pytest.approx(0.01)  # the guess (fake steps are too empty to measure it)
    assert again["tau"] == pytest.approx(measured_tau, rel=0.01)
    assert again["promise"] == "widened"  # until a step is measured here
    assert prior["source"].startswith("prior: saved by the last run on this engine")
    assert (prior["base_s"], prior["per_seq_s"], prior["per_prefill_token_s"], prior["per_kv_token_s"]) \
        == pytest.approx(fitted.coefficients)  # the first run's fit at its shutdown
    assert prior["per_kv_token_s"] > 0  # learned: the built-in prior has no attention term
    # the saved fit was checked against this run's warm-up, as a calibration is, and kept
    assert first["time_model"]["prior_check"] is None  # the built-in prior: nothing to check
    assert again["time_model"]["prior_check"]["steps"] >= 16 and not again["time_model"]["prior_check"]["scaled"]
    assert first["eta_rate"] == pytest.approx(first["rate"])  # the built-in prior: not trusted
    assert again["eta_rate"] > 1.1 * again["rate"]  # trusted from the start, as a calibration
    other = FakeEngine(kv_capacity_tokens=8192)  # another engine: another speed
    with FakeServer(tmp_path, engine=other) as srv:
        elsewhere = snapshot(srv)
    assert elsewhere["time_model"]["prior"]["source"] == "prior: cpu-tiny profile"
    assert elsewhere["tau"] == pytest.approx(0.01) and elsewhere["recalled"]["tau_s"] is None
    assert elsewhere["recalled"]["agents"] == 0 and elsewhere["recalled"]["registrations"] >= 2
    # a calibration given to the run wins over the saved fit
    from server.shared.profiles import get_profile
    from server.sim.calibrate import save_profile
    save_profile(dataclasses.replace(get_profile("cpu-tiny"), name="measured-here"), tmp_path / "p.json")
    with FakeServer(tmp_path, profile=str(tmp_path / "p.json")) as srv:
        calibrated = snapshot(srv)
    assert calibrated["time_model"]["prior"]["source"] == "prior: measured-here profile"
