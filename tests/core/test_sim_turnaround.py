"""The simulator's client turnaround: each later stage of an agent reaches the server
`stage_turnaround_s` after its previous stage ended (server/shared/profiles.py), and in that
gap the memory the stage held goes to the agents behind it, as it does live."""

from __future__ import annotations

from dataclasses import replace

import pytest

from server.shared.profiles import EngineProfile
from server.sim.simulator import simulate
from server.sim.workload import AgentSpec

FLAT = EngineProfile("flat", kv_tokens=1100, max_num_seqs=8, max_model_len=1000,
                     base_s=0.01, per_seq_s=0.0, per_prefill_token_s=0.0, per_kv_token_s=0.0)


def _jcts(agents: list[AgentSpec], turnaround_s: float) -> dict[str, float]:
    res = simulate(agents, "justitia", replace(FLAT, stage_turnaround_s=turnaround_s), 1100)
    return {a.id: a.finish_s - a.arrival_s for a in res.agents}


def test_an_agent_alone_waits_its_clients_turnaround_before_each_later_stage() -> None:
    chain = AgentSpec("a", "chain", 0.0, [[(16, 4)]] * 3)
    paused = AgentSpec("p", "chain", 0.0, [[(16, 4)]] * 3, pauses=[0.0, 0.5, 0.0])
    for agent in (chain, paused):
        assert _jcts([agent], 0.004)[agent.id] - _jcts([agent], 0.0)[agent.id] == pytest.approx(2 * 0.004)
    # the gaps are the client's turnaround, not pauses: only the declared one counts
    res = simulate([chain], "justitia", replace(FLAT, stage_turnaround_s=0.004), 1100)
    assert res.agents[0].paused_s == 0.0


def test_in_the_turnaround_the_front_agents_memory_goes_to_the_agents_behind_it() -> None:
    # a, small, is ahead in virtual time; b's two long requests cannot both run beside a's
    front = AgentSpec("a", "small", 0.0, [[(300, 20)], [(300, 20)]])
    behind = AgentSpec("b", "large", 0.001, [[(300, 212), (300, 212)]])
    without, within = _jcts([front, behind], 0.0), _jcts([front, behind], 0.001)
    # at once: a's next stage is queued before anything else is admitted, and it keeps its place
    assert without["a"] == pytest.approx(0.40, abs=0.02)
    # 1 ms later: b's second request took the memory a's first stage freed, and a waits for
    # b's first to end (212 steps), far longer than the millisecond
    assert within["a"] > 2.0
    assert within["b"] < without["b"]
