"""Tenants before agents: the hierarchical fair share of the scheduler core, its bound and
the simulator (server/scheduler/tenant_clock.py, docs/concepts.md)."""

from __future__ import annotations

import random

import pytest

from server.scheduler import (
    Dispatcher,
    RequestSpec,
    TenantClock,
    VirtualClock,
    gps_finish_times,
    hierarchical_gps_finish_times,
    kv_cost,
)
from server.shared.profiles import get_profile
from server.sim.simulator import make_predictions, simulate
from server.sim.workload import AgentSpec, parse_agent


# -- the reference -------------------------------------------------------------------------
def test_hierarchical_reference_with_one_tenant_is_flat_gps() -> None:
    rng = random.Random(3)
    arrivals = sorted(rng.uniform(0, 50) for _ in range(40))
    costs = [rng.uniform(1, 400) for _ in range(40)]
    flat = gps_finish_times(arrivals, costs, 10.0)
    assert hierarchical_gps_finish_times(arrivals, costs, ["t"] * 40, 10.0) == pytest.approx(flat)


def test_hierarchical_reference_shares_tenants_by_weight_then_agents() -> None:
    # A: three agents of 100, B: one of 100, rate 10. B gets 5/s and ends at 20; A's three
    # get 5/3 each until then (33.3 done), then 10/3 each: the remaining 200 take 20 s.
    arrivals, costs, tenants = [0.0] * 4, [100.0] * 4, ["A", "A", "A", "B"]
    assert hierarchical_gps_finish_times(arrivals, costs, tenants, 10.0) == pytest.approx([40, 40, 40, 20])
    # B weighs 3: 7.5/s, done at 13.33; A has had 33.3 of its 300 by then
    out = hierarchical_gps_finish_times(arrivals, costs, tenants, 10.0, {"B": 3.0})
    assert out == pytest.approx([40, 40, 40, 40 / 3])


