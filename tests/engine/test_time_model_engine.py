"""The time model on the real vLLM CPU engine: the server learns it from the engine's steps
and shows it (GET /v1/scheduler, /metrics); `bench calibrate --quick` measures and fits."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from justitia_cli import main
from server.runtime.metrics import metric_value
from server.shared.profiles import load_profile


def test_scheduler_shows_the_time_model_learned_from_engine_steps(vllm_client: httpx.Client) -> None:
    before = vllm_client.get("/v1/scheduler").json()["time_model"]
    assert set(before["prior"]) >= {"base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s"}
    steps_before = before["engines"].get("local", {}).get("samples", 0)
    # Enough steps for several refits: 4 requests of 600 prompt tokens and 120 output tokens.
    for _ in range(2):
        r = vllm_client.post("/v1/completions", json={"prompt": [11 + i % 600 for i in range(600)],
                                                 "max_tokens": 120, "ignore_eos": True, "n": 2})
        assert r.status_code == 200, r.text
    model = vllm_client.get("/v1/scheduler").json()["time_model"]["engines"]["local"]
    assert model["samples"] >= steps_before + 200  # one sample per engine step
    coefs = [model[k] for k in ("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s")]
    assert all(c >= 0 for c in coefs) and sum(coefs) > 0
    assert model["error_p50"] is not None and model["error_p90"] >= model["error_p50"]
    # a decode step of this engine lasts milliseconds, not seconds
    assert 1e-4 < model["base_s"] + 4 * model["per_seq_s"] < 0.2
    text = vllm_client.get("/metrics").text
    assert metric_value(text, "justitia_time_model_coefficient", {"engine": "local", "term": "base_s"}) \
        == pytest.approx(model["base_s"], rel=0.5)
    assert metric_value(text, "justitia_time_model_samples", {"engine": "local"}) >= model["samples"]


@pytest.mark.engine
def test_calibrate_turnaround_records_the_clients_turnaround_beside_the_engine_alone(tmp_path, capsys) -> None:
    """`--turnaround`: one agent of short chained stages through `justitia serve`; the gap the
    server measured between them is the profile's, and the step model is the engine alone's."""
    out = tmp_path / "prof.json"
    assert main(["bench", "calibrate", "--kv-tokens", "2048", "--max-model-len", "1024",
                 "--out", str(out), "--quick", "--turnaround"]) == 0
    assert "turnaround between an agent's stages" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert "served" not in doc
    measured = doc["turnaround"]["stage_turnaround_s"]
    assert 0 < measured < 0.05  # HTTP on localhost and the replay's own work: milliseconds, never nothing
    assert doc["profile"]["stage_turnaround_s"] == measured
    for term in ("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s"):
        assert doc["profile"][term] == pytest.approx(doc["fit"][term])  # not scaled
    assert load_profile(str(out)).stage_turnaround_s == measured


@pytest.mark.engine
def test_calibrate_quick_writes_a_profile_that_bench_sim_takes(tmp_path, capsys) -> None:
    """`--served` too: the points of several requests run again through `justitia serve`, and
    the profile is the engine-alone fit scaled by their median slowdown."""
    out = tmp_path / "prof.json"
    cores = os.sched_getaffinity(0)
    assert main(["bench", "calibrate", "--kv-tokens", "2048", "--max-model-len", "1024",
                 "--out", str(out), "--quick", "--served"]) == 0
    # the in-process engine kept this process off its worker's cores while it ran, and gave
    # them back when it closed (the servers later tests start inherit this process's cores)
    assert os.sched_getaffinity(0) == cores
    printed = capsys.readouterr().out
    assert "fit err" in printed and "sim err" in printed
    doc = json.loads(out.read_text())
    assert doc["settings"]["kv_tokens"] == 2048 and doc["settings"]["max_model_len"] == 1024
    # the engine the server runs, in the dtype the server runs it in (not vLLM's bfloat16 for
    # a float32 model on a CPU, which the calibration once measured instead)
    assert doc["settings"]["dtype"] == "float32"
    points = doc["fit"]["points"]
    assert len(points) == 4
    for p in points:
        assert p["steps"] >= p["output"]  # every step of the point was recorded
        assert p["seconds"] > 0 and abs(p["fit_error"]) < 3
    served = doc["served"]
    assert [(r["batch"], r["prompt"]) for r in served["points"]] == \
        [(p["batch"], p["prompt"]) for p in points if p["batch"] >= 2]
    for r in served["points"]:
        assert r["served_s"] > 0 and r["slowdown"] == pytest.approx(r["served_s"] / r["engine_s"])
    alone = served["engine_alone"]
    assert alone["base_s"] == pytest.approx(doc["fit"]["base_s"])  # the engine-alone fit, kept
    for term in ("base_s", "per_seq_s", "per_prefill_token_s", "per_kv_token_s"):
        assert doc["profile"][term] == pytest.approx(alone[term] * served["slowdown"])
    # the chained agent's stages reached the server apart by the client's turnaround (HTTP on
    # localhost and the replay's own work: milliseconds, never nothing), and it is the profile's
    assert 0 < served["stage_turnaround_s"] < 0.05
    assert doc["profile"]["stage_turnaround_s"] == served["stage_turnaround_s"]
    assert alone["stage_turnaround_s"] == 0.0
    assert "turnaround" in printed
    prof = load_profile(str(out))
    assert prof.kv_tokens == 2048 and prof.max_model_len == 1024
    # the engine's token budget per step, as vLLM set it; no prompt of a 1,024-token context
    # passes it, so the chunked-prefill term is recorded unfitted
    assert doc["settings"]["max_num_batched_tokens"] >= 1024
    assert prof.prefill_chunk_tokens == doc["settings"]["max_num_batched_tokens"]
    assert prof.per_chunked_prefill_s == 0.0
    assert prof.base_s + prof.per_seq_s > 0 and prof.per_prefill_token_s >= 0
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "arrival": 0, "stages": [[{"p": 300, "d": 20}]]}) + "\n")
    res = tmp_path / "r.json"
    assert main(["bench", "sim", "--workload", str(wl), "--policies", "justitia", "--profile", str(out),
                 "--json", str(res), "--quiet"]) == 0
    agent = json.loads(res.read_text())["results"][0]["agents"][0]
    # one request of 300 + 20 tokens: about 20 steps of the fitted engine
    assert agent["jct_s"] == pytest.approx(prof.iteration_s(1, 300, 300) + 19 * prof.iteration_s(1, 0, 310), rel=0.2)


@pytest.mark.engine
def test_the_step_samples_count_a_shared_head_once_per_request_reading_it() -> None:
    """Eight requests over one cached 512-token head: the engine holds the head once, but
    each step's attention reads it eight times, and the time model's KV term is what the
    steps read (benchmarks/attended_context.py). The samples then attend over more tokens
    than the whole cache holds, and nothing is left counted once the requests are done."""
    import asyncio

    from server.engine.base import EngineRequest, SamplingOptions
    from server.engine.tiny_model import embedded_engine_config
    from server.engine.vllm_local import LocalVLLMEngine
    from server.scheduler.time_model import StepSample

    async def run() -> tuple[list[StepSample], int, int]:
        engine = LocalVLLMEngine(embedded_engine_config(kv_tokens=2048, max_model_len=1024, restarts=0))
        await engine.start()
        samples: list[StepSample] = []
        engine.add_sample_listener(lambda _name, s: samples.append(s))
        head = tuple(100 + i % 600 for i in range(512))

        async def one(rid: str, tail: tuple[int, ...], max_tokens: int) -> None:
            req = EngineRequest(rid, head + tail, SamplingOptions(max_tokens=max_tokens, ignore_eos=True,
                                                                  temperature=0.0))
            async for _ in engine.generate(req):
                pass

        try:
            await one("warm", (7,), 1)  # the head in the prefix cache
            samples.clear()
            await asyncio.gather(*(one(f"r{i}", (10 + i,) * 8, 32) for i in range(8)))
            await asyncio.sleep(0.1)
            return samples, engine.info.kv_capacity_tokens, engine._stats.attended_tokens
        finally:
            await engine.close()

    samples, capacity, left = asyncio.run(run())
    assert samples
    assert capacity <= 2048 < max(s.kv_tokens for s in samples) <= 8 * (512 + 8 + 32)
    assert left == 0
