"""ETA intervals (server/scheduler/eta_interval.py): calibrated on finished agents, and the
simulator's coverage on held-out seeds of the evaluation family."""

from __future__ import annotations

import random
import time

import pytest

from server.scheduler.eta_interval import MIN_SEEN, PRIOR_HIGH, PRIOR_LOW, EtaCalibration
from server.shared.profiles import get_profile
from server.sim.family import run_family
from server.sim.shapes import ShapeSpec


def test_a_fresh_calibration_takes_the_prior_and_scales_the_remaining_time() -> None:
    cal = EtaCalibration()
    assert (cal.factors.low, cal.factors.high) == (PRIOR_LOW, PRIOR_HIGH)
    # 4 s elapsed of an ETA of 10 s: the remaining 6 s is what is uncertain
    low, high = cal.interval(4.0, 10.0)
    assert low == pytest.approx(4.0 + 6.0 * PRIOR_LOW) and high == pytest.approx(4.0 + 6.0 * PRIOR_HIGH)
    # never past the deadline it was promised, never narrower than the ETA itself
    assert cal.interval(0.0, 10.0, deadline_s=11.0)[1] == 11.0
    assert cal.interval(12.0, 10.0) == (12.0, 12.0)  # past its ETA: nothing left to scale


def test_the_factors_follow_how_wrong_the_etas_were() -> None:
    cal = EtaCalibration()
    rng = random.Random(0)
    for _ in range(MIN_SEEN - 1):
        cal.observe(10.0, 30.0)
    assert cal.factors.high == PRIOR_HIGH  # not enough seen yet
    for _ in range(300):  # ETAs that came true within +-50%, then three times too short
        cal.observe(10.0, 10.0 * rng.uniform(0.5, 1.5))
    assert 0.5 <= cal.factors.low < 0.65 and 1.35 < cal.factors.high <= 1.5
    for _ in range(300):
        cal.observe(10.0, 10.0 * rng.uniform(2.5, 3.5))
    # the window forgets the old; the ETA told is scaled by about 3 and the interval holds it
    factors = cal.factors
    assert 2.5 < factors.low < factors.scale < factors.high <= 3.5 and factors.scale == pytest.approx(3.0, abs=0.1)
    cal.observe(0.0, 5.0)  # an agent told 0 s teaches nothing (no ratio)
    assert cal.seen == 200


def test_held_out_seeds_land_about_eighty_percent_inside_their_first_interval() -> None:
    profile = get_profile("cpu-tiny")
    specs = [ShapeSpec(shape, 48, 0.9, seed) for shape in ("poisson", "bursts") for seed in (100, 101)]
    rows = run_family(specs, ["justitia"], profile, 4096)
    coverage = [r.eta_coverage for r in rows]
    assert all(c is not None for c in coverage)
    assert 0.7 <= sum(coverage) / len(coverage) <= 0.95, coverage


def test_records_carry_the_interval_and_finished_agents_calibrate_it(fake_client, fake_server) -> None:
    def register(i: int, cost: float | None = 200.0) -> dict:
        body = {"type": "interval_probe", "prompt": f"probe {i}"}
        if cost is not None:
            body["predicted_cost"] = cost
        r = fake_client.post("/v1/agents", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def run(agent: dict) -> None:
        r = fake_client.post("/v1/completions", headers={"X-Justitia-Agent": agent["id"]},
                             json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert fake_client.post(f"/v1/agents/{agent['id']}/finish").status_code == 200

    first = register(0)
    low, high = first["eta_interval_s"]
    assert low <= first["eta_s"] <= high
    assert first["first_eta_interval_s"] == pytest.approx([low, high], abs=0.05)  # a few ms apart
    calibration = fake_server.app.state.scheduler.dispatcher.etas.calibration
    seen = calibration.seen
    for i in range(3):
        agent = register(i + 1)
        run(agent)
    assert calibration.seen == seen + 3  # each finished agent's JCT / first ETA
    # an agent whose cost is a cold start's guess (no predictor knows its type) teaches nothing
    guessed = register(9, cost=None)
    assert guessed["cost_source"] == "cold_start"
    run(guessed)
    assert calibration.seen == seen + 3
    ended = fake_client.get(f"/v1/agents/{agent['id']}").json()
    assert ended["first_eta_interval_s"] is not None and ended["jct_s"] is not None


def test_an_agent_that_will_pause_is_told_its_tool_time_apart(fake_client) -> None:
    """Agents of three stages pause 0.2 s before their second and third: the next such agent
    is told its two pauses ahead apart from its engine time (server/scheduler/tool_time.py),
    so its interval starts no earlier than those 0.4 s, where the replay's ETA scaled by the
    prior would start at a third of it."""
    pause_s = 0.2

    def register(i: int) -> dict:
        r = fake_client.post("/v1/agents", json={"type": "tool_user", "prompt": f"turns {i}",
                                                 "metadata": {"stages": 3}})
        assert r.status_code == 201, r.text
        return r.json()

    for i in range(3):
        agent = register(i)
        for stage in range(3):
            r = fake_client.post("/v1/completions", headers={"X-Justitia-Agent": agent["id"]},
                                 json={"prompt": f"turn {stage}", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
            if stage < 2:
                time.sleep(pause_s)
        assert fake_client.post(f"/v1/agents/{agent['id']}/finish").status_code == 200
        # the record says how long it paused in all
        paused = fake_client.get(f"/v1/agents/{agent['id']}").json()["paused_s"]
        assert 2 * pause_s <= paused < 2 * pause_s + 1.0
    told = register(3)
    low, high = told["eta_interval_s"]
    assert 2 * pause_s <= low <= told["eta_s"] <= high
    # its deadline is the worst case, which allows the tool time of two such pauses and says so
    assert told["tool_allowance_s"] >= 2 * pause_s and told["paused_s"] == 0.0
    assert told["deadline_s"] > told["fair_finish_s"] + told["delay_bound_s"] + 2 * pause_s - 1e-6
    assert "tool time" in told["promise_assumes"]
