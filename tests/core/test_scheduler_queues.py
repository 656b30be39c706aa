"""The queue protocol (both implementations) and reads that must not advance the clock."""

import copy
import itertools
import random
from types import SimpleNamespace

import pytest

from server.engine.base import EngineStats
from server.runtime.metrics import _SchedulerCollector
from server.scheduler import (
    POLICY_NAMES,
    AgentHeapQueue,
    Dispatcher,
    RequestQueue,
    RequestSpec,
    RequestState,
    RequestStatus,
    VirtualClock,
    kv_cost,
)
from server.scheduler.bounds import AgentShape, DelayBound
from server.scheduler.ewsjf import EwsjfConfig, EwsjfState, refine_and_prune
from server.scheduler.state import AgentState

_seq = itertools.count()


def agent(name: str) -> AgentState:
    return AgentState(name, next(_seq), None, 0.0, 1.0, 1.0, 1.0, DelayBound(0, 0, 0), AgentShape())


def request(a: AgentState, rid: str, p: int = 100, d: int = 10, at: float = 0.0) -> RequestState:
    seq = next(_seq)
    return RequestState(RequestSpec(rid, a.agent_id, p, d, d), seq, at, p + d, kv_cost(p, d), kv_cost(p, d),
                        order=(seq,))


def drain(q: RequestQueue, agents: dict[str, AgentState], now: float = 0.0) -> list[str]:
    """Admit everything: peek, pop, mark, requeue (what Dispatcher.admit does)."""
    out = []
    while (r := q.peek(now)) is not None:
        a = agents[r.spec.agent_id]
        q.pop(a, r)
        r.status = RequestStatus.RUNNING
        q.requeue(a)
        out.append(r.spec.request_id)
    return out


def fill(q: RequestQueue, agents: dict[str, AgentState], plan: list[tuple[str, str]], at: float = 0.0):
    reqs = {}
    for name, rid in plan:
        a = agents.setdefault(name, agent(name))
        reqs[rid] = r = request(a, rid, at=at)
        q.push(a, r)
        q.requeue(a)
    return reqs


def test_agent_heap_queue_orders_by_agent_key_then_request_order():
    # agent-level FCFS (parrot's key): every request of the first agent, then the next
    q = AgentHeapQueue(lambda a, head: (a.seq, head.seq))
    agents: dict[str, AgentState] = {}
    fill(q, agents, [("a", "a0"), ("b", "b0"), ("a", "a1"), ("b", "b1")])
    assert q.peek(0.0).spec.request_id == "a0"
    assert q.leader() is agents["a"] and q.head(agents["b"]).spec.request_id == "b0"
    assert drain(q, agents) == ["a0", "a1", "b0", "b1"]
    assert q.peek(0.0) is None and q.leader() is None


def test_agent_heap_queue_remove_and_remove_agent():
    q = AgentHeapQueue(lambda a, head: (head.seq,))  # fcfs
    agents: dict[str, AgentState] = {}
    reqs = fill(q, agents, [("a", "a0"), ("b", "b0"), ("a", "a1"), ("c", "c0"), ("b", "b1")])
    q.remove(agents["a"], reqs["a0"])
    q.requeue(agents["a"])
    q.remove_agent(agents["b"], [reqs["b0"], reqs["b1"]])
    assert drain(q, agents) == ["a1", "c0"]


def test_agent_heap_queue_rekeys_and_backfills():
    key = {"a": 2.0, "b": 1.0}
    q = AgentHeapQueue(lambda a, head: (key[a.agent_id], a.seq, head.seq), backfill_depth=1)
    agents: dict[str, AgentState] = {}
    fill(q, agents, [("a", "a0"), ("b", "b0"), ("b", "b1")])
    assert q.peek(0.0).spec.request_id == "b0"
    key["b"] = 3.0  # b was served: its key grows
    q.requeue(agents["b"])
    assert q.peek(0.0).spec.request_id == "a0"
    assert q.defer()  # a's head is blocked: look past it
    assert q.peek(0.0).spec.request_id == "b0"
    assert not q.defer()  # depth 1
    q.restore()
    assert drain(q, agents) == ["a0", "b0", "b1"]


