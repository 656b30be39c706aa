"""Fact verification: judge a claim against each piece of evidence in parallel, then decide.

    .venv/bin/python examples/fact_verification.py [--url URL] [--limit N]
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from justitia_sdk import agent, llm, parallel_map

JUDGE_PROMPT = ("Claim: {claim}\nEvidence: {evidence}\n\nDoes the evidence support the claim, "
                "refute it, or neither? Answer SUPPORTS, REFUTES or NOT ENOUGH INFO, then "
                "explain in one sentence.\nAnswer:")
VERDICT_PROMPT = ("Claim: {claim}\nJudgements of the evidence:\n{judgements}\n\n"
                  "Write a one-paragraph verdict on the claim.\nVerdict:")
LABELS = ("SUPPORTS", "REFUTES", "NOT ENOUGH INFO")


def label_of(text: str) -> str:
    """The first label the judge wrote; an answer with none counts as NOT ENOUGH INFO."""
    found = re.search("|".join(LABELS), text.upper())
    return found.group(0) if found else "NOT ENOUGH INFO"


def shape(claim: str, evidence: list[str], max_tokens: int = 48) -> dict[str, Any]:
    """What the server should know of a run before it starts (docs/sdk.md): two stages, the
    longest answer of each, and each stage's largest request (prompt and answer) in tokens,
    estimated at four characters a token: the ETAs count the room those requests wait for,
    and a rough size tells a request of most of the cache from a small one."""
    judge = max((len(JUDGE_PROMPT.format(claim=claim, evidence=ev)) for ev in evidence), default=0) // 4
    # each judgement is listed as a label and at most 30 words
    verdict = (len(VERDICT_PROMPT) + len(claim) + 220 * len(evidence)) // 4
    return {"stages": 2, "critical_path_tokens": 3 * max_tokens,
            "stage_request_tokens": [judge + max_tokens, verdict + 2 * max_tokens]}


@agent("fact_verification", prompt=lambda claim, evidence, **_: claim + "\n" + "\n".join(evidence), shape=shape)
async def fact_verification(claim: str, evidence: list[str], max_tokens: int = 48) -> dict[str, Any]:
    judgements = await parallel_map(
        lambda ev: llm(JUDGE_PROMPT.format(claim=claim, evidence=ev), max_tokens=max_tokens,
                       temperature=0),
        evidence,
    )
    labels = [label_of(j) for j in judgements]
    votes = Counter(labels)
    decisive = {k: v for k, v in votes.items() if k != "NOT ENOUGH INFO"}
    label = max(decisive, key=lambda k: decisive[k]) if decisive else "NOT ENOUGH INFO"
    listing = "\n".join(f"- {lab}: {' '.join(j.split()[:30])}" for lab, j in zip(labels, judgements, strict=True))
    verdict = await llm(VERDICT_PROMPT.format(claim=claim, judgements=listing),
                        max_tokens=2 * max_tokens, temperature=0)
    return {"claim": claim, "label": label, "votes": dict(votes), "verdict": verdict}


if __name__ == "__main__":
    from _runner import inputs_path, main

    main(fact_verification, inputs_path("fact_verification"))
