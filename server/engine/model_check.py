"""What `justitia serve --model` is given, checked before the engine starts.

The engine runs offline (nothing is downloaded from a model hub), so `--model` must name a
local folder holding the model's `config.json`, or the id of a model already in the local
Hugging Face cache. Anything else would end, after the engine had begun to start, in a
long traceback from the hub library (`HFValidationError: Repo id must be in the form ...`);
this check answers with one sentence instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: What a hub id looks like: `name` or `owner/name` (letters, digits, `-_.`), nothing else.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.\-]*/)?[A-Za-z0-9][A-Za-z0-9_.\-]*$")

_HINT = ("expected a local folder with config.json; create one with "
         "`justitia model init-tiny DIR`")


class ModelNotFound(ValueError):
    """`--model` names nothing the engine can load; the message is one line for the user."""


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or not _HUB_ID.match(value)


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - vLLM depends on it
        return False
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the hub library refuses is not in its cache
        return False
    return isinstance(found, str)


def check_model(value: str) -> None:
    """Raise ModelNotFound unless `value` is a model folder with a config.json, or a hub id
    already in the local Hugging Face cache."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"--model {value} is a file, not a model folder ({_HINT})")
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"--model {value} has no config.json: not a model folder ({_HINT})")
        if not os.access(path / "config.json", os.R_OK):
            raise ModelNotFound(f"--model {value}: config.json cannot be read (permission denied)")
        return
    if _looks_like_path(value):
        raise ModelNotFound(f"no such model folder: {value} ({_HINT})")
    if not _in_hub_cache(value):
        raise ModelNotFound(
            f"no such model folder: {value}, and no model of that id in the local Hugging Face "
            f"cache (the server downloads nothing; {_HINT}, or give the folder of a "
            "downloaded model)")
