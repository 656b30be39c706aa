"""Types' typical shapes (server/runtime/type_shapes.py): agents that declare no shape are bounded by
the stages their type's earlier agents really ran (bounded as one stage, a multi-stage agent
without a declared shape would break its promise by its own structure)."""

from __future__ import annotations

import httpx
import pytest

from server.runtime.agents import RequestLog
from server.runtime.type_shapes import infer_shape
from tests.support.agents import complete, register
from tests.support.clients import local_client
from tests.support.fake_engine import FakeServer


def log(submitted: float, finished: float, out: int) -> RequestLog:
    return RequestLog("r", prompt_tokens=10, output_tokens=out, submitted_s=submitted,
                      admitted_s=submitted, finished_s=finished, finish_reason="length")


def test_stages_are_told_apart_by_requests_that_ran_together() -> None:
    # stage 1: three parallel requests (longest 30); stage 2: one of 50; stage 3: two (20, 5)
    shape = infer_shape([log(0.0, 1.0, 10), log(0.1, 2.0, 30), log(0.0, 1.5, 12),
                         log(2.5, 4.0, 50),
                         log(4.1, 5.0, 20), log(4.2, 4.5, 5)])
    assert shape is not None and shape.stages == 3 and shape.critical_path_tokens == 30 + 50 + 20
    assert infer_shape([]) is None
    assert infer_shape([log(0.0, 1.0, 7)]).critical_path_tokens == 7  # type: ignore[union-attr]


def test_a_shape_counts_the_prompt_tokens_its_requests_computed() -> None:
    """What the prefix cache served is no prefill; a request the engine reported nothing for
    counts whole."""
    def req(prompt: int, cached: int | None) -> RequestLog:
        return RequestLog("r", prompt_tokens=prompt, output_tokens=5, submitted_s=0.0, admitted_s=0.0,
                          finished_s=1.0, finish_reason="length", cached_tokens=cached)

    shape = infer_shape([req(2_000, 1_500), req(700, None), req(300, 0)])
    assert shape is not None and shape.prefill_tokens == 500 + 700 + 300
    # and the squares of what each computed: how far its prompts run past a step's budget
    assert shape.prefill_square_tokens == 500**2 + 700**2 + 300**2


