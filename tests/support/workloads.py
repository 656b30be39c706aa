"""Agent workloads the server tests serve: a new agent type whose cost follows its prompt
(short lookups of one request, long surveys of four), for online learning."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import numpy as np

from predictors.synthetic import lookup_or_survey_prompt
from tests.support.agents import complete, register


def run_agent(client: httpx.Client, agent_type: str, prompt: str, tokens: int = 24) -> str:
    """A lookup (one request) or a survey (three sources, then a summary): the cost follows
    the prompt's words. Returns the agent's id once it finished."""
    agent = register(client, type_=agent_type, prompt=prompt)
    if "survey" in prompt:
        for k in range(4):
            r = complete(client, agent["id"], tokens, prompt=f"{prompt} part {k}")
            assert r.status_code == 200, r.text
    else:
        assert complete(client, agent["id"], 4, prompt=prompt).status_code == 200
    assert client.post(f"/v1/agents/{agent['id']}/finish").status_code == 200
    return str(agent["id"])


def predictor_row(client: httpx.Client, agent_type: str) -> dict | None:
    r = client.get("/v1/predictors")
    assert r.status_code == 200, r.text
    return next((p for p in r.json()["predictors"] if p["agent_type"] == agent_type), None)


def learn_new_type(client: httpx.Client, agent_type: str, tokens: int = 24,
                   deadline_s: float = 15.0) -> dict[str, float]:
    """Serve 40 agents of a new type, wait (at most `deadline_s`) for the retraining that
    the 40th triggers, then serve 10 more: the relative errors of their predictions."""
    rng = np.random.default_rng(5)
    prompts = [lookup_or_survey_prompt(rng) for _ in range(50)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: run_agent(client, agent_type, p, tokens), prompts[:40]))
    t40 = time.monotonic()
    while True:
        row = predictor_row(client, agent_type)
        if row is not None and row["last_job_samples"] >= 40 and not row["training"]:
            break
        assert time.monotonic() - t40 < deadline_s, f"not retrained within {deadline_s} s: {row}"
        time.sleep(0.1)
    learned_s = time.monotonic() - t40
    predicted = {}
    for p in prompts[40:]:
        agent = register(client, type_=agent_type, prompt=p)
        predicted[agent["id"]] = agent["predicted_cost"]
        client.delete(f"/v1/agents/{agent['id']}")
    # the same 10 prompts run as agents, for their real cost (the ones above only asked)
    ids = [run_agent(client, agent_type, p, tokens) for p in prompts[40:]]
    history = client.get("/v1/history", params={"agent_type": agent_type}).json()["samples"]
    cost = {s["agent_id"]: s["cost"] for s in history}
    real = [cost[i] for i in ids]
    errors = np.abs(np.array(list(predicted.values())) - real) / np.array(real)
    return {"median_relative_error": float(np.median(errors)), "learned_s": learned_s,
            "kind": row["kind"], "swaps": row["swaps"]}
