"""`justitia train-predictor` and `justitia predictor eval`: contract, sources, bad input."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from justitia_cli import main
from predictors.samples import read_samples, write_samples
from predictors.synthetic import synthesize


@pytest.fixture(scope="module")
def samples_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("samples") / "samples.jsonl"
    write_samples(synthesize("fact_verification", 50, seed=1) + synthesize("doc_merge", 25, seed=1), path)
    return path


@pytest.fixture(scope="module")
def model_dir(samples_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "fv"
    assert main(["train-predictor", "fact_verification", "--samples", str(samples_file), "--out", str(out),
                 "--quiet"]) == 0
    return out


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("justitia: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_train_writes_model_and_report(samples_file, tmp_path, capsys):
    out, report = tmp_path / "m", tmp_path / "report.json"
    rc = main(["train-predictor", "fact_verification", "--samples", str(samples_file), "--out", str(out),
               "--json", str(report)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("fact_verification", "(this model)", "cross-validation", "training mean", "training median",
                 "global", "length-only linear", "cold start", "coverage"):
        assert word in text
    assert (out / "model.joblib").is_file() and (out / "metadata.json").is_file()
    rep = json.loads(report.read_text())
    assert rep["samples"] == 50 and rep["validation"] == 10
    assert rep["model"]["mean_relative_error"] < rep["baselines"]["mean"]["mean_relative_error"]
    assert rep["kind"] in ("median", "ridge", "mlp") and rep["model_selection"]["chosen"] == rep["model_name"]
    assert 0.0 <= rep["model"]["p90_coverage"] <= 1.0


def test_eval_contract(model_dir, samples_file, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["predictor", "eval", str(model_dir), "--samples", str(samples_file), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("n", "mean_relative_error", "median_relative_error", "p50_latency_ms", "p99_latency_ms"):
        assert isinstance(res[key], (int, float)), key
    assert res["n"] == 50  # only the predictor's agent type
    assert 0 < res["p50_latency_ms"] <= res["p99_latency_ms"]
    # the model cross-validation chose, and how often real costs stayed under p50 and p90
    meta = json.loads((model_dir / "metadata.json").read_text())
    assert res["kind"] == meta["kind"] and res["model"] == meta["model"]
    assert 0.0 <= res["p50_coverage"] <= res["p90_coverage"] <= 1.0


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"agent_type": "t", "prompt": "a prompt", "cost": 10.0, "features": {}}


@pytest.mark.parametrize(
    "rows, match",
    [
        ([dict(GOOD, prompt="")], "prompt is empty"),
        ([{k: v for k, v in GOOD.items() if k != "prompt"}], "prompt: missing"),
        ([dict(GOOD, cost=-1)], "cost must be a positive"),
        ([dict(GOOD, cost="lots")], "cost must be a number"),
        (["{broken json"], "not valid JSON"),
        ([GOOD] * 5, "only 5 samples"),
        ([dict(GOOD, agent_type="other")] * 30, "no samples of agent type 't'"),
    ],
)
def test_bad_samples_are_one_line_errors(tmp_path, capsys, rows, match):
    f = _write(tmp_path / "s.jsonl", rows)
    rc = main(["train-predictor", "t", "--samples", str(f), "--out", str(tmp_path / "m")])
    assert rc == 2
    assert match in _error(capsys)


def test_missing_samples_file(tmp_path, capsys):
    rc = main(["train-predictor", "t", "--samples", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "m")])
    assert rc == 2 and "does not exist" in _error(capsys)


def test_eval_unreadable_model(tmp_path, samples_file, capsys):
    (tmp_path / "metadata.json").write_text("garbage")
    rc = main(["predictor", "eval", str(tmp_path), "--samples", str(samples_file), "--json", str(tmp_path / "o.json")])
    assert rc == 2 and "corrupt" in _error(capsys)
    rc = main(["predictor", "eval", str(tmp_path / "none"), "--samples", str(samples_file)])
    assert rc == 2 and "not a directory" in _error(capsys)


def test_eval_wrong_agent_type(model_dir, tmp_path, capsys):
    f = _write(tmp_path / "s.jsonl", [dict(GOOD, agent_type="other")])
    rc = main(["predictor", "eval", str(model_dir), "--samples", str(f)])
    assert rc == 2 and "no samples of agent type 'fact_verification'" in _error(capsys)


AGENT_FILE = """
from justitia_sdk import agent, llm

