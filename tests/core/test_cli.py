"""The command line: help texts and the tiny model."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from justitia_cli import main

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "justitia_cli", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_top_level_help_lists_commands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("serve", "model", "bench"):
        assert cmd in out.stdout


@pytest.mark.slow
def test_serve_help_explains_every_option() -> None:
    out = run_cli("serve", "--help")
    assert out.returncode == 0
    for opt in ("--model", "--kv-tokens", "--max-model-len", "--policy", "--host", "--port",
                "--api-key", "--engine-restarts"):
        assert opt in out.stdout


def test_init_tiny_writes_a_loadable_model(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    assert main(["model", "init-tiny", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["head_dim"] == 32
    assert config["architectures"] == ["LlamaForCausalLM"]
    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    ids = tok.encode("Any text, even ünïcödé, tokenizes.").ids
    assert ids and max(ids) < config["vocab_size"]
    # English text at a realistic rate: several characters per token.
    text = "The scheduler serves agents in the order of their virtual finish time."
    assert 2.0 < len(text) / len(tok.encode(text).ids) < 8.0


def test_init_tiny_refuses_a_foreign_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["model", "init-tiny", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_serve_refuses_public_bind_without_keys(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_serve_refuses_a_profile_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--profile", str(tmp_path / "missing.json")]) == 2
    assert "--profile: unknown profile" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["serve", "--profile", str(tmp_path / "bad.json")]) == 2
    assert "not an engine profile" in capsys.readouterr().err


@pytest.mark.slow
def test_python_m_justitia_cli_reports_errors_in_one_line() -> None:
    # Run as `python -m`, a command's CommandError must still be the one main() catches.
    out = run_cli("serve", "--host", "0.0.0.0")
    assert out.returncode == 2
    assert out.stderr.startswith("justitia: error: refusing to bind 0.0.0.0")
    assert "Traceback" not in out.stderr


def test_the_console_script_is_the_cli_host() -> None:
    import tomllib

    import justitia_cli

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    module, _, function = project["project"]["scripts"]["justitia"].partition(":")
    assert getattr(importlib.import_module(module), function) is justitia_cli.main
    assert "justitia_cli*" in project["tool"]["setuptools"]["packages"]["find"]["include"]


@pytest.mark.slow
def test_every_command_offers_every_policy_of_the_scheduler() -> None:
    from justitia_cli import build_parser
    from server.scheduler import POLICY_NAMES

    parser = build_parser()
    for command in (["serve"], ["demo"]):
        for policy in POLICY_NAMES:
            assert parser.parse_args([*command, "--policy", policy]).policy == policy
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--policy", "round-robin"])
    sim = parser.parse_args(["bench", "sim", "--workload", "w.jsonl"])
    assert sim.policies.split(",") == list(POLICY_NAMES)
    for command in (("bench", "sim"), ("bench", "live")):
        text = " ".join(run_cli(*command, "--help").stdout.split())
        assert ", ".join(POLICY_NAMES) in text


def test_serve_tenant_weights_and_the_queued_quota_default() -> None:
    from justitia_cli import CommandError, build_parser
    from server.cli.serve_checks import parse_limits

    def limits(*argv: str) -> dict:
        args = build_parser().parse_args(["serve", *argv])
        return parse_limits(args, {"alice", "bob"})

    parsed = limits("--tenant-weight", "alice=3", "--tenant-weight", "bob=0.5")
    assert parsed["tenant_weights"] == {"alice": 3.0, "bob": 0.5}
    assert parsed["max_queued"] == 4096  # a safe default quota of queued requests per tenant
    assert limits("--max-queued", "off")["max_queued"] is None
    assert limits("--max-queued", "10")["max_queued"] == 10
    for bad in ("carol=2", "alice=0", "alice=x", "alice"):
        with pytest.raises(CommandError, match="--tenant-weight"):
            limits("--tenant-weight", bad)


@pytest.mark.slow
def test_serve_a_model_path_typo_is_one_line_and_starts_no_engine(tmp_path: Path) -> None:
    """A typo in --model ended, after the engine had begun to start, in a 45-line traceback
    from the hub library (`HFValidationError: Repo id must be in the form ...`)."""
    out = run_cli("serve", "--model", str(tmp_path / "no-such-model"), "--port", "9")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "no such model folder" in lines[0] and "no-such-model" in lines[0]
    assert "config.json" in lines[0] and "justitia model init-tiny" in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_serve_model_must_be_a_model_folder_or_a_cached_hub_id(tmp_path: Path) -> None:
    from server.engine.model_check import ModelNotFound, check_model

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="has no config.json"):
        check_model(str(tmp_path / "empty"))
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ModelNotFound, match="is a file"):
        check_model(str(tmp_path / "file.bin"))
    # a hub id: only a model already in the local cache serves (nothing is downloaded)
    out = subprocess.run([sys.executable, "-m", "justitia_cli", "serve", "--model",
                          "nobody/no-such-model-here", "--port", "9"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "HF_HOME": str(tmp_path / "hf")})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Hugging Face cache" in out.stderr and "downloads nothing" in out.stderr
    assert main(["model", "init-tiny", str(tmp_path / "m")]) == 0
    check_model(str(tmp_path / "m"))  # a model folder passes