def test_ewsjf_group_queues_are_fifo_in_one_group_and_score_ordered_across_groups():
    ctx = SimpleNamespace(tau=0.01, compute_per_kv=1.0 / 256, leader=lambda: None)
    q = EwsjfState(EwsjfConfig(), seed=0).attach(ctx)
    agents: dict[str, AgentState] = {}
    reqs = fill(q, agents, [("a", "a0"), ("b", "b0"), ("a", "a1"), ("b", "b1")])
    assert not q.defer() and q.head(agents["a"]) is None and q.leader() is None
    q.remove(agents["b"], reqs["b0"])
    assert q.queued == 3
    assert drain(q, agents) == ["a0", "a1", "b1"]  # one group before any fit: FIFO
    assert q.queued == 0 and q.peek(1.0) is None

    # two groups: short requests are e^2 faster, so at equal waits the short head goes first
    q = EwsjfState(EwsjfConfig(), seed=0).attach(ctx)
    obs = [(8.0 + random.Random(i).uniform(-0.2, 0.2), 0.0) for i in range(40)]
    obs += [(13.0 + random.Random(i).uniform(-0.2, 0.2), 2.0) for i in range(40)]
    q.use_partition(refine_and_prune(obs, 0.5, 12, 8, 0.25))  # one queue per group
    a = agents["a"]
    long_, short = request(a, "long", 2000, 1000), request(a, "short", 50, 20)
    for r in (long_, short):
        q.push(a, r)
    assert q.counts == [1, 1]
    assert drain(q, agents, now=1.0) == ["short", "long"]
    q.push(a, r2 := request(a, "later", 50, 20))
    q.remove_agent(a, [r2])
    assert q.queued == 0 and q.peek(2.0) is None


def clock_state(clock):
    clock = getattr(clock, "flat", None) or clock  # the dispatcher's clock with one tenant
    return (clock.now, clock.V, clock.backlog, dict(clock.departures), list(clock._sorted), list(clock._heap))


def busy_dispatcher(policy: str, seed: int = 0) -> tuple[Dispatcher, float]:
    """A dispatcher with agents arriving, running and finishing up to t = 2.9."""
    rng = random.Random(seed)
    disp = Dispatcher(policy, kv_capacity_tokens=20_000, iteration_time_s=0.01)
    t = 0.0
    for k in range(12):
        t += rng.uniform(0.0, 0.3)
        disp.register_agent(f"a{k}", kv_cost(500, 200) * rng.randint(1, 6), t)
        for j in range(rng.randint(1, 4)):
            disp.submit(RequestSpec(f"a{k}/{j}", f"a{k}", rng.randint(50, 900), 300, rng.randint(10, 300)), t)
        for spec in disp.admit(t):
            if rng.random() < 0.5:
                disp.on_request_finished(spec.request_id, spec.prompt_tokens, rng.randint(1, 300), t)
    return disp, t


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_reads_do_not_advance_the_clock_and_match_an_advanced_clock(policy):
    disp, t = busy_dispatcher(policy)
    advanced = copy.deepcopy(disp)
    before = clock_state(disp.clock)
    later = t + 0.7
    assert disp.clock.peek(later).departed  # some agents leave GPS between t and later
    views = {a: disp.view(a, later) for a in list(disp.agents)}
    snap = disp.snapshot(later)
    assert clock_state(disp.clock) == before  # nothing moved
    # the same reads after really advancing the clock: identical, bit for bit
    advanced.clock.advance(later)
    assert advanced.clock.now == later and advanced.clock.V > disp.clock.V
    assert views == {a: advanced.view(a, later) for a in list(advanced.agents)}
    assert snap == advanced.snapshot(later)
    assert snap["V"] == advanced.clock.V and snap["backlog"] == advanced.clock.backlog


def test_departed_agent_reads_its_departure_time_without_advancing():
    clock = VirtualClock(rate=10.0)
    clock.arrive("a", 100.0, 0.0)
    clock.arrive("b", 50.0, 0.0)
    reading = clock.peek(12.0)
    assert reading.departed == [("b", pytest.approx(10.0))] and reading.backlog == 1
    assert clock.finish_time("b", 50.0, 12.0) == pytest.approx(10.0)
    assert clock.finish_time("a", 100.0, 12.0) == pytest.approx(15.0)
    assert clock.now == 0.0 and clock.V == 0.0 and clock.backlog == 2 and not clock.departures
    clock.advance(12.0)
    assert clock.departures["b"] == reading.departed[0][1]
    assert clock.V == reading.V
    with pytest.raises(ValueError):
        clock.peek(11.0)


def test_a_metrics_scrape_does_not_advance_the_clock():
    disp, t = busy_dispatcher("justitia")
    before = clock_state(disp.clock)
    collector = _SchedulerCollector()
    collector.scheduler = SimpleNamespace(dispatcher=disp, now=lambda: t + 5.0, agents={},
                                          history=None, engine=SimpleNamespace(stats=EngineStats))
    gauges = {m.name: m.samples[0].value for m in collector.collect() if m.samples}
    assert clock_state(disp.clock) == before
    disp.clock.advance(t + 5.0)
    assert gauges["justitia_virtual_time"] == disp.clock.V
    assert gauges["justitia_gps_backlog"] == disp.clock.backlog
