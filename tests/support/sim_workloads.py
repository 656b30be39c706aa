"""Random agent workloads for the simulator's property tests (hypothesis strategies)."""

from __future__ import annotations

from hypothesis import strategies as st

from server.sim.workload import AgentSpec

request = st.tuples(st.integers(1, 1500), st.integers(1, 300))  # (prompt, output) tokens
stage = st.lists(request, min_size=1, max_size=5)
agent = st.tuples(st.floats(0, 60, allow_nan=False), st.lists(stage, min_size=1, max_size=4))
workloads = st.lists(agent, min_size=1, max_size=14)


def build(specs) -> list[AgentSpec]:
    """Agents from drawn (arrival, stages) pairs."""
    return [AgentSpec(f"a{i}", "t", arr, [list(s) for s in stages]) for i, (arr, stages) in enumerate(specs)]