def test_a_shape_holds_the_largest_request_of_the_first_stage() -> None:
    """Prompt and output, cached prompt tokens included (the engine holds them too); a later
    stage's larger request is not the first stage's."""
    def req(submitted: float, finished: float, prompt: int, out: int) -> RequestLog:
        return RequestLog("r", prompt_tokens=prompt, output_tokens=out, submitted_s=submitted,
                          admitted_s=submitted, finished_s=finished, finish_reason="stop", cached_tokens=prompt // 2)

    shape = infer_shape([req(0.0, 1.0, 300, 20), req(0.0, 2.0, 900, 40), req(2.5, 3.0, 3_000, 10)])
    assert shape is not None and shape.stages == 2 and shape.first_request_tokens == 900 + 40
    assert shape.stage_request_tokens == (900 + 40, 3_000 + 10)  # and each stage's


def test_a_types_stage_sizes_are_learned_stage_by_stage() -> None:
    """Each stage's largest request at the quantile of the agents that reached the stage."""
    from server.runtime.agents import AgentEntry
    from server.runtime.type_shapes import ETA_QUANTILE, TypeShapes

    def req(stage: int, prompt: int) -> RequestLog:
        return RequestLog("r", prompt_tokens=prompt, output_tokens=10, submitted_s=float(stage),
                          admitted_s=float(stage), finished_s=stage + 0.5, finish_reason="length")

    shapes = TypeShapes()
    for k, prompts in enumerate(([100], [200, 4000], [300, 3000, 50])):  # one request a stage
        entry = AgentEntry(id=f"a{k}", type="t", tenant="x", prompt="", metadata={},
                           submitted_at=0.0, submitted_mono=0.0, predicted_cost=1.0)
        entry.state = "finished"
        entry.requests = [req(stage, p) for stage, p in enumerate(prompts)]
        shapes.on_agent_ended(entry)
    bound, eta = shapes.typical("x", "t"), shapes.typical("x", "t", ETA_QUANTILE)
    assert bound is not None and bound.stage_request_tokens == (310, 4010, 60)
    assert eta is not None and eta.stage_request_tokens == (210, 3010)  # median of two: the lower


def _run_three_stages(c: httpx.Client, type_: str) -> None:
    rec = register(c, type_=type_)
    for _ in range(3):
        assert complete(c, rec["id"], 6).status_code == 200
    assert c.post(f"/v1/agents/{rec['id']}/finish").status_code == 200


def test_a_types_served_stages_shape_the_bound_of_its_next_agents(tmp_path) -> None:
    keys = {"key-a": "alpha", "key-b": "beta"}  # key -> tenant
    with FakeServer(tmp_path, api_keys=keys) as srv:
        a = local_client(base_url=srv.url, timeout=20, headers={"Authorization": "Bearer key-a"})
        b = local_client(base_url=srv.url, timeout=20, headers={"Authorization": "Bearer key-b"})
        with a, b:
            assert complete(a, None, 6).status_code == 200  # a request seen: observed limits
            before = register(a, type_="looper")
            for _ in range(3):
                _run_three_stages(a, "looper")
            after = register(a, type_="looper")
            other_tenant = register(b, type_="looper")
            declared = register(a, type_="looper", metadata={"stages": 1, "critical_path_tokens": 6})
    # three stages of one request each: the bound now covers three stage releases, where
    # the first agent's covered one; another tenant's agents of the same name do not learn it
    assert after["delay_bound_s"] > before["delay_bound_s"]
    assert other_tenant["delay_bound_s"] < after["delay_bound_s"]
    assert declared["delay_bound_s"] < after["delay_bound_s"]  # a declared shape wins


def test_a_types_shape_bounds_at_its_p90_and_estimates_at_its_median() -> None:
    from server.runtime.agents import AgentEntry
    from server.runtime.type_shapes import ETA_QUANTILE, TypeShapes

    shapes = TypeShapes()
    for stages in (1, 2, 5):  # one-request stages of 10 tokens each, 10-token prompts
        entry = AgentEntry(id=f"a{stages}", type="t", tenant="x", prompt="", metadata={},
                           submitted_at=0.0, submitted_mono=0.0, predicted_cost=1.0)
        entry.state = "finished"
        entry.requests = [log(float(i), i + 0.5, 10) for i in range(stages)]
        shapes.on_agent_ended(entry)
    bound, eta = shapes.typical("x", "t"), shapes.typical("x", "t", ETA_QUANTILE)
    assert bound is not None and (bound.stages, bound.critical_path_tokens, bound.prefill_tokens) == (5, 50, 50)
    assert eta is not None and (eta.stages, eta.critical_path_tokens, eta.prefill_tokens) == (2, 20, 20)
    assert shapes.typical("y", "t") is None  # another tenant's agents of that name: unknown


def test_a_learned_shape_gives_the_eta_its_median_agent(tmp_path) -> None:
    """With three agents of one, one and five stages seen, the next one's ETA expects a
    one-stage agent while its bound covers five (the p90 of three is the longest)."""
    def run(c: httpx.Client, stages: int) -> None:
        rec = register(c, type_="varied")
        for _ in range(stages):
            assert complete(c, rec["id"], 6).status_code == 200
        assert c.post(f"/v1/agents/{rec['id']}/finish").status_code == 200

    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=20) as c:
        for stages in (1, 1, 5):
            run(c, stages)
        learned = register(c, type_="varied")
        median = register(c, type_="varied", metadata={"stages": 1, "critical_path_tokens": 6})
        p90 = register(c, type_="varied", metadata={"stages": 5, "critical_path_tokens": 30})
    assert learned["delay_bound_s"] == p90["delay_bound_s"]
    assert learned["delay_bound_s"] > median["delay_bound_s"]
    # ETAs: the learned one expects the one-stage agent (its critical path dominates here)
    assert learned["first_eta_s"] == pytest.approx(median["first_eta_s"], rel=0.1)
    assert learned["first_eta_s"] < 0.5 * p90["first_eta_s"]
