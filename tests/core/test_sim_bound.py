"""Property tests of the simulator under Justitia: the delay bound, accounting, GPS."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.scheduler import gps_finish_times
from server.shared.profiles import get_profile
from server.sim.simulator import gps_tau_s, make_predictions, simulate
from tests.support.sim_workloads import build, workloads


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, st.integers(3000, 12000), st.sampled_from(["a100-llama7b", "cpu-tiny"]))
def test_justitia_finishes_every_agent_by_gps_finish_plus_bound(specs, m, profile_name):
    profile = get_profile(profile_name)
    agents = build(specs)
    res = simulate(agents, "justitia", profile, m)
    assert res.accounting_zero
    assert res.preemptions == 0  # footprints are exact: Justitia never makes the engine preempt
    for a in res.agents:
        assert a.finish_s >= a.arrival_s
        assert a.finish_s <= a.gps_finish_s + a.delay_bound_s + 1e-6, (a, res.summary())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, st.integers(2000, 8000), st.sampled_from(["fcfs", "sjf", "vtc", "parrot", "srjf", "justitia-c"]))
def test_every_policy_finishes_everything_and_accounting_returns_to_zero(specs, m, policy):
    agents = build(specs)
    res = simulate(agents, policy, get_profile("a100-llama7b"), m, make_predictions(agents, "noisy:3", seed=1))
    assert res.accounting_zero
    assert all(a.finish_s >= a.arrival_s for a in res.agents)
    # the engine can never beat an agent's critical path (one token per iteration)
    tau_min = get_profile("a100-llama7b").base_s
    by_arrival = sorted(agents, key=lambda x: x.arrival)
    for a, spec in zip(sorted(res.agents, key=lambda x: x.arrival_s), by_arrival, strict=True):
        assert a.jct_s >= spec.critical_path_tokens * tau_min - 1e-9


def test_gps_finish_in_results_is_the_offline_reference():
    agents = build([(0.0, [[(500, 100)] * 3]), (1.0, [[(200, 50)], [(300, 80)]]), (1.5, [[(1000, 200)]])])
    profile = get_profile("a100-llama7b")
    res = simulate(agents, "justitia", profile, 5000)
    rate = 5000 / gps_tau_s(profile, 5000, agents)
    ref = gps_finish_times([a.arrival for a in agents], [a.kv_cost for a in agents], rate)
    assert [a.gps_finish_s for a in res.agents] == pytest.approx(ref)


def test_a_simulated_server_measures_its_rate_as_the_live_one_does():
    """`tau="measured"`: the dispatcher starts from the server's initial guess and takes R
    from the simulated steps, as the live server does from the engine's; the schedule of a
    policy whose order ignores R (fcfs) does not move, what agents are told does."""
    from server.sim.simulator import MEASURED_TAU_PRIOR_S, gps_tau_s, simulate
    from server.sim.workload import load_workload

    agents = load_workload(Path(__file__).parents[2] / "benchmarks/workloads/contended48.jsonl")
    profile = get_profile("cpu-tiny")
    told, measured = (simulate(agents, "fcfs", profile, 4096, tau=t) for t in ("profile", "measured"))
    assert [a.finish_s for a in measured.agents] == [a.finish_s for a in told.agents]
    assert [a.first_eta_s for a in measured.agents] != [a.first_eta_s for a in told.agents]
    tau = measured.extra["measured_tau_s"]
    assert tau != MEASURED_TAU_PRIOR_S and "measured_tau_s" not in told.extra
    # what the engine sustained: slower than the profile's steps at full memory, same order
    assert 0.5 < tau / gps_tau_s(profile, 4096, agents) < 4.0
    with pytest.raises(ValueError, match="tau must be one of"):
        simulate(agents[:2], "fcfs", profile, 4096, tau="guessed")


def test_the_simulated_server_starts_from_the_live_servers_guess():
    """`tau="measured"` stands for the live server: the same initial tau, the same update
    period as its housekeeping, the same ETA refresh period."""
    from server.api.config import ServerConfig
    from server.runtime.live import LiveConfig
    from server.sim.simulator import ETA_REFRESH_S, MEASURED_TAU_PRIOR_S, TAU_UPDATE_S

    live = LiveConfig()
    assert MEASURED_TAU_PRIOR_S == ServerConfig.model_fields["initial_tau_s"].default == live.initial_tau_s
    assert TAU_UPDATE_S == live.housekeeping_s and ETA_REFRESH_S == live.eta_refresh_s


def test_a_simulated_server_bounds_agents_against_the_requests_it_has_seen():
    """`tau="measured"` stands for the live server, which knows nothing of the requests to
    come: an agent is bounded against the longest decode seen when it registers, not the
    workload's (a later agent's 600 tokens), and the first, before any request, against the
    engine's context (its promise widened)."""
    profile = get_profile("cpu-tiny")
    agents = build([(0.0, [[(64, 8)]]), (5.0, [[(64, 8)]]), (10.0, [[(64, 600)]])])
    told, seen = (simulate(agents, "justitia", profile, 4096, tau=t) for t in ("profile", "measured"))
    first, second, _ = seen.agents
    # against a d_max of 600 the blocking term alone is 601 iterations of at least the
    # profile's base step; against the 8 tokens seen it is 9
    assert told.agents[1].delay_bound_s >= 601 * profile.base_s > second.delay_bound_s
    # against the engine's context before any request was seen
    assert first.delay_bound_s >= min(profile.max_model_len, 4096) * profile.base_s
    assert second.jct_s <= second.first_deadline_s
