"""The example agents, as a contract suite (on the fake engine and on vLLM: `server`), and
checks of the examples that need no server. The notebook and the tool-calling example run
on vLLM only (tests/engine/test_examples.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from justitia_cli.demo import DEMO_AGENTS, load_example
from justitia_sdk import AsyncClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("name", DEMO_AGENTS)
async def test_example_agent_runs_on_its_first_input(server, name: str) -> None:
    agent, rows = load_example(EXAMPLES, name)
    assert agent.name == name and len(rows) >= 20  # enough to train a predictor on
    async with AsyncClient(server.url) as client:
        batch = await client.submit_many(agent, [dict(rows[0], max_tokens=8)], progress=False)
    handle = batch[0]
    assert handle.ok, handle.error
    assert handle.record is not None and handle.record.state == "finished"
    assert handle.record.type == name
    assert handle.run is not None and handle.run.requests >= 2  # a parallel stage, then more
    assert handle.record.requests_total == handle.run.requests


def test_inputs_files_are_json_lines_of_keyword_arguments() -> None:
    for name in DEMO_AGENTS:
        lines = (EXAMPLES / "inputs" / f"{name}.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        assert rows and all(isinstance(r, dict) and r for r in rows)


@pytest.mark.slow
def test_example_script_runs_with_one_command(server, tmp_path) -> None:
    samples = tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "equation_verification.py"), "--url", server.url,
         "--limit", "2", "--no-progress", "--samples", str(samples)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "#0 finished" in proc.stdout and "#1 finished" in proc.stdout
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:  # the shape `justitia train-predictor` reads
        assert row["agent_type"] == "equation_verification"
        assert row["prompt"].strip() and row["cost"] > 0


def test_local_checks_of_the_examples() -> None:
    equations, _ = load_example(EXAMPLES, "equation_verification")
    module = sys.modules[equations.fn.__module__]
    assert module.arithmetic_holds("3 * 2.50 = 7.50") is True
    assert module.arithmetic_holds("36 / 2 = 16") is False
    assert module.arithmetic_holds("4x = 20") is None
    assert module.arithmetic_holds("2 ** 1000 = 1") is None  # refused, not computed
    code, _ = load_example(EXAMPLES, "code_checking")
    functions_of = sys.modules[code.fn.__module__].functions_of
    ok, _, funcs = functions_of("def f(x):\n    return x\n\ndef g():\n    pass\n")
    assert ok and [n for n, _ in funcs] == ["f", "g"]
    assert functions_of("def broken(:\n")[0] is False
    votes, _ = load_example(EXAMPLES, "self_consistency")
    final_answer = sys.modules[votes.fn.__module__].final_answer
    assert final_answer("so 3 + 4 = 7.\nAnswer: 7") == "7"
    assert final_answer("it takes 165 minutes") == "165"


def test_each_demo_wave_runs_new_inputs_of_every_kind() -> None:
    from justitia_cli.demo import demo_jobs

    first, second = (demo_jobs(EXAMPLES, 12, 8, wave) for wave in (0, 1))
    assert [a.name for a, _ in first] == [a.name for a, _ in second] == list(DEMO_AGENTS) * 2
    seen = [json.dumps(kw, sort_keys=True) for _, kw in first + second]
    assert len(set(seen)) == 24  # no input twice: the second wave is not the first replayed


def test_the_notebook_starts_its_server_through_the_public_api() -> None:
    """The notebook imported `server.launcher.EmbeddedServer`, an internal module; the public
    name is `server.EmbeddedServer` (and `server.launcher` keeps working)."""
    import server
    import server.launcher

    assert server.EmbeddedServer is server.launcher.EmbeddedServer
    assert server.ServerStartError is server.launcher.ServerStartError
    assert "EmbeddedServer" in server.__all__
    code = "\n".join("".join(c["source"]) for c in json.loads(
        (EXAMPLES / "notebook.ipynb").read_text())["cells"] if c["cell_type"] == "code")
    assert "from server import EmbeddedServer" in code
    assert "server.launcher" not in code


@pytest.mark.slow
def test_the_react_tools_example_announces_its_tool_calls(server) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "react_tools.py"), "--url", server.url, "--agents", "2", "--turns", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    inside = [line for line in lines if " in search, " in line]
    assert len(inside) == 4, proc.stdout  # two agents, two tool calls each
    assert all(": paused in search, " in line and "expected left" in line for line in inside), proc.stdout
    assert sum(" finished in " in line for line in lines) == 2, proc.stdout
