"""The ETA estimator's fast pass and its slow path compute one formula (eta.py) two ways:
after a pass, placing any agent again by the slow path gives the ETA the pass cached.

Property-tested over generated histories: policies, tenants, a time model of the engine (or
none; with a chunked prefill's term or not), declared shapes with prefill (and its squares),
measured arrivals of work, requests running, finished and re-predicted, agents gone."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from server.scheduler import AgentShape, Dispatcher, RequestSpec
from server.scheduler.policies import POLICY_NAMES
from server.scheduler.time_model import TimeModel

time_models = st.one_of(
    st.none(),
    st.builds(TimeModel,
              base_s=st.floats(1e-4, 0.05), per_seq_s=st.floats(0.0, 1e-3),
              per_prefill_token_s=st.floats(0.0, 1e-4), per_kv_token_s=st.floats(0.0, 1e-5),
              prefill_chunk_tokens=st.sampled_from([0, 512, 2048]),
              per_chunked_prefill_s=st.floats(0.0, 1e-8)),
)
shapes = st.one_of(
    st.none(),
    st.builds(AgentShape, stages=st.integers(1, 4),
              critical_path_tokens=st.one_of(st.none(), st.integers(1, 2_000)),
              prefill_tokens=st.one_of(st.none(), st.integers(0, 20_000)),
              prefill_square_tokens=st.one_of(st.none(), st.integers(0, 4 * 10**8))),
)
# one event of an agent's life: (gap since the last event in s, cost, shape, tenant,
# requests as (prompt, output), how many of them finish, re-predicted total or None, ends)
agents = st.tuples(
    st.floats(0.0, 30.0), st.floats(1.0, 5e6), shapes, st.sampled_from([None, "x", "y"]),
    st.lists(st.tuples(st.integers(1, 3_000), st.integers(1, 500)), max_size=3),
    st.integers(0, 3), st.one_of(st.none(), st.floats(1.0, 1e7)), st.booleans(),
)


def _history(policy: str, kv: int, tau: float, model: TimeModel | None, sustains: bool,
             tenants: bool, events: list) -> tuple[Dispatcher, float]:
    d = Dispatcher(policy, kv, tau, time_model=model)
    d.set_time_model(model, sustains=sustains)
    now = 0.0
    for i, (gap, cost, shape, tenant, requests, finished, expected, ends) in enumerate(events):
        now += gap
        aid = f"a{i}"
        d.register_agent(aid, cost, now, shape=shape, tenant=tenant if tenants else None)
        for j, (p, out) in enumerate(requests):
            d.submit(RequestSpec(f"{aid}-{j}", aid, prompt_tokens=p, max_tokens=out), now)
        d.admit(now)
        for j, (p, out) in enumerate(requests[:finished]):
            if f"{aid}-{j}" in d.requests:
                d.on_request_finished(f"{aid}-{j}", p, max(1, out // 2), now, cached_tokens=p // 3)
        if expected is not None:
            d.repredict(aid, expected, now)
        if ends:
            d.finish_agent(aid, now)
        if i % 3 == 2:
            d.refresh_etas(now)  # passes in between: the arrivals are measured at several times
    return d, now


# Work ahead of an agent that is served before the arrivals' span ends, while the agent's own
# work ends after it: the start and the finish of its wait then see different rates.
SPAN_STRADDLED = [(0.0, 1e6, None, None, [(1000, 100), (1000, 100)], 0, None, False),
                  (0.0, 1e4, AgentShape(1, None, 1000), None, [(1000, 100)], 0, None, False)]

# An agent whose prompts cannot share the cache (`EtaEstimator.serial_steps`) ordered before
# agents of short prompts: its path is its requests one after another.
SERIAL = [*[(0.0, 2e6, AgentShape(1, 800, 800), None, [(200, 800)], 0, None, False)] * 3,
          (0.01, 1.8e6, AgentShape(1, 100, 17_600, prefill_square_tokens=8 * 2200**2), None,
           [(2200, 100)], 0, None, False)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICY_NAMES), kv=st.integers(2_000, 100_000), tau=st.floats(0.005, 0.1),
       model=time_models, sustains=st.booleans(), tenants=st.booleans(),
       events=st.lists(agents, min_size=1, max_size=10), later=st.floats(0.0, 20.0))
@example(policy="justitia", kv=10_000, tau=0.02, model=TimeModel(0.01, 1e-4, 1e-5, 1e-6), sustains=True,
         tenants=False, events=SPAN_STRADDLED, later=0.0)
@example(policy="justitia", kv=4096, tau=0.02, model=TimeModel(0.003, 5e-5, 2.5e-5, 1e-6), sustains=True,
         tenants=False, events=SERIAL, later=0.0)
def test_the_fast_pass_and_the_slow_path_agree(policy: str, kv: int, tau: float, model: TimeModel | None,
                                               sustains: bool, tenants: bool, events: list,
                                               later: float) -> None:
    d, now = _history(policy, kv, tau, model, sustains, tenants, events)
    now += later
    d.refresh_etas(now)
    fast = {aid: d.eta_time(aid, now) for aid in d.agents}
    for aid, agent in d.agents.items():
        agent.eta_at = None  # as if the pass had not placed it: the slow path
        slow = d.eta_time(aid, now)
        assert slow == pytest.approx(fast[aid], rel=1e-9, abs=1e-9), aid
        d.refresh_etas(now)  # the next agent is placed against the same pass
