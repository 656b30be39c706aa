"""`bench calibrate --served`: which points run through the server, how they are spaced, and
how their served times scale the step model (server/sim/calibrate_served.py)."""

from __future__ import annotations

import pytest

from server.shared.profiles import PROFILES
from server.sim.calibrate import GridPoint, PointResult
from server.sim.calibrate_served import (
    CHAIN_ID,
    CHAIN_STAGES,
    SERVED_ROOM,
    scaled,
    served_points,
    served_rows,
    served_workload,
    slowdown,
    with_turnaround,
)

RESULTS = [PointResult(GridPoint(1, 32, 16), 0.05), PointResult(GridPoint(4, 32, 16), 0.04),
           PointResult(GridPoint(3, 1024, 128), 0.32)]


def test_points_of_two_requests_or_more_are_served_one_at_a_time() -> None:
    points = served_points(RESULTS)
    assert [r.point.batch for r in points] == [4, 3]  # one request alone barely loads the server
    agents = served_workload(points)
    assert [a.id for a in agents] == ["cal0-0", "cal0-1", "cal0-2", "cal0-3", "cal1-0", "cal1-1", "cal1-2", CHAIN_ID]
    assert all(a.stages == [[(32, 16)]] for a in agents[:4]) and all(a.stages == [[(1024, 128)]] for a in agents[4:7])
    # each point's agents arrive together; the next point after room for the last to be served
    assert {a.arrival for a in agents[:4]} == {0.0}
    assert agents[4].arrival >= SERVED_ROOM * 0.04
    # then, alone, the agent whose stages (one request each) measure the client's turnaround
    chain = agents[-1]
    assert chain.arrival >= agents[4].arrival + SERVED_ROOM * 0.32
    assert len(chain.stages) == CHAIN_STAGES and all(len(st) == 1 for st in chain.stages)
    # served_rows reads the points only
    assert len(served_rows(points, {a.id: 1.0 for a in agents}, {a.id: 0.0 for a in agents})) == 2


def test_the_turnaround_the_server_measured_is_the_profiles() -> None:
    base = PROFILES["cpu-tiny"]
    assert base.stage_turnaround_s == 0.0  # the engine alone has no client
    assert with_turnaround(base, 0.0031).stage_turnaround_s == 0.0031
    assert with_turnaround(base, 0.0031).iteration_s(4, 10, 100) == base.iteration_s(4, 10, 100)
    for nothing in (None, float("nan"), -0.001):
        with pytest.raises(ValueError, match="no turnaround"):
            with_turnaround(base, nothing)


def test_the_slowdown_is_the_median_of_served_over_engine_alone_time() -> None:
    points = served_points(RESULTS)
    arrival = {f"cal0-{i}": 10.0 for i in range(4)} | {f"cal1-{i}": 20.0 for i in range(3)}
    finish = {"cal0-0": 10.05, "cal0-1": 10.06, "cal0-2": 10.08, "cal0-3": 10.07,
              "cal1-0": 20.3, "cal1-1": 20.4, "cal1-2": 20.48}
    rows = served_rows(points, finish, arrival)
    # a point is served when its last agent is done
    assert [round(r["served_s"], 3) for r in rows] == [0.08, 0.48]
    assert [round(r["slowdown"], 3) for r in rows] == [2.0, 1.5]
    assert slowdown(rows) == pytest.approx(1.75)
    # a point whose agents did not all finish says nothing of the path
    del finish["cal1-2"]
    assert [r["batch"] for r in served_rows(points, finish, arrival)] == [4]
    with pytest.raises(ValueError):
        slowdown([])


def test_every_term_of_the_step_model_is_scaled() -> None:
    base = PROFILES["cpu-tiny"]
    slow = scaled(base, 1.5)
    for term in ("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s"):
        assert getattr(slow, term) == pytest.approx(1.5 * getattr(base, term))
    assert slow.iteration_s(8, 100, 2000) == pytest.approx(1.5 * base.iteration_s(8, 100, 2000))
    assert slow.kv_tokens == base.kv_tokens and "x1.50" in slow.source
    with pytest.raises(ValueError):
        scaled(base, 0.0)
