"""A server's history of finished agents as training samples (one definition for the server's
``GET /v1/history``, its online retraining and ``train-predictor --from-history FILE``).

A sample's ``features`` hold what the agent declared at submission (its metadata's
``features`` numbers, ``fan_out``, ``stages``: :func:`predictors.prompt_features.submission_features`)
and how its run went (``n_requests``, ``prompt_tokens``, ``output_tokens``: outcome features,
which models never learn from, :data:`predictors.prompt_features.OUTCOME_FEATURES`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .prompt_features import submission_features

#: Finished agents after row ``?``; callers append filters, ``ORDER BY`` and ``LIMIT``.
HISTORY_QUERY = ("SELECT type, prompt, cost, n_requests, prompt_tokens, output_tokens, id, rowid, metadata "
                 "FROM agents WHERE state = 'finished' AND n_requests > 0 AND rowid > ?")


def history_sample(row: Sequence[Any]) -> dict[str, Any]:
    """One row of :data:`HISTORY_QUERY` as a sample (the samples file format)."""
    agent_type, prompt, cost, n, p, d, agent_id, _, metadata = row
    try:
        meta = json.loads(metadata) if metadata else {}
    except (TypeError, ValueError):
        meta = {}
    features = submission_features(meta if isinstance(meta, dict) else {})
    features.update(n_requests=n, prompt_tokens=p, output_tokens=d)
    return {"agent_type": agent_type, "prompt": prompt, "cost": cost, "agent_id": agent_id, "features": features}
