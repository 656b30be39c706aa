"""MapReduce summarization: summarize the chunks of a document in parallel, then combine.

    .venv/bin/python examples/mapreduce_summary.py [--url URL] [--limit N]
"""

from __future__ import annotations

from justitia_sdk import agent, llm, parallel_map

MAP_PROMPT = "Summarize this passage in two sentences.\n\nPassage:\n{chunk}\n\nSummary:"
REDUCE_PROMPT = ("Combine these partial summaries into one short summary of the whole "
                 "document.\n\n{parts}\n\nSummary:")


def split_words(text: str, size: int) -> list[str]:
    """Chunks of about `size` words, cut at word boundaries."""
    words = text.split()
    return [" ".join(words[i:i + size]) for i in range(0, len(words), size)] or [text]


def clip(text: str, words: int) -> str:
    """Keep the reduce prompt inside the model's context whatever the map stage returned."""
    return " ".join(text.split()[:words])


@agent("mapreduce_summary")
async def mapreduce_summary(document: str, chunk_words: int = 60, max_tokens: int = 64) -> str:
    chunks = split_words(document, chunk_words)
    # Map: one request per chunk, all at once (the scheduler decides what runs when).
    partial = await parallel_map(
        lambda chunk: llm(MAP_PROMPT.format(chunk=chunk), max_tokens=max_tokens, temperature=0),
        chunks,
    )
    # Reduce: one request that sees every partial summary.
    parts = "\n".join(f"- {clip(p, 40)}" for p in partial)
    return await llm(REDUCE_PROMPT.format(parts=parts), max_tokens=2 * max_tokens, temperature=0)


if __name__ == "__main__":
    from _runner import inputs_path, main

    main(mapreduce_summary, inputs_path("mapreduce_summary"))
