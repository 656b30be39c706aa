"""The evaluation family of arrival shapes (server/sim/shapes.py) and `bench family`."""

import json
import statistics

import pytest

from justitia_cli import main
from server.shared.profiles import get_profile
from server.sim.family import TEACH_LULL_S, run_family, summarise, taught_workload, teacher_of
from server.sim.shapes import BURST_GAP_S, SHAPES, ShapeSpec, make_shaped
from server.sim.workload import load_workload

CPU = get_profile("cpu-tiny")
M = 4096


def offered_load(agents, profile=CPU, m=M) -> float:
    reqs = [(p, d) for a in agents for st in a.stages for p, d in st]
    rate = m / profile.effective_tau_s(m, reqs)
    arrivals = [a.arrival for a in agents]
    span = arrivals[-1] * len(agents) / (len(agents) - 1)
    return sum(a.kv_cost for a in agents) / (rate * span)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_offers_the_load_it_was_asked_for(shape):
    agents = make_shaped(ShapeSpec(shape, 60, 0.9, seed=3), CPU, M)
    assert len(agents) == 60 and len({a.id for a in agents}) == 60
    assert [a.arrival for a in agents] == sorted(a.arrival for a in agents)
    assert agents[0].arrival == 0.0
    assert all(a.extra["shape"] == shape for a in agents)
    assert offered_load(agents) == pytest.approx(0.9, rel=0.02)


def test_the_same_seed_draws_the_same_workload_and_another_seed_another():
    a = make_shaped(ShapeSpec("bursts", 30, 0.9, seed=1), CPU, M)
    b = make_shaped(ShapeSpec("bursts", 30, 0.9, seed=1), CPU, M)
    c = make_shaped(ShapeSpec("bursts", 30, 0.9, seed=2), CPU, M)
    assert [x.to_json() for x in a] == [x.to_json() for x in b]
    assert [x.arrival for x in a] != [x.arrival for x in c]


def test_bursts_keep_their_agents_close_and_lulls_between_them():
    agents = make_shaped(ShapeSpec("bursts", 80, 0.9, seed=5), CPU, M)
    gaps = [b.arrival - a.arrival for a, b in zip(agents, agents[1:], strict=False)]
    within = [g for g in gaps if g == pytest.approx(BURST_GAP_S, abs=1e-6)]
    assert len(within) >= len(gaps) * 0.6  # bursts are 4-16 agents long
    lulls = [g for g in gaps if g > 10 * BURST_GAP_S]
    assert lulls and len(set(round(g, 3) for g in lulls)) > 1  # of random lengths


def test_diurnal_arrivals_crowd_into_the_first_half_of_the_period():
    agents = make_shaped(ShapeSpec("diurnal", 200, 0.9, seed=0), CPU, M)
    mid = agents[-1].arrival / 2
    early = sum(a.arrival < mid for a in agents)
    assert early > 0.6 * len(agents)  # the sine's high half comes first


def test_heavy_tail_sizes_have_a_longer_tail_than_poisson():
    heavy = make_shaped(ShapeSpec("heavy-tail", 200, 0.9, seed=0), CPU, M)
    plain = make_shaped(ShapeSpec("poisson", 200, 0.9, seed=0), CPU, M)

    def tail(agents):
        costs = sorted(a.kv_cost for a in agents)
        return costs[-1] / statistics.median(costs)

    assert any(a.extra["size_multiplier"] > 1 for a in heavy)
    assert tail(heavy) > tail(plain)


def test_tenants_and_sessions_carry_their_fields():
    tenants = make_shaped(ShapeSpec("tenants", 100, 0.9, seed=0), CPU, M)
    counts = {t: sum(a.tenant == t for a in tenants) for t in ("t0", "t1", "t2")}
    assert counts["t0"] > counts["t1"] > counts["t2"] > 0
    sessions = make_shaped(ShapeSpec("sessions", 40, 0.9, seed=0), CPU, M)
    for a in sessions:
        assert all(len(st) == 1 for st in a.stages)
        assert len(a.pauses) == len(a.stages) and a.pauses[0] == 0.0
    assert statistics.median(p for a in sessions for p in a.pauses[1:]) == pytest.approx(0.8, rel=0.5)


def test_a_shape_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="unknown shape"):
        ShapeSpec("sawtooth")


