"""Document merging: merge drafts pairwise, in rounds, until one document remains.

Round k merges the survivors of round k-1 two by two, in parallel: a tree of log2(n) stages.

    .venv/bin/python examples/document_merging.py [--url URL] [--limit N]
"""

from __future__ import annotations

from justitia_sdk import agent, llm, parallel_map

MERGE_PROMPT = ("Merge these two drafts into one coherent text. Keep every fact, drop "
                "repetitions.\n\nDraft A:\n{a}\n\nDraft B:\n{b}\n\nMerged text:")


def clip(text: str, words: int = 80) -> str:
    return " ".join(text.split()[:words])


@agent("document_merging")
async def document_merging(documents: list[str], max_tokens: int = 96) -> str:
    if not documents:
        raise ValueError("nothing to merge")
    level = [clip(d) for d in documents]
    while len(level) > 1:
        pairs = [(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        merged = await parallel_map(
            lambda a, b: llm(MERGE_PROMPT.format(a=a, b=b), max_tokens=max_tokens, temperature=0),
            [a for a, _ in pairs], [b for _, b in pairs],
        )
        # An odd draft out goes to the next round unchanged.
        level = [clip(m) for m in merged] + ([level[-1]] if len(level) % 2 else [])
    return level[0]


if __name__ == "__main__":
    from _runner import inputs_path, main

    main(document_merging, inputs_path("document_merging"))