@agent("probe_agent")
async def probe_agent(text: str) -> str:
    return await llm(text, max_tokens=4)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_inputs_resolves_the_agent_by_name(tmp_path, capsys):
    agent_file = tmp_path / "probe_agents.py"
    agent_file.write_text(AGENT_FILE)
    inputs = _write(tmp_path / "in.jsonl", [{"text": "hello"}])
    rc = main(["train-predictor", "no_such_agent", "--file", str(agent_file), "--inputs", str(inputs),
               "--out", str(tmp_path / "m")])
    assert rc == 2
    err = _error(capsys)
    assert "no agent named 'no_such_agent'" in err and "probe_agent" in err
    rc = main(["train-predictor", "probe_agent", "--file", str(agent_file), "--inputs", str(inputs),
               "--server", f"http://127.0.0.1:{_free_port()}", "--out", str(tmp_path / "m")])
    assert rc == 2 and "cannot reach server" in _error(capsys)
    rc = main(["train-predictor", "probe_agent", "--file", str(tmp_path / "missing.py"), "--inputs", str(inputs),
               "--out", str(tmp_path / "m")])
    assert rc == 2 and "no such file" in _error(capsys)


def test_unresolvable_module(tmp_path, samples_file, capsys):
    rc = main(["train-predictor", "fact_verification", "--module", "no_such_pkg.agents",
               "--samples", str(samples_file), "--out", str(tmp_path / "m")])
    assert rc == 2 and "no_such_pkg.agents" in _error(capsys)