# -- the clock -----------------------------------------------------------------------------
def random_load(seed: int, n: int = 60, tenants: str = "ABC") -> tuple[list[float], list[float], list[str]]:
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0, 40) for _ in range(n))
    costs = [rng.choice([rng.uniform(1, 30), rng.uniform(50, 600)]) for _ in range(n)]
    return arrivals, costs, [rng.choice(tenants) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tenant_clock_departures_match_the_hierarchical_reference(seed: int) -> None:
    arrivals, costs, tenants = random_load(seed)
    weights = {"A": 1.0, "B": 2.0, "C": 0.5}
    ref = hierarchical_gps_finish_times(arrivals, costs, tenants, 10.0, weights)
    clock = TenantClock(rate=10.0, weights=weights)
    for i, (a, c, t) in enumerate(zip(arrivals, costs, tenants, strict=True)):
        clock.arrive(i, c, a, t)
    clock.advance(10_000.0)
    assert clock.hierarchical and clock.backlog == 0
    for i in range(len(arrivals)):
        assert clock.departures[i] == pytest.approx(ref[i], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_tenant_clock_projections_match_the_reference_without_further_arrivals(seed: int) -> None:
    arrivals, costs, tenants = random_load(seed)
    weights = {"B": 3.0}
    cut = 20.0
    seen = [i for i, a in enumerate(arrivals) if a <= cut]
    ref = hierarchical_gps_finish_times([arrivals[i] for i in seen], [costs[i] for i in seen],
                                        [tenants[i] for i in seen], 10.0, weights)
    clock = TenantClock(rate=10.0, weights=weights)
    for i in seen:
        clock.arrive(i, costs[i], arrivals[i], tenants[i])
    fair = clock.projection(cut + 1.0)
    checked = 0
    for k, i in enumerate(seen):
        if ref[k] > cut + 1.0:  # still backlogged at the read
            assert fair.finish[i] == pytest.approx(ref[k], rel=1e-6)
            assert clock.finish_time(i, clock.tag(i), cut + 1.0) == pytest.approx(ref[k], rel=1e-6)
            checked += 1
    assert checked > 5
    # what a newcomer would get: the reference with it added
    ref2 = hierarchical_gps_finish_times([arrivals[i] for i in seen] + [cut + 1.0],
                                         [costs[i] for i in seen] + [80.0],
                                         [tenants[i] for i in seen] + ["A"], 10.0, weights)
    assert clock.arrival_finish_time(80.0, cut + 1.0, "A") == pytest.approx(ref2[-1], rel=1e-6)


def test_one_tenant_is_the_flat_clock_bit_for_bit() -> None:
    rng = random.Random(7)
    flat, tenant = VirtualClock(rate=7.0), TenantClock(rate=7.0, weights={"solo": 5.0})
    t = 0.0
    tags: dict[int, float] = {}
    for i in range(200):
        t += rng.uniform(0, 2)
        op = rng.random()
        if op < 0.5 or not tags:
            c = rng.uniform(1, 100)
            tags[i] = flat.arrive(i, c, t)
            assert tenant.arrive(i, c, t, "solo") == tags[i]
        elif op < 0.7:
            k = rng.choice(list(tags))
            extra = rng.uniform(0, 20)
            old = tags[k]
            tags[k] = flat.extend(k, old, extra, t)
            assert tenant.extend(k, old, extra, t) == tags[k]
        elif op < 0.85:
            k = rng.choice(list(tags))
            assert flat.settle(k, 5.0, t) == tenant.settle(k, 5.0, t)
        else:
            rate = rng.uniform(5, 10)
            flat.set_rate(rate, t)
            tenant.set_rate(rate, t)
        assert tenant.peek(t + 1.0) == flat.peek(t + 1.0)
        assert tenant.V == flat.V and tenant.backlog == flat.backlog
    assert not tenant.hierarchical and tenant.departures == flat.departures


# -- dispatch ------------------------------------------------------------------------------
def drive(tenant: str | None, weights: dict | None = None, seed: int = 5) -> list[tuple]:
    rng = random.Random(seed)
    d = Dispatcher("justitia", 20_000, 0.01, tenant_weights=weights)
    out: list[tuple] = []
    t = 0.0
    running: list[RequestSpec] = []
    for k in range(30):
        t += rng.uniform(0.0, 0.4)
        v = d.register_agent(f"a{k}", kv_cost(500, 200) * rng.randint(1, 6), t, tenant=tenant)
        out.append((v.virtual_finish, v.deadline_s, v.delay_bound_s))
        for j in range(rng.randint(1, 4)):
            d.submit(RequestSpec(f"a{k}/{j}", f"a{k}", rng.randint(50, 900), 300, rng.randint(10, 300)), t)
        if k % 5 == 4:
            d.refresh_etas(t)
        for spec in d.admit(t):
            out.append((spec.request_id,))
            running.append(spec)
        while running and rng.random() < 0.6:
            spec = running.pop(rng.randrange(len(running)))
            d.on_request_finished(spec.request_id, spec.prompt_tokens, rng.randint(1, 300), t)
    return out


def test_single_tenant_ordering_is_unchanged_whatever_its_name_or_weight() -> None:
    untagged = drive(None)
    assert drive("acme", {"acme": 3.0}) == untagged
    assert drive("acme") == untagged


def test_a_tenant_splitting_its_work_does_not_overtake_anothers_agent() -> None:
    """Tenant A floods with one agent per request; B's agent (larger than each of A's)
    is served as H-GPS says: half the engine, not behind all of A's small agents."""
    def first_b(split: bool) -> int:
        d = Dispatcher("justitia", 4_000, 0.01)
        for i in range(40):
            agent = f"x{i}" if split else "x"
            if split or i == 0:
                d.register_agent(agent, kv_cost(300, 60) * (1 if split else 40), 0.0, tenant="A")
            d.submit(RequestSpec(f"x/{i}", agent, 300, 60, 60), 0.0)
        d.register_agent("b", 4 * kv_cost(300, 60), 0.0, tenant="B")
        for j in range(4):
            d.submit(RequestSpec(f"b/{j}", "b", 300, 60, 60), 0.0)
        order: list[str] = []
        t = 0.0
        while len(order) < 44:
            specs = d.admit(t, engine_free_slots=1)
            if not specs:
                break
            for spec in specs:
                order.append(spec.request_id)
                t += 0.01
                d.on_request_finished(spec.request_id, 300, 60, t)
        return max(i for i, rid in enumerate(order) if rid.startswith("b/"))
    assert first_b(split=True) <= 12  # B's 4 requests interleave with A's, not after 40 of them
    assert first_b(split=False) <= 12


# -- the bound -----------------------------------------------------------------------------
def test_queue_then_cancel_leaves_another_tenants_bound() -> None:
    d = Dispatcher("justitia", 45_000, 0.025)
    d.register_agent("h", 4 * kv_cost(500, 500), 0.0, tenant="honest")
    for j in range(4):
        d.submit(RequestSpec(f"h/{j}", "h", 500, 500, 500), 0.0)
    d.admit(0.0)
    before = d.register_agent("h2", kv_cost(500, 500), 0.1, tenant="honest").delay_bound_s
    # the attacker queues 200 requests of 2,040 prompt tokens on one agent, then cancels it
    d.register_agent("x", 1.0, 0.2, tenant="attacker")
    for j in range(200):
        d.submit(RequestSpec(f"x/{j}", "x", 2040, 500, 500), 0.2)
    d.admit(0.2)
    during = d.register_agent("h3", kv_cost(500, 500), 4.0, tenant="honest").delay_bound_s
    d.cancel_agent("x", 8.0)
    after = d.register_agent("h4", kv_cost(500, 500), 8.1, tenant="honest").delay_bound_s
    assert during <= 1.5 * before
    assert after <= 1.5 * before


def test_a_cancelled_agents_queued_work_leaves_its_own_tenants_bound() -> None:
    d = Dispatcher("justitia", 45_000, 0.025)
    d.register_agent("x", 1.0, 0.0, tenant="A")
    for j in range(200):
        d.submit(RequestSpec(f"x/{j}", "x", 2040, 40, 40), 0.0)
    admitted = d.admit(0.0)
    assert 0 < len(admitted) < 200
    during = d.register_agent("y", 1.0, 1.0, tenant="A").bound.lag_s
    d.cancel_agent("x", 2.0)
    after = d.register_agent("z", 1.0, 2.0, tenant="A").bound.lag_s
    c_max = kv_cost(2040, 40)
    assert during == pytest.approx((2 * c_max + 200 * c_max) / (45_000 / 0.025))
    # what it had admitted stays (it ran), what was queued leaves
    assert after == pytest.approx((2 * c_max + len(admitted) * c_max) / (45_000 / 0.025))


# -- the simulator -------------------------------------------------------------------------
def honest_and_flood(split: bool, tenants: bool, flood: int = 1000) -> list[AgentSpec]:
    h = "honest" if tenants else None
    x = "flood" if tenants else None
    agents = [AgentSpec(f"h{i}", "honest", 1.0 + 2.0 * i, [[(400, 32)] * 2 for _ in range(4)], tenant=h)
              for i in range(5)]
    if split:  # one agent per request (as untagged requests are)
        agents += [AgentSpec(f"x{i}", "flood", 0.01 * i, [[(300, 60)]], tenant=x) for i in range(flood)]
    else:
        agents.append(AgentSpec("x", "flood", 0.0, [[(300, 60)] * flood], tenant=x))
    return sorted(agents, key=lambda a: a.arrival)


def honest_figures(split: bool, tenants: bool) -> tuple[float, float]:
    agents = honest_and_flood(split, tenants)
    res = simulate(agents, "justitia", get_profile("a100-llama7b"), 45_000, make_predictions(agents),
                   isolated=[0.0] * len(agents))
    honest = [a for a in res.agents if a.id.startswith("h")]
    return (sum(a.jct_s for a in honest) / len(honest), max(a.first_deadline_s for a in honest))


@pytest.mark.slow
def test_splitting_a_tenants_load_into_agents_moves_an_honest_tenant_at_most_1_5x() -> None:
    one_jct, one_deadline = honest_figures(split=False, tenants=True)
    split_jct, split_deadline = honest_figures(split=True, tenants=True)
    assert split_jct <= 1.5 * one_jct
    assert split_deadline <= 1.5 * one_deadline
    # without tenants (a flat share per agent) the same split is what hurts
    flat_one, _ = honest_figures(split=False, tenants=False)
    flat_split, _ = honest_figures(split=True, tenants=False)
    assert flat_split > 1.5 * flat_one


def test_workload_tenant_field_is_read_and_written() -> None:
    a = parse_agent({"id": "a", "arrival": 0, "tenant": "acme", "stages": [[{"p": 1, "d": 1}]]})
    assert a.tenant == "acme" and a.to_json()["tenant"] == "acme"
    b = parse_agent({"id": "b", "arrival": 0, "stages": [[{"p": 1, "d": 1}]]})
    assert b.tenant is None and "tenant" not in b.to_json()


@pytest.mark.parametrize("seed", range(12))
def test_agents_of_several_tenants_finish_within_their_hierarchical_bound(seed: int) -> None:
    rng = random.Random(seed)
    agents = []
    for i in range(rng.randint(3, 14)):
        stages = [[(rng.randint(50, 1500), rng.randint(1, 300)) for _ in range(rng.randint(1, 4))]
                  for _ in range(rng.randint(1, 4))]
        agents.append(AgentSpec(f"a{i}", "t", rng.uniform(0, 20), stages, tenant=rng.choice("ABC")))
    agents.sort(key=lambda a: a.arrival)
    res = simulate(agents, "justitia", get_profile("a100-llama7b"), rng.choice([3000, 6000, 12000]),
                   make_predictions(agents), isolated=[0.0] * len(agents))
    for a in res.agents:
        assert a.finish_s <= a.gps_finish_s + a.delay_bound_s + 1e-6, a
