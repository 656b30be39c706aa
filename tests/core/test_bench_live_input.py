"""`justitia bench live`'s checks of its input, before any server starts (the runs
themselves are in tests/engine/test_bench_live.py)."""

from __future__ import annotations

import json

from justitia_cli import main


def test_bench_live_refuses_bad_input(tmp_path, capsys) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "arrival": 0,
                                    "stages": [[{"p": 3000, "d": 100}]]}) + "\n")
    rc = main(["bench", "live", "--workload", str(workload), "--kv-tokens", "4096"])
    assert rc == 2
    assert "--max-model-len" in capsys.readouterr().err
    rc = main(["bench", "live", "--workload", str(tmp_path / "none.jsonl"), "--kv-tokens", "4096"])
    assert rc == 2
    assert "make-workload" in capsys.readouterr().err
    rc = main(["bench", "live", "--workload", str(workload), "--kv-tokens", "4096",
               "--policies", "lottery"])
    assert rc == 2
    assert "unknown policy" in capsys.readouterr().err


def test_bench_live_refuses_a_teaching_workload_that_does_not_fit(tmp_path, capsys) -> None:
    workload, teach = tmp_path / "w.jsonl", tmp_path / "t.jsonl"
    workload.write_text(json.dumps({"id": "a", "arrival": 0, "stages": [[{"p": 30, "d": 10}]]}) + "\n")
    teach.write_text(json.dumps({"id": "t", "arrival": 0, "stages": [[{"p": 3000, "d": 100}]]}) + "\n")
    assert main(["bench", "live", "--workload", str(workload), "--teach", str(teach), "--kv-tokens", "4096"]) == 2
    assert "--max-model-len" in capsys.readouterr().err
    assert main(["bench", "live", "--workload", str(workload), "--teach", str(tmp_path / "no.jsonl"),
                 "--kv-tokens", "4096"]) == 2
    assert "no workload file" in capsys.readouterr().err
    assert main(["bench", "live", "--workload", str(workload), "--restart", "--kv-tokens", "4096"]) == 2
    assert "give --teach FILE too" in capsys.readouterr().err
