"""`justitia bench sim|live --html OUT.html`: a self-contained report (the live path is
covered in tests/engine/test_bench_live.py, on the real engine)."""

from __future__ import annotations

import json
import re

from justitia_cli import main
from server.shared.profiles import get_profile
from server.sim.html_report import gps_slowdown, kept, policy_rows, render
from server.sim.mix import make_mix
from server.sim.workload import save_workload


def assert_self_contained(text: str) -> None:
    """No script, no file or stylesheet or font from anywhere: the file is the whole report."""
    assert "<script" not in text.lower()
    assert not re.search(r"\b(src|href)\s*=", text, re.I)
    assert "@import" not in text and "url(" not in text
    assert not re.sub(r'xmlns="http://www\.w3\.org/2000/svg"', "", text).count("http")


def test_bench_sim_writes_a_self_contained_html_report(tmp_path) -> None:
    workload = tmp_path / "w.jsonl"
    save_workload(make_mix(30, get_profile("a100-llama7b"), seed=4, density=2), workload)
    out, data = tmp_path / "report.html", tmp_path / "report.json"
    rc = main(["bench", "sim", "--workload", str(workload), "--policies", "fcfs,vtc,justitia",
               "--html", str(out), "--json", str(data), "--quiet"])
    assert rc == 0
    text = out.read_text()
    assert_self_contained(text)
    # the policy table, two CDFs (JCT, slowdown vs GPS) and the promises chart
    assert text.count("<svg") == 3
    assert 'aria-label="JCT CDF per policy"' in text and 'aria-label="slowdown vs GPS CDF per policy"' in text
    doc = json.loads(data.read_text())
    for r in doc["results"]:
        assert f"<td>{r['policy']}</td>" in text
        assert f"<td>{r['mean_jct_s']:,.2f}</td>" in text
        # the promises kept agree with the JSON's count
        assert f"<td>{r['promises_kept']}/{len(r['agents'])}</td>" in text
        # one CDF line per policy in each chart
    assert text.count("<polyline") == 2 * len(doc["results"])


def test_slowdown_and_promises_are_computed_per_agent() -> None:
    fast = {"arrival_s": 10.0, "finish_s": 14.0, "jct_s": 4.0, "gps_finish_s": 18.0, "delay_bound_s": 1.0,
            "first_deadline_s": 5.0}
    late = {"arrival_s": 0.0, "finish_s": 30.0, "jct_s": 30.0, "gps_finish_s": 10.0, "delay_bound_s": 5.0,
            "first_deadline_s": 20.0}
    unknown = {**fast, "first_deadline_s": None}
    assert gps_slowdown(fast) == 0.5 and gps_slowdown(late) == 3.0
    assert kept(fast) is True and kept(late) is False and kept(unknown) is None
    result = {"policy": "justitia", "mean_jct_s": 17.0, "p50_jct_s": 17.0, "p90_jct_s": 27.4, "p99_jct_s": 29.7,
              "max_jct_s": 30.0, "makespan_s": 30.0, "agents": [fast, late, unknown], "sim_mean_jct_s": 15.5}
    [row] = policy_rows([result])
    assert row[0] == "justitia"
    assert row[10] == "1/2"  # promises: kept / agents with a recorded promise
    assert row[11] == "2/3"  # within GPS finish + delay bound
    assert row[9] == "3.00"  # worst slowdown
    text = render({"mode": "live"}, [result], [], "bench live: test")
    assert_self_contained(text)
    assert "simulator&#x27;s mean JCT" in text and "<td>15.50</td>" in text