def test_make_workload_writes_a_shape_that_loads_back(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["bench", "make-workload", "--shape", "sessions", "--agents", "20", "--seed", "7",
                 "--profile", "cpu-tiny", "--kv-tokens", str(M), "--load", "0.8", "--out", str(out)]) == 0
    loaded = load_workload(out)
    built = make_shaped(ShapeSpec("sessions", 20, 0.8, seed=7), CPU, M)
    assert [(a.id, a.type, a.arrival, a.stages, a.pauses) for a in loaded] == [
        (a.id, a.type, a.arrival, a.stages, a.pauses) for a in built]
    first = json.loads(out.read_text().splitlines()[0])
    assert first["pauses_s"][0] == 0.0 and first["shape"] == "sessions"
    assert main(["bench", "make-workload", "--shape", "sawtooth", "--out", str(out)]) == 2


def test_the_family_reports_promises_and_eta_error_per_shape():
    specs = [ShapeSpec(s, 12, 0.9, seed) for s in ("poisson", "bursts") for seed in (0, 1)]
    rows = run_family(specs, ["justitia", "vtc"], CPU, M)
    assert len(rows) == 8
    for r in rows:
        assert r.agents == 12
        if r.policy == "justitia":
            assert r.promises == 12 and 0 <= r.promises_kept <= 12
            assert r.eta_error_p50 is not None and r.deadline_over_jct_p50 is not None
    summary = summarise(rows)
    assert [(s["shape"], s["policy"]) for s in summary] == [
        ("poisson", "justitia"), ("poisson", "vtc"), ("bursts", "justitia"), ("bursts", "vtc")]
    assert all(s["seeds"] == [0, 1] for s in summary)
    assert summary[0]["promises"] == 24


def test_a_taught_member_follows_another_shape_after_a_lull_and_is_measured_alone():
    spec = ShapeSpec("bursts", 12, 0.9, seed=2)
    teacher = teacher_of(spec)
    assert teacher.shape != spec.shape and teacher.seed != spec.seed
    agents, ids = taught_workload(spec, CPU, M)
    taught = [a for a in agents if a.id not in ids]
    member = [a for a in agents if a.id in ids]
    assert len(taught) == len(member) == 12
    assert min(a.arrival for a in member) >= max(a.arrival for a in taught) + TEACH_LULL_S
    # the member is the fresh workload, shifted
    fresh = make_shaped(spec, CPU, M)
    start = min(a.arrival for a in member) - fresh[0].arrival
    assert [round(a.arrival - start, 4) for a in member] == [round(a.arrival, 4) for a in fresh]
    rows = run_family([spec], ["justitia"], CPU, M, modes=("fresh", "taught"))
    assert [(r.mode, r.agents, r.promises) for r in rows] == [("fresh", 12, 12), ("taught", 12, 12)]
    assert [s["mode"] for s in summarise(rows)] == ["fresh", "taught"]
    with pytest.raises(ValueError):
        run_family([spec], ["justitia"], CPU, M, modes=("stale",))


