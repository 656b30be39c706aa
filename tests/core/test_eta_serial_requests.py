"""An agent whose prompts are longer than half the cache cannot run two of its requests at
once: they run one after another, each holding its prompt for its decode steps while the
rest of the cache serves other agents. Its remaining path is then its KV cost over one
prompt's length in steps, not the declared critical path of a stage run all at once
(`EtaEstimator.serial_steps`)."""

from __future__ import annotations

import pytest

from server.scheduler import AgentShape, Dispatcher
from server.scheduler.time_model import TimeModel
from server.shared.profiles import EngineProfile
from server.sim.simulator import simulate
from server.sim.workload import AgentSpec

M = 4096
MODEL = TimeModel(base_s=0.003, per_seq_s=5e-5, per_prefill_token_s=2.5e-5, per_kv_token_s=1e-6)
PROFILE = EngineProfile("serial", kv_tokens=M, max_num_seqs=256, max_model_len=M, base_s=MODEL.base_s,
                        per_seq_s=MODEL.per_seq_s, per_prefill_token_s=MODEL.per_prefill_token_s,
                        per_kv_token_s=MODEL.per_kv_token_s)


def _shape(prompts: list[int], decode: int = 100) -> AgentShape:
    return AgentShape(1, decode, sum(prompts), prefill_square_tokens=sum(p * p for p in prompts))


def test_only_prompts_longer_than_half_the_cache_count_a_serial_path() -> None:
    d = Dispatcher("justitia", M, 0.02, time_model=MODEL)
    assert d.etas.serial_steps(_shape([2000] * 8), 1e6, 1.0) == 0.0
    assert d.etas.serial_steps(AgentShape(1, 100, 16000), 1e6, 1.0) == 0.0  # lengths unknown
    # eight prompts of 2,200 tokens: the KV cost left over one prompt's steps, plus a step each
    assert d.etas.serial_steps(_shape([2200] * 8), 2.2e6, 1.0) == pytest.approx(1000 + 8)
    assert d.etas.serial_steps(_shape([2200] * 8), 1.1e6, 0.5) == pytest.approx(500 + 4)


@pytest.mark.parametrize("prompt, decode", [(2200, 100), (3500, 40)])
def test_in_the_simulator_an_agent_of_requests_of_most_of_the_cache_is_told_their_time(
        prompt: int, decode: int) -> None:
    """Four agents of short prompts and long answers arrive first; the agent of eight
    requests of most of the cache, cheaper, goes ahead of them, runs its requests one at a
    time beside theirs, and is told so (counted as one stage run at once it was told 0.60
    and 0.75 of its JCT)."""
    others = [AgentSpec(f"o{i}", "u", 0.001 * i, [[(200, 800)] * 4]) for i in range(4)]
    agent = AgentSpec("serial", "t", 0.05, [[(prompt, decode)] * 8])
    results = simulate([*others, agent], "justitia", PROFILE, tau="measured").agents
    [result] = [a for a in results if a.id == "serial"]
    assert result.first_eta_s is not None
    assert abs(result.first_eta_s - result.jct_s) < 0.1 * result.jct_s
