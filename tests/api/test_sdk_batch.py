"""Batch submission, the OpenAI-client path and the client commands, on the real server."""

from __future__ import annotations

import json

import pytest

from justitia_cli import main
from justitia_sdk import AsyncClient, Batch, Client, agent, current_agent_id, llm, openai_client, parallel_map

pytestmark = pytest.mark.anyio


class Refused(Exception):
    pass


@agent("batch_worker")
async def worker(text: str, fail: bool = False) -> str:
    parts = await parallel_map(lambda w: llm(f"say the word {w}", max_tokens=3), text.split())
    if fail:
        raise Refused(text)
    return " | ".join(p.strip() for p in parts) + f" <{len(parts)}>"


async def test_submit_many_keeps_input_order_and_survives_a_failure(server) -> None:
    inputs = [{"text": "a b c"}, {"text": "d", "fail": True}, ("e f",), "g h i j"]
    async with AsyncClient(server.url) as client:
        batch = await client.submit_many(worker, inputs, concurrency=2)
    assert isinstance(batch, Batch) and len(batch) == 4 and batch.done
    assert [h.status for h in batch] == ["finished", "failed", "finished", "finished"], batch.errors
    results = batch.results(return_exceptions=True)
    assert results[0].endswith("<3>") and results[2].endswith("<2>") and results[3].endswith("<4>")
    assert isinstance(results[1], Refused)
    with pytest.raises(Refused):
        batch.results()
    assert batch.errors[0][0] == 1
    for h in batch:
        assert h.record is not None
        assert h.record.state == ("failed" if h.index == 1 else "finished")
        assert h.first_eta_s is not None and h.fair_finish_s is not None
        assert h.delay_bound_s is not None and h.deadline_s is not None
        assert (h.jct_s is None) == (h.index == 1)
        assert h.run is not None and h.run.requests == h.record.requests_total
    # The server knows why the failed run failed.
    assert batch[1].record.error == "Refused: d"
    assert "finished" in batch.summary()
    html = batch._repr_html_()
    assert "batch_worker" in html and "kept" in html


async def test_mixed_batch_with_live_view(server, capsys) -> None:
    @agent("other_worker")
    async def other(text: str) -> str:
        return await llm(f"repeat {text} twice", max_tokens=2)

    async with AsyncClient(server.url) as client:
        batch = await client.submit_many([worker, other], ["x y", "z"], progress=True,
                                         title="mixed")
    assert [h.agent.name for h in batch] == ["batch_worker", "other_worker"]
    assert all(h.ok for h in batch)
    out = capsys.readouterr().out
    assert "mixed" in out and "other_worker" in out and "1st ETA" in out


async def test_openai_client_requests_carry_the_agent_tag(server) -> None:
    oa = openai_client(base_url=server.url)
    model = (await oa.models.list()).data[0].id

    @agent("openai_style")
    async def answer(question: str) -> str | None:
        r = await oa.completions.create(model=model, prompt=question, max_tokens=3)
        c = await oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=3)
        assert r.choices[0].text is not None and c.choices[0].message is not None
        return current_agent_id()

    async with AsyncClient(server.url) as client:
        agent_id = await client.run(answer, "what is fair?")
        record = await client.get_agent(agent_id)
    await oa.close()
    assert record.type == "openai_style" and record.requests_total == 2


def test_status_command_lists_agents(server, capsys) -> None:
    # An agent of its own: run alone (-k status), the server would have none to list.
    with Client(server.url) as client:
        client.run(worker, "status")
    assert main(["status", server.url, "--all"]) == 0
    out = capsys.readouterr().out
    assert "policy" in out and "agt-" in out and "fair" in out


def test_status_command_reports_an_unreachable_server(capsys) -> None:
    from server.launcher import free_port

    assert main(["status", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_demo_against_a_running_server(server, tmp_path, capsys) -> None:
    out = tmp_path / "demo.json"
    assert main(["demo", "--url", server.url, "--agents", "6", "--max-tokens", "8",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["agents"]
    assert len(rows) == 12  # two waves (the default) of six
    for wave in (1, 2):
        assert len({r["type"] for r in rows if r["wave"] == wave}) == 6
    for r in rows:
        assert r["state"] == "finished" and r["error"] is None
        for key in ("jct_s", "first_eta_s", "fair_finish_s", "delay_bound_s"):
            assert r[key] is not None and r[key] >= 0
    assert [w["wave"] for w in report["waves"]] == [1, 2]
    for w in report["waves"]:
        errors = sorted(r["eta_error"] for r in rows if r["wave"] == w["wave"])
        assert w["agents"] == 6 and w["eta_error_max"] == pytest.approx(errors[-1])
        assert w["kept"] == sum(1 for r in rows if r["wave"] == w["wave"] and r["kept"])
    printed = capsys.readouterr().out
    assert "JCT" in printed and "1st ETA" in printed and "bound" in printed
    assert "wave 2: 6 agents" in printed


def test_profile_agent_gives_training_samples_and_the_registry_finds_agents(server) -> None:
    from justitia_sdk import get_agent, profile_agent, registered_agents

    assert get_agent("batch_worker") is worker
    assert "batch_worker" in registered_agents()
    samples = profile_agent(worker, [{"text": "one two"}, {"text": "x", "fail": True},
                                     {"text": "three four five"}], server=server.url)
    assert [s["features"]["requests"] for s in samples] == [2, 3]  # the failed run is left out
    for s in samples:
        assert s["agent_type"] == "batch_worker" and s["cost"] > 0 and s["prompt"]