def test_bench_family_writes_its_json_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "family.json"
    assert main(["bench", "family", "--shapes", "poisson,tenants", "--seeds", "0-1", "--agents", "10",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["seeds"] == [0, 1] and doc["config"]["shapes"] == ["poisson", "tenants"]
    assert {s["shape"] for s in doc["shapes"]} == {"poisson", "tenants"}
    assert len(doc["runs"]) == 4
    # the totals add every member's promises up
    [total] = doc["totals"]
    assert total["policy"] == "justitia" and total["members"] == 4
    assert total["promises"] == sum(r["promises"] for r in doc["runs"]) == 40
    assert total["promises_kept"] == sum(r["promises_kept"] for r in doc["runs"])
    assert total["promises_broken_by_tools"] == sum(r["promises_broken_by_tools"] for r in doc["runs"])
    assert {"commit", "argv", "date", "host", "versions"} <= set(doc["provenance"])
    assert "poisson" in capsys.readouterr().out
    assert main(["bench", "family", "--shapes", "sawtooth"]) == 2
    assert main(["bench", "family", "--seeds", "5-1"]) == 2
    assert main(["bench", "family", "--policies", "nope"]) == 2
    assert main(["bench", "family", "--modes", "stale"]) == 2


def test_the_simulator_waits_out_an_agents_tool_pauses(tmp_path) -> None:
    from server.sim.simulator import simulate
    from server.sim.workload import AgentSpec, WorkloadError, parse_agent

    stages = [[(40, 8)], [(60, 8)], [(80, 8)]]
    plain = AgentSpec("a", "chat", 0.0, stages)
    paused = AgentSpec("b", "chat", 0.0, stages, pauses=[0.5, 1.0, 2.0])
    jct = {a.id: simulate([a], "justitia", CPU, M).agents[0].jct_s for a in (plain, paused)}
    assert jct["b"] == pytest.approx(jct["a"] + 3.5, abs=0.05)  # every pause, the first one too
    # the contract's field round-trips, one entry per stage, and bad values are refused
    assert parse_agent(paused.to_json()).pauses == [0.5, 1.0, 2.0]
    for bad in ([1.0], [0, -1, 0], [0, "x", 0]):
        with pytest.raises(WorkloadError, match="pauses_s"):
            parse_agent({**plain.to_json(), "pauses_s": bad})


def test_a_paused_agents_eta_and_deadline_expect_its_types_tool_time() -> None:
    from server.scheduler import Dispatcher, RequestSpec
    from server.scheduler.bounds import AgentShape

    disp = Dispatcher("justitia", 4096, 0.01)
    # a first agent of type "chat" pauses 2 s between its two stages
    disp.register_agent("a", 1000.0, 0.0, agent_type="chat", shape=AgentShape(2, 16, 0))
    disp.submit(RequestSpec("a/0", "a", 10, 8, 8), 0.0)
    for spec in disp.admit(0.0, 4096, 8):
        disp.on_request_finished(spec.request_id, 10, 8, 0.5)
    disp.submit(RequestSpec("a/1", "a", 10, 8, 8), 2.5)
    assert disp.pauses.mean_s("chat") == pytest.approx(2.0)
    # the next agent of the type is told about that pause in its ETA and deadline
    plain = Dispatcher("justitia", 4096, 0.01)
    shape = AgentShape(2, 16, 0)
    told = disp.register_agent("b", 1000.0, 3.0, agent_type="chat", shape=shape)
    alone = plain.register_agent("b", 1000.0, 3.0, agent_type="chat", shape=shape)
    assert told.eta_s == pytest.approx(alone.eta_s + 2.0, abs=0.3)
    assert told.deadline_s >= alone.deadline_s + 2.0


def test_pauses_expected_are_the_types_recent_ones_not_another_applications() -> None:
    """A server that served agents which paused, then agents of the same types that do not,
    expects no pause once the recent stage boundaries show none: their ETAs are those of a
    server that never saw the pauses, and their deadlines calibrated ones."""
    from server.scheduler import Dispatcher
    from server.scheduler.bounds import AgentShape
    from server.scheduler.pauses import RECENT, PauseStats
    from server.scheduler.tight_promise import CONTEXT_FLOORS

    stats = PauseStats()
    for _ in range(150):
        stats.observe("chat", 3.0)
    assert stats.paused_lately() and stats.mean_s("chat") == pytest.approx(3.0)
    for k in range(RECENT):
        stats.observe("chat" if k % 2 else "code", 0.0)  # boundaries crossed at once, any type
        assert stats.paused_lately() == (k < RECENT - 1)
        assert stats.mean_s("chat") == pytest.approx(3.0 * (RECENT - 1 - k) / RECENT)
    assert stats.mean_s("chat") == 0.0 and stats.share_lately() == 0.0
    assert stats.p90_s("chat") == pytest.approx(3.0)  # the worst case keeps the longer record
    assert stats.max_s() == pytest.approx(3.0)

    def server(paused: bool) -> Dispatcher:
        d = Dispatcher("justitia", 4096, 0.01)
        # the episode of arrivals the boundaries below are crossed in (pauses.mean_s `since`)
        d.register_agent("x", 1.0, 0.0, agent_type="chat")
        if paused:
            for _ in range(150):
                d.pauses.observe("chat", 3.0)
        for k in range(RECENT):  # crossed lately: over 1.5 s, the last 0.5 s before the agent comes
            d.pauses.observe("chat", 0.0, 1.0 + 0.1 * k)
        return d

    shape = AgentShape(4, 16, 0)
    taught = server(True).register_agent("b", 1000.0, 3.0, agent_type="chat", shape=shape)
    never = server(False).register_agent("b", 1000.0, 3.0, agent_type="chat", shape=shape)
    assert taught.eta_s == pytest.approx(never.eta_s)
    # the calibrated deadline, not the worst case (which still allows the old p90 pauses)
    assert taught.promise_assumes and taught.deadline_s == pytest.approx(CONTEXT_FLOORS[0] * taught.eta_s)
    assert taught.deadline_s >= never.deadline_s
    # one pause among the last boundaries: each of its three stage boundaries ahead holds a
    # 3 s pause with that chance (one in RECENT). Most likely none of them does: the ETA told
    # is the engine's time (tool_time.py: the point of least expected relative error), while
    # its interval holds a pause (one or more in three boundaries: 18%)
    d = server(True)
    d.pauses.observe("chat", 3.0, 2.9)
    told = d.register_agent("b", 1000.0, 3.0, agent_type="chat", shape=shape)
    engine = d.agents["b"].eta_engine_s
    assert d.agents["b"].eta_tools and engine == pytest.approx(never.eta_s)
    ratios = d.etas.calibration.engine_ratios(0)
    assert min(ratios) * engine <= told.eta_s <= max(ratios) * engine
    assert 3.0 <= told.eta_interval_s[1] <= 3.0 + max(ratios) * engine


def test_after_a_lull_an_eta_expects_only_the_pauses_seen_in_its_own_episode() -> None:
    """The agents that come after a lull may be another application's: an ETA expects the
    pauses of the stage boundaries crossed since its episode of arrivals began, not those of
    the traffic before the lull, while its deadline still allows the tool time seen."""
    from server.scheduler import Dispatcher, RequestSpec
    from server.scheduler.bounds import AgentShape

    shape = AgentShape(2, 16, 0)

    def served_a_pausing_agent() -> Dispatcher:
        disp = Dispatcher("justitia", 4096, 0.01)
        disp.register_agent("a", 1000.0, 0.0, agent_type="chat", shape=shape)
        for stage, at in enumerate((0.0, 2.5)):  # a 2 s pause between its stages
            disp.submit(RequestSpec(f"a/{stage}", "a", 10, 8, 8), at)
            for spec in disp.admit(at, 4096, 8):
                disp.on_request_finished(spec.request_id, 10, 8, at + 0.5)
        return disp

    same = served_a_pausing_agent()
    same.register_agent("b", 1000.0, 3.5, agent_type="chat", shape=shape)
    assert same.agents["b"].eta_pausing
    assert same.etas.pause_ahead(same.agents["b"], 3.5) == pytest.approx(2.0)

    later = served_a_pausing_agent()
    lull = later.arrivals.window_s + 10.0  # longer than any lull that ends an episode
    view = later.register_agent("b", 1000.0, 3.0 + lull, agent_type="chat", shape=shape)
    assert not later.agents["b"].eta_pausing
    assert later.etas.pause_ahead(later.agents["b"], 3.0 + lull) == 0.0
    # the worst case allows the pause seen, and says so
    assert "tool time" in view.promise_assumes
    assert view.deadline_s - view.eta_s >= 2.0
    # once a boundary of its own episode has paused, the next agent expects pauses again
    later.submit(RequestSpec("b/0", "b", 10, 8, 8), 3.0 + lull)
    for spec in later.admit(3.0 + lull, 4096, 8):
        later.on_request_finished(spec.request_id, 10, 8, 3.5 + lull)
    later.submit(RequestSpec("b/1", "b", 10, 8, 8), 5.5 + lull)
    later.register_agent("c", 1000.0, 6.0 + lull, agent_type="chat", shape=shape)
    assert later.agents["c"].eta_pausing


def test_a_promise_broken_by_a_pause_longer_than_it_allowed_is_counted_apart() -> None:
    """The first agent pauses 1 s between its stages; the second, promised that tool time
    (the longest pause seen), pauses 30 s: its promise breaks, by the client's tool time
    beyond what it allowed, and the engine's part held. A promise kept is not counted."""
    from server.sim.results import AgentResult
    from server.sim.simulator import simulate
    from server.sim.workload import AgentSpec

    stages = [[(40, 8)], [(60, 8)]]
    first = AgentSpec("a", "chat", 0.0, stages, pauses=[0.0, 1.0])
    second = AgentSpec("b", "chat", 5.0, stages, pauses=[0.0, 30.0])
    res = simulate([first, second], "justitia", CPU, M, tau="measured")
    a, b = res.agents
    assert a.paused_s == pytest.approx(1.0, abs=0.05) and b.paused_s == pytest.approx(30.0, abs=0.05)
    assert b.first_tool_allowance_s == pytest.approx(1.0, abs=0.05)
    assert b.promise_kept is False and b.promise_broken_by_tools
    assert res.summary()["promises_broken_by_tools"] == 1
    assert b.as_dict()["first_tool_allowance_s"] == b.first_tool_allowance_s
    # broken with the tool time kept within the allowance: the engine's part broke
    late = AgentResult("c", "chat", 0.0, 10.0, 1.0, 1.0, first_deadline_s=5.0, first_tool_allowance_s=2.0,
                       paused_s=3.0)
    assert late.promise_kept is False and not late.promise_broken_by_tools
    kept = AgentResult("d", "chat", 0.0, 4.0, 1.0, 1.0, first_deadline_s=5.0, first_tool_allowance_s=0.0,
                       paused_s=3.0)
    assert kept.promise_kept and not kept.promise_broken_by_tools
