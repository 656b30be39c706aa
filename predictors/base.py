"""What every cost predictor offers: the `Predictor` protocol.

A predictor belongs to one agent type and answers for one agent at a time: its total KV
token-time cost (`predict`), the costs it stays under with probability 0.5 and 0.9
(`predict_interval`), whether it is the cold start's guess (`is_cold_start`: the server then
tells the ETA what shape the guess stands for) and what it is (`metadata`: its kind, its
samples). The trained model (`CostPredictor`), the cold start's per-type view
(`ColdStartPredictor`) and the evaluation baselines all implement the whole protocol, so a
caller never probes for a method: a predictor without an interval of its own returns its
point estimate twice (`PointPredictor`).

This module imports nothing heavy: the server types against it without loading
scikit-learn.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

#: The numbers an agent declares (`features`, `fan_out`, `stages`, ...), by name.
Features = Mapping[str, Any]


@runtime_checkable
class Predictor(Protocol):
    """One agent type's cost predictor (costs in KV token-time units)."""

    @property
    def agent_type(self) -> str:
        """The agent type it predicts ("*" for one trained on every type)."""
        ...

    @property
    def is_cold_start(self) -> bool:
        """True for the cold start's estimate of a type with no trained model."""
        ...

    @property
    def metadata(self) -> Mapping[str, Any]:
        """What it is: `kind` (mlp, ridge, median, cold_start), sample counts, and
        `interval` where its p50/p90 come from out-of-fold residuals."""
        ...

    def predict(self, prompt: str, features: Features | None = None) -> float:
        """The predicted total cost of one agent with this prompt and declared numbers."""
        ...

    def predict_interval(self, prompt: str, features: Features | None = None) -> tuple[float, float]:
        """`(p50, p90)` of the agent's total cost."""
        ...


class PointPredictor(ABC):
    """A predictor with a point estimate only: its interval is that point twice, it is
    never the cold start, its metadata names nothing (subclasses implement `predict`)."""

    agent_type: str = ""
    is_cold_start: bool = False

    @property
    def metadata(self) -> Mapping[str, Any]:
        return {}

    @abstractmethod
    def predict(self, prompt: str, features: Features | None = None) -> float: ...

    def predict_interval(self, prompt: str, features: Features | None = None) -> tuple[float, float]:
        point = self.predict(prompt, features)
        return point, point
