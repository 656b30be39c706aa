"""Training samples: one finished agent each, as JSON Lines.

::

    {"agent_type": "mapreduce_summary", "prompt": "text the predictor sees",
     "cost": 1234567.0, "features": {"n_items": 6}}

``cost`` is the agent's total KV token-time cost, the sum over its requests of
``p*d + d*(d+1)/2`` (docs/concepts.md, "Cost model"); it must be a positive number. ``features`` is
optional: numeric values known when the agent is submitted (non-numeric values are ignored).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class SampleError(ValueError):
    """Samples that cannot be used; the message says which line and what to fix."""


class Sample(BaseModel):
    """One profiled agent run."""

    model_config = ConfigDict(extra="ignore")

    agent_type: str = Field(min_length=1)
    prompt: str
    cost: float
    features: dict[str, Any] = Field(default_factory=dict)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("prompt is empty")
        return v

    @field_validator("cost", mode="before")
    @classmethod
    def _cost_numeric(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"cost must be a number, got {v!r}")
        return v

    @field_validator("cost")
    @classmethod
    def _cost_positive(cls, v: float) -> float:
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"cost must be a positive finite number, got {v!r}")
        return v

    @field_validator("features", mode="before")
    @classmethod
    def _features_dict(cls, v: Any) -> Any:
        return {} if v is None else v

    def record(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "features": self.features}


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "sample"
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "missing"
    return f"{where}: {msg}"


def parse_samples(rows: Iterable[Any], source: str = "samples") -> list[Sample]:
    """Validate already-decoded sample objects (``source`` names them in errors)."""
    return [_sample(row, f"{source}: sample {i}", "sample") for i, row in enumerate(rows, start=1)]


def _sample(obj: Any, where: str, what: str) -> Sample:
    """One decoded sample, validated; SampleError naming `where` (and the `what` to fix) else."""
    if not isinstance(obj, dict):
        raise SampleError(f"{where}: not a JSON object")
    try:
        return Sample.model_validate(obj)
    except ValidationError as exc:
        raise SampleError(f"{where}: {_describe(exc)}; fix or drop that {what}") from None


def read_samples(path: str | Path) -> list[Sample]:
    """Read and validate a JSON Lines samples file (``.gz`` allowed; blank lines are skipped)."""
    p = Path(path)
    try:
        if p.suffix == ".gz":
            with gzip.open(p, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SampleError(f"samples file {p} does not exist; give the path of a JSON Lines file") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise SampleError(f"cannot read samples file {p} ({exc.__class__.__name__}); "
                          "check the path and that it is UTF-8 JSON Lines") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise SampleError(f"{p}:{lineno}: not valid JSON; each line must be one JSON object") from None
        rows.append(_sample(obj, f"{p}:{lineno}", "line"))
    if not rows:
        raise SampleError(f"samples file {p} has no samples")
    return rows


def select(samples: Sequence[Sample], agent_type: str, source: str = "samples") -> list[Sample]:
    """The samples of one agent type, or an error listing the types present."""
    chosen = [s for s in samples if s.agent_type == agent_type]
    if not chosen:
        types = sorted({s.agent_type for s in samples})
        raise SampleError(
            f"no samples of agent type {agent_type!r} in {source}; types present: {', '.join(types) or 'none'}"
        )
    return chosen


def write_samples(samples: Iterable[Sample | dict], path: str | Path) -> int:
    """Write samples as JSON Lines; returns how many."""
    n = 0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for s in samples:
            obj = s.model_dump() if isinstance(s, Sample) else s
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            n += 1
    return n


def request_cost(p: int | float, d: int | float) -> float:
    """KV token-time cost of one request: ``p*d + d*(d+1)/2``."""
    return float(p) * float(d) + float(d) * (float(d) + 1.0) / 2.0


def agent_cost(stages: Iterable[Iterable[dict]]) -> float:
    """Total cost of an agent given its stages of ``{"p", "d"}`` requests (the workload format, docs/benchmarks.md)."""
    return sum(request_cost(r["p"], r["d"]) for stage in stages for r in stage)
