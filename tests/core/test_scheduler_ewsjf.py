"""EWSJF: refine-and-prune partitions, routing, the density-weighted score, the online tuner."""

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.scheduler import Dispatcher, RequestSpec
from server.scheduler.ewsjf import EwsjfConfig, refine_and_prune
from server.scheduler.policies import POLICIES
from server.scheduler.tuner import GridThompsonTuner


def req(rid, agent, p, d):
    return RequestSpec(rid, agent, p, d, d)


def clusters(spec, seed=0):
    """Observations (x, y): one cluster per (x centre, y centre, count), y noise sd 0.05."""
    rng = random.Random(seed)
    return [(xc + rng.uniform(-0.2, 0.2), yc + rng.gauss(0.0, 0.05)) for xc, yc, n in spec for _ in range(n)]


def test_refine_and_prune_finds_the_homogeneous_groups():
    # three kinds of requests: short, medium, long service times, well apart in work
    obs = clusters([(7.0, math.log(0.2), 60), (10.0, math.log(2.0), 50), (14.0, math.log(20.0), 40)])
    part = refine_and_prune(obs, split=0.5, min_size=12, max_groups=8, edge_grid=0.25)
    assert len(part.means) == 3
    assert part.sizes == (60, 50, 40)
    assert all(s <= 0.5 for s in part.spreads)  # every group is homogeneous
    assert [math.exp(m) for m in part.means] == pytest.approx([0.2, 2.0, 20.0], rel=0.05)
    assert part.group(7.0) == 0 and part.group(10.0) == 1 and part.group(14.0) == 2


def test_prune_merges_groups_that_perform_alike():
    # different work, same service time: one group is enough
    obs = clusters([(7.0, 0.0, 40), (10.0, 0.05, 40), (14.0, 0.1, 40)])
    part = refine_and_prune(obs, split=0.5, min_size=12, max_groups=8, edge_grid=0.25)
    assert part.edges == () and part.sizes == (120,)
    # ... and a too small cluster joins its closest neighbour instead of standing alone
    obs = clusters([(7.0, 0.0, 60), (10.0, 3.0, 5), (14.0, 3.2, 60)])
    part = refine_and_prune(obs, split=0.5, min_size=12, max_groups=8, edge_grid=0.25)
    assert len(part.sizes) == 2 and min(part.sizes) >= 12


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([-3.0, -1.5, 0.0, 1.5, 3.0]), min_size=1, max_size=4, unique=True),
       st.lists(st.integers(24, 60), min_size=4, max_size=4), st.integers(0, 10**6))
def test_well_separated_clusters_are_recovered_exactly(ys, counts, seed):
    # cluster means at least 1.5 apart in ln(service) (any two together spread more than
    # split = 0.5), 3 apart in x: the partition must find exactly the clusters
    spec = [(6.0 + 3.0 * i, y, counts[i]) for i, y in enumerate(ys)]
    part = refine_and_prune(clusters(spec, seed), split=0.5, min_size=12, max_groups=8, edge_grid=0.25)
    assert part.sizes == tuple(c for _, _, c in spec)
    assert all(s <= 0.5 for s in part.spreads)
    assert [part.group(x) for x, _, _ in spec] == list(range(len(spec)))


def test_requests_are_routed_to_their_group_and_fifo_within_it():
    d = Dispatcher("ewsjf", 10**6, 0.01)
    state = d.policy.state
    # a partition with an edge between 1e4 and 1e6 units of work (set as a refit would)
    state.use_partition(refine_and_prune(clusters([(8.0, 0.0, 40), (13.0, 2.0, 40)]), 0.5, 12, 8, 0.25))
    d.register_agent("a", 1.0, 0.0)
    d.submit(req("long1", "a", 2000, 1000), 0.0)
    d.submit(req("short1", "a", 50, 20), 0.0)
    d.submit(req("long2", "a", 2000, 1000), 0.0)
    d.submit(req("short2", "a", 50, 20), 0.0)
    assert state.counts == [2, 2]
    assert [r.spec.request_id for r in state.queues[0]] == ["short1", "short2"]
    # same waiting time: the faster group first; inside a group, arrival order
    assert [s.request_id for s in d.admit(1.0, engine_free_slots=2)] == ["short1", "short2"]
    assert d.priority("a", "short1") < d.priority("a", "long1")


def two_group_dispatcher():
    d = Dispatcher("ewsjf", 10**6, 0.01)
    state = d.policy.state
    state.use_partition(refine_and_prune(clusters([(8.0, 0.0, 40), (13.0, 2.0, 40)]), 0.5, 12, 8, 0.25))
    d.register_agent("a", 1.0, 0.0)
    return d, state.weights[0] / state.weights[1]  # how much more urgent short requests are


