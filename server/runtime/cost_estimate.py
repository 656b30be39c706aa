"""An agent's predicted cost when it registers: its predictor's, else a guess from its prompt.

The guess stands for one request of the prompt's size decoding `FALLBACK_OUTPUT_TOKENS`, as
uncertain as a cold start's guess (its promise allows for the same spread). Where the cost is
a guess, the shape it was guessed as goes with it, so that the ETA expects that one request.
An agent may also declare its structure in its metadata (server/runtime/declared.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.runtime.agents import CostSource
from server.scheduler import AgentShape, decode_for_kv_cost, kv_cost
from server.scheduler.reprediction import DEFAULT_P90_RATIO

if TYPE_CHECKING:
    from server.runtime.agent_listeners import Predictors

log = logging.getLogger("justitia.live")

# The output a request is guessed to decode when nothing predicts its agent's cost.
FALLBACK_OUTPUT_TOKENS = 256
# Characters per token of the prompt-size guess when no predictor (hence no tokenizer-backed
# estimate) is at hand: the usual English rule of thumb.
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class CostEstimate:
    """A registration's predicted cost, where it came from, its (p50, p90) interval when the
    predictor gives one (re-prediction starts from it), and the shape it was guessed as
    where it is a guess (a cold start or the fallback)."""

    cost: float
    source: CostSource
    interval: tuple[float, float] | None
    guessed: AgentShape | None


def estimate_cost(predictors: Predictors | None, agent_type: str, prompt: str, tenant: str,
                  metadata: dict[str, Any]) -> CostEstimate:
    """The agent type's predictor, if one is served and does not fail; else the fallback."""
    if predictors is not None:
        from predictors.prompt_features import estimate_tokens, submission_features

        # What the agent declared: its `features` numbers, fan-out and stage shape.
        features = submission_features(metadata)
        try:
            predictor = predictors.get(agent_type, tenant)
            bounds = predictor.predict_interval(prompt, features)
            cost = float(predictor.predict(prompt, features))
            if not predictor.is_cold_start:
                return CostEstimate(cost, "model", bounds, None)
            # the cold start's guess is one request of the prompt's estimated tokens
            return CostEstimate(cost, "cold_start", bounds, one_request(estimate_tokens(prompt), cost))
        except Exception:
            log.exception("predictor for %r failed; using the request-size fallback", agent_type)
    p = max(1, len(prompt) // CHARS_PER_TOKEN)
    cost = kv_cost(p, FALLBACK_OUTPUT_TOKENS)
    return CostEstimate(cost, "fallback", (cost, cost * DEFAULT_P90_RATIO),
                        AgentShape(stages=1, critical_path_tokens=FALLBACK_OUTPUT_TOKENS))


def one_request(prompt_tokens: int, cost: float) -> AgentShape:
    """The shape of one request of `prompt_tokens` whose KV cost is `cost` (the cold start
    reports its guess's cost, not the output length it assumed)."""
    return AgentShape(stages=1, critical_path_tokens=decode_for_kv_cost(prompt_tokens, cost))
