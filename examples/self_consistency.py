"""Self-consistency voting: sample several reasoning chains in parallel, vote on the answers.

    .venv/bin/python examples/self_consistency.py [--url URL] [--limit N]
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from justitia_sdk import agent, llm, parallel_map

PROMPT = ("Question: {question}\nThink step by step, then give the final answer on its own "
          "line as 'Answer: <answer>'.\nReasoning:")


def final_answer(text: str) -> str:
    """'Answer: X' if the chain wrote one, else its last number, else its last word."""
    marked = re.findall(r"answer\s*[:=]\s*([^\n]+)", text, flags=re.IGNORECASE)
    if marked:
        return marked[-1].strip().rstrip(".").lower()
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    if numbers:
        return numbers[-1]
    words = re.findall(r"\w+", text)
    return words[-1].lower() if words else ""


@agent("self_consistency", prompt=lambda question, **_: question)
async def self_consistency(question: str, samples: int = 5, max_tokens: int = 96) -> dict[str, Any]:
    # Different seeds make the chains differ while keeping each run reproducible.
    chains = await parallel_map(
        lambda seed: llm(PROMPT.format(question=question), max_tokens=max_tokens,
                         temperature=0.8, seed=seed),
        range(samples),
    )
    votes = Counter(final_answer(c) for c in chains)
    answer, count = votes.most_common(1)[0]
    return {"question": question, "answer": answer, "agreement": count / samples,
            "votes": dict(votes)}


if __name__ == "__main__":
    from _runner import inputs_path, main

    main(self_consistency, inputs_path("self_consistency"))