@pytest.mark.parametrize("short_wait, first", [(0.5, "long"), (2.0, "short")])
def test_waiting_time_ages_a_slow_group_to_the_front(short_wait, first):
    d, ratio = two_group_dispatcher()
    assert ratio == pytest.approx(math.exp(2.0 * 2.0), rel=0.1)  # alpha = 2, e^2 slower
    t = 100.0
    d.submit(req("long", "a", 2000, 1000), 0.0)
    # the short request has waited short_wait x (the long one's wait / ratio)
    d.submit(req("short", "a", 50, 20), t - short_wait * (t + 0.01) / ratio)
    assert [s.request_id for s in d.admit(t, engine_free_slots=1)] == [first]


def test_cancel_and_rejection_empty_the_group_queues():
    d = Dispatcher("ewsjf", 10**6, 0.01)
    d.register_agent("a", 1.0, 0.0)
    d.register_agent("b", 1.0, 0.0)
    for k in range(5):
        d.submit(req(f"a{k}", "a", 100, 10), 0.0)
        d.submit(req(f"b{k}", "b", 100, 10), 0.0)
    admitted = d.admit(0.0, engine_free_slots=3)
    running = [s.request_id for s in admitted if s.agent_id == "a"]
    assert d.cancel_agent("a", 1.0) == running
    d.on_request_finished("b4", 100, 0, 1.0)  # b4 leaves without being admitted
    assert d.policy.state.queued == 4 - sum(s.agent_id == "b" for s in admitted)
    for spec in d.admit(2.0):
        d.on_request_finished(spec.request_id, 100, 10, 3.0)
    for s in admitted:
        if s.agent_id == "b":
            d.on_request_finished(s.request_id, 100, 10, 3.0)
    d.finish_agent("b", 3.0)
    assert d.policy.state.queued == 0 and d.is_idle()


def test_the_tuner_moves_toward_better_scores_and_is_deterministic():
    grid = [(a, b) for a in (0.0, 0.25, 0.5, 0.75, 1.0) for b in (0.0, 0.5, 1.0)]
    target = (0.75, 0.5)

    def score(i, rng):
        a, b = grid[i]
        return (a - target[0]) ** 2 + (b - target[1]) ** 2 + rng.gauss(0.0, 0.05)

    def run(seed):
        tuner = GridThompsonTuner(grid, seed=seed, start=0)
        rng = random.Random(seed)
        picks = [tuner.current]
        for _ in range(40):
            tuner.observe(tuner.current, score(tuner.current, rng))
            picks.append(tuner.suggest())
        return picks, tuner.best()

    picks, best = run(3)
    true = [(grid[i][0] - target[0]) ** 2 + (grid[i][1] - target[1]) ** 2 for i in picks]
    assert sum(true[-10:]) / 10 < sum(true[:10]) / 10  # later picks are better
    assert sum(true[-10:]) / 10 < 0.1  # and close to the target (grid average: 0.37)
    assert grid[best] == target
    assert run(3) == (picks, best)  # same seed: same proposals
    assert run(4)[0] != picks  # another seed explores differently


def test_ewsjf_learns_groups_and_tunes_from_measured_service():
    # drive the dispatcher like an engine of 4 slots that takes 10 ms per output token: the
    # service time is the output length, so the requests form two groups (short, long);
    # one arrival every 0.1 s offers 70% of the engine
    d = Dispatcher("ewsjf", 10**6, 0.01, seed=7)
    rng = random.Random(1)
    d.register_agent("a", 1.0, 0.0)
    now, k, running = 0.0, 0, {}
    for _ in range(1200):
        now += 0.1
        p, out = (100, 10) if rng.random() < 0.8 else (2000, 100)
        d.submit(req(f"r{k}", "a", p, out), now)
        k += 1
        for spec in d.admit(now, engine_free_slots=4 - len(running)):
            running[spec.request_id] = (spec, now + 0.01 * spec.max_tokens)
        for rid, (spec, done) in list(running.items()):
            if done <= now:
                d.on_request_finished(rid, spec.prompt_tokens, spec.max_tokens, now)
                del running[rid]
    state = d.policy.state
    assert len(state.partition.means) >= 2
    assert max(state.partition.spreads) <= state.params[2] + 1e-9
    assert state.epochs > 10 and len(state.history) == state.epochs
    assert {h["params"] for h in state.history} != {state.history[0]["params"]}  # it explored
    # short requests (the faster group) are at the front: the short group's weight is larger
    assert state.weights[0] > state.weights[-1]


def test_a_refit_that_changes_nothing_leaves_the_queues_alone():
    d = Dispatcher(replace(POLICIES["ewsjf"], config=EwsjfConfig(first_fit=1)), 10**6, 0.01)
    state = d.policy.state
    state._obs.extend(clusters([(8.0, 0.0, 40), (13.0, 2.0, 40)]))
    state.refit()
    reroutes = state.reroutes
    state._obs.extend(clusters([(8.0, 0.0, 40), (13.0, 2.0, 40)], seed=1))
    state.refit()
    assert state.reroutes == reroutes and state.refits == 2
