"""What a predictor sees, without scikit-learn: the prompt's text features and the numeric
features an agent declares at submission.

A sample (or a request for a prediction) is a *record*: ``{"prompt": str, "features": dict}``.
Text features are derived from the prompt (estimated tokens, words, lines, numbers, names,
enumerated items: :data:`TEXT_FEATURES`); the caller's numeric features (for instance
``n_items`` or ``fan_out``, the number of items the agent fans out) come from the agent's
metadata (:func:`submission_features`). The model's transformers over these records are in
:mod:`predictors.features`; this module stays free of scikit-learn and NumPy so that the
server, which only counts tokens and reads metadata, starts without loading them.

Token counts are a deterministic approximation, no tokenizer download: every run of letters
or digits counts ``ceil(len / 4)`` tokens (a short word is one token, a long one several),
and every other non-space character counts one token. On English prose this lands within
about 10-20% of a Llama-2 BPE tokenizer's count, which is all a cost predictor needs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

# A run of letters/digits of length L matches ceil(L / 4) times; other non-space characters
# match once each.
_TOKEN = re.compile(r"[A-Za-z0-9]{1,4}|[^\sA-Za-z0-9]")

#: Features derived from the prompt text itself, always present. Beyond its length, what
#: decides how many steps a loop-shaped agent takes: how many numbers the task holds and the
#: largest small one ("list the 7 oldest ..."; numbers of 1000 and more are years and ids,
#: not counts), how many names it mentions (words capitalised inside a sentence) and how
#: many items it enumerates (commas, "and", list lines).
TEXT_FEATURES = ("prompt_tokens", "prompt_words", "prompt_lines", "prompt_numbers", "prompt_small_number",
                 "prompt_names", "prompt_list_items")
#: The text features of predictors trained before the loop features existed (their pickled
#: `NumericFeatures` has no `text_names_`).
LEGACY_TEXT_FEATURES = TEXT_FEATURES[:3]

_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
_NAME = re.compile(r"(?<=[a-z,;:] )[A-Z][a-z]+")
_LIST_LINE = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s", re.MULTILINE)


def estimate_tokens(text: str) -> int:
    """Deterministic token-count estimate of ``text`` (see the module docstring)."""
    return len(_TOKEN.findall(text))


def _small_number(numbers: list[str]) -> float:
    small = [float(n) for n in numbers if float(n) < 1000.0]
    return max(small, default=0.0)


def text_features(text: str) -> dict[str, float]:
    """The features derived from a prompt (see :data:`TEXT_FEATURES`)."""
    numbers = _NUMBER.findall(text)
    return {
        "prompt_tokens": float(estimate_tokens(text)),
        "prompt_words": float(len(text.split())),
        "prompt_lines": float(text.count("\n") + 1 if text else 0),
        "prompt_numbers": float(len(numbers)),
        "prompt_small_number": _small_number(numbers),
        "prompt_names": float(len(_NAME.findall(text))),
        "prompt_list_items": float(text.count(",") + text.count(" and ") + len(_LIST_LINE.findall(text))),
    }


#: Agent metadata fields (as the SDK sends them, docs/sdk.md) that are submission-time
#: features: the declared fan-out and stage shape.
METADATA_FEATURES = ("fan_out", "stages", "critical_path_tokens")


def submission_features(metadata: Mapping[str, Any] | None) -> dict[str, float]:
    """The numeric features an agent's metadata declares: its ``features`` object's numbers
    and :data:`METADATA_FEATURES` (booleans and non-finite values are left out)."""
    meta = metadata or {}
    out: dict[str, float] = {}
    declared = meta.get("features")
    items = list(declared.items()) if isinstance(declared, Mapping) else []
    items += [(k, meta.get(k)) for k in METADATA_FEATURES if k in meta]
    for k, v in items:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[str(k)] = float(v)
    return out


#: Features that describe how a run went, not what was submitted: profiling and the server's
#: history record them (the cold start uses some), but a model must not learn from them,
#: since they are unknown when an agent is submitted.
OUTCOME_FEATURES = frozenset({
    "requests", "n_requests", "prompt_tokens", "output_tokens", "completion_tokens",
    "total_tokens", "cost", "kv_cost", "consumed_cost", "jct_s", "duration_s", "elapsed_s",
})


def numeric_feature_names(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Sorted names of the submission-time numeric features present in ``records``.

    Booleans, non-numbers and :data:`OUTCOME_FEATURES` are left out.
    """
    names: set[str] = set()
    for r in records:
        for k, v in (r.get("features") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                names.add(str(k))
    return sorted(names - set(TEXT_FEATURES) - OUTCOME_FEATURES)


def as_record(prompt: str, features: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"prompt": prompt, "features": dict(features or {})}
