"""Every JSON a `bench` command or a benchmark script writes carries its provenance
(DESIGN.md section 8: commit, argv, date, host {cpus, cpu_model}, versions {justitia, vllm,
python})."""

import datetime as dt
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

from justitia_cli import main
from server.shared.profiles import get_profile
from server.sim.mix import make_mix
from server.sim.workload import save_workload

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("wl") / "w.jsonl"
    save_workload(make_mix(20, get_profile("a100-llama7b"), seed=1, density=2), path)
    return path


def assert_provenance(doc: dict, argv_tail: list[str]) -> None:
    prov = doc["provenance"]
    assert set(prov) >= {"commit", "argv", "date", "host", "versions"}
    assert prov["argv"][-len(argv_tail):] == argv_tail
    assert dt.datetime.fromisoformat(prov["date"]).tzinfo is not None
    assert prov["host"]["cpus"] == os.cpu_count()
    assert "cpu_model" in prov["host"]
    assert set(prov["versions"]) >= {"justitia", "vllm", "python"}
    assert prov["versions"]["python"] == platform.python_version()
    assert prov["versions"]["justitia"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the commit is HEAD's, marked when the code differs
        assert re.fullmatch(re.escape(head.stdout.strip()) + r"(-dirty)?", prov["commit"])


def test_bench_sim_json_carries_provenance(workload, tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    argv = ["bench", "sim", "--workload", str(workload), "--policies", "vtc,justitia",
            "--kv-tokens", "20000", "--json", str(out), "--quiet"]
    monkeypatch.setattr("sys.argv", ["justitia", *argv])
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert_provenance(doc, argv)
    assert [r["policy"] for r in doc["results"]] == ["vtc", "justitia"]  # the contract is kept


def test_bench_starvation_json_carries_provenance(tmp_path, monkeypatch):
    out = tmp_path / "s.json"
    argv = ["bench", "starvation", "--minutes", "1", "--policies", "justitia", "--json", str(out)]
    monkeypatch.setattr("sys.argv", ["justitia", *argv])
    assert main(argv) == 0
    assert_provenance(json.loads(out.read_text()), argv)


def test_every_benchmark_script_writes_json_through_the_provenance_helper():
    """A script that writes its result with json.dumps / json.dump straight to a file skips the
    provenance; every one must go through server.sim.provenance.write_result."""
    offenders = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        text = script.read_text()
        if re.search(r"write_text\(\s*json\.dumps", text) or re.search(r"json\.dump\(", text):
            offenders.append(script.name)
    assert offenders == []