class _History(BaseHTTPRequestHandler):
    rows: list = []

    def do_GET(self):  # noqa: N802
        url = urlparse(self.path)
        if url.path != "/v1/history":
            self.send_response(404)
            self.end_headers()
            return
        # As the real server: filtered by agent_type when given, every type otherwise.
        t = parse_qs(url.query).get("agent_type", [None])[0]
        body = json.dumps({"samples": [r for r in self.rows if t is None or r["agent_type"] == t]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def history_url():
    server = HTTPServer(("127.0.0.1", 0), _History)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_from_server(tmp_path, capsys, history_url):
    _History.rows = [s.model_dump() for s in synthesize("code_checking", 30, seed=2)]
    out = tmp_path / "m"
    assert main(["train-predictor", "code_checking", "--from-server", history_url, "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "metadata.json").read_text())["sample_count"] == 30
    capsys.readouterr()
    rc = main(["train-predictor", "unknown", "--from-server", history_url, "--out", str(out)])
    assert rc == 2 and "no samples of agent type 'unknown'" in _error(capsys)


def test_from_server_typo_names_the_types_present(tmp_path, capsys, history_url):
    """The history endpoint answers only the type asked for; the error names the types the
    server holds (not 'types present: none')."""
    _History.rows = [s.model_dump() for t in ("code_checking", "doc_merge", "self_consistency")
                     for s in synthesize(t, 3, seed=2)]
    rc = main(["train-predictor", "code_cheking", "--from-server", history_url, "--out", str(tmp_path / "m")])
    err = _error(capsys)
    assert rc == 2 and "no samples of agent type 'code_cheking'" in err
    assert "types present: code_checking, doc_merge, self_consistency" in err
    _History.rows = []
    rc = main(["train-predictor", "code_checking", "--from-server", history_url, "--out", str(tmp_path / "m")])
    assert rc == 2 and "no finished agent yet" in _error(capsys)


def test_fetched_samples_are_kept_even_when_training_fails(tmp_path, capsys, history_url):
    _History.rows = [s.model_dump() for s in synthesize("code_checking", 30, seed=2)]
    out = tmp_path / "m"
    assert main(["train-predictor", "code_checking", "--from-server", history_url, "--out", str(out), "--quiet"]) == 0
    kept = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert kept == _History.rows
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["samples_file"] == str(out / "samples.jsonl")
    # Too few to train: the fetched samples are still written, where --save-samples says.
    _History.rows = _History.rows[:5]
    elsewhere = tmp_path / "keep" / "five.jsonl.gz"
    rc = main(["train-predictor", "code_checking", "--from-server", history_url, "--out", str(tmp_path / "m2"),
               "--save-samples", str(elsewhere)])
    err = _error(capsys)
    assert rc == 2 and "only 5 samples" in err and str(elsewhere) in err
    assert len(read_samples(elsewhere)) == 5 and not (tmp_path / "m2" / "samples.jsonl").exists()


def test_samples_file_is_not_copied_unless_asked(samples_file, model_dir, tmp_path):
    assert not (model_dir / "samples.jsonl").exists()
    copy = tmp_path / "copy.jsonl"
    assert main(["train-predictor", "fact_verification", "--samples", str(samples_file), "--out", str(tmp_path / "m"),
                 "--save-samples", str(copy), "--quiet"]) == 0
    assert copy.read_text() == samples_file.read_text()


def test_eval_defaults_to_the_held_out_samples(model_dir, samples_file, tmp_path, capsys):
    meta = json.loads((model_dir / "metadata.json").read_text())
    held = read_samples(model_dir / "heldout.jsonl")
    assert meta["heldout_file"] == "heldout.jsonl" and len(held) == meta["validation_count"] == 10
    # The held-out runs are samples of the file that training never saw.
    all_rows = {(s.prompt, s.cost) for s in read_samples(samples_file)}
    assert {(s.prompt, s.cost) for s in held} <= all_rows
    out = tmp_path / "eval.json"
    assert main(["predictor", "eval", str(model_dir), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["n"] == 10 and res["samples_file"] == str(model_dir / "heldout.jsonl")
    # The same predictor on the same runs: the validation error training reported.
    assert res["mean_relative_error"] == pytest.approx(meta["validation"]["mean_relative_error"])
    assert "heldout.jsonl" in capsys.readouterr().out


def test_eval_without_samples_of_an_older_predictor(model_dir, tmp_path, capsys):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(model_dir, old)
    meta = json.loads((old / "metadata.json").read_text())
    del meta["heldout_file"]
    (old / "metadata.json").write_text(json.dumps(meta))
    rc = main(["predictor", "eval", str(old)])
    assert rc == 2 and "keeps no held-out samples" in _error(capsys)


def test_from_server_unreachable(tmp_path, capsys):
    port = _free_port()
    rc = main(["train-predictor", "x", "--from-server", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "m"),
               "--timeout", "2"])
    assert rc == 2 and "cannot reach server" in _error(capsys)


def test_help_is_light():
    import subprocess
    import sys

    code = ("import sys, argparse, predictors, predictors.cli as c; "
            "print('sklearn' in sys.modules or 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_calibrate(samples_file, tmp_path):
    out = tmp_path / "m"
    assert main(["train-predictor", "fact_verification", "--samples", str(samples_file), "--out", str(out),
                 "--no-calibrate", "--quiet"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["calibration"]["factor"] == 1.0


def test_serve_refuses_a_missing_predictors_dir(tmp_path):
    """A typo in --predictors is refused, not served as the cold start without a word."""
    import subprocess
    import sys
    import time

    for path, says in ((tmp_path / "nonexistent", "no such directory"),
                       (tmp_path, "holds no usable predictor")):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "justitia_cli", "serve", "--predictors", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        err = done.stderr.strip()
        assert err.startswith("justitia: error: --predictors ") and str(path) in err and says in err, err
        assert "Traceback" not in err and "tiny model" not in err  # refused before any engine
        assert time.monotonic() - t0 < 30


def test_serve_prints_the_predictors_it_found(model_dir, tmp_path, capsys):
    from server.cli.serve_checks import check_predictors

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metadata.json").write_text("garbage")
    (tmp_path / "fv").symlink_to(model_dir)
    check_predictors(str(tmp_path))
    err = capsys.readouterr().err
    chosen = json.loads((model_dir / "metadata.json").read_text())["model"]
    expected = f"cost predictor for 'fact_verification': {chosen}, 50 samples (40 train / 10 held out)"
    assert f"{expected}, {tmp_path / 'fv'}" in err
    assert f"skipping predictor {broken}" in err and "corrupt" in err
    check_predictors(str(model_dir))  # one predictor's own folder
    assert "'fact_verification'" in capsys.readouterr().err
