"""The command line: help texts and the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from justitia_sdk.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "justitia_sdk.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_top_level_help_lists_commands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("serve", "model", "bench"):
        assert cmd in out.stdout


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
