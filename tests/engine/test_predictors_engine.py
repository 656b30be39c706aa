"""Online learning on the real engine (one test, short outputs): a new agent type whose cost
follows the words of its prompt (short lookups of one request, long surveys of four), served
40 times by a server with the default settings, is predicted within a median relative error
of 0.30 for the next 10 agents, less than 15 s after the 40th finished."""

from __future__ import annotations

import httpx

from tests.support.workloads import learn_new_type


def test_a_new_type_is_learned_on_the_engine(vllm_client: httpx.Client) -> None:
    out = learn_new_type(vllm_client, "lookup_or_survey_on_vllm", tokens=16, deadline_s=15.0)
    print("online learning on vLLM:", out)
    assert out["learned_s"] <= 15.0
    assert out["median_relative_error"] <= 0.30, out
