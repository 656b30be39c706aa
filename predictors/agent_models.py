"""Request structure of the paper's task-parallel agent kinds, for building cost samples.

Without a real LLM, an agent's cost is assembled from its structure: the number of requests
and their prompt sizes follow from the agent's input text (estimated tokens, see
:func:`predictors.prompt_features.estimate_tokens`), and each request's output length is drawn by an
``OutputLengths`` sampler (from a real trace in ``benchmarks/make_predictor_samples.py``, from
a parametric stand-in in :mod:`predictors.synthetic`). Draws are seeded from the input text, so
the same input always gets the same cost (profiling at temperature 0).

Every builder returns ``(stages, features)``: ``stages`` is a list of stages, each a list of
``{"p": prompt_tokens, "d": output_tokens}`` requests (the workload format,
docs/benchmarks.md), ``features`` the numeric features known when the agent is submitted.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .prompt_features import estimate_tokens


class OutputLengths(Protocol):
    def draw(self, rng: np.random.Generator, kind: str, prompt_tokens: int, cap: int) -> int:
        """An output length for a request of ``kind`` with ``prompt_tokens`` prompt tokens."""


def rng_for(*texts: str, seed: int = 0) -> np.random.Generator:
    h = hashlib.sha256(("\x00".join(texts) + f"\x00{seed}").encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def _req(p: int, d: int) -> dict[str, int]:
    return {"p": int(p), "d": int(max(1, d))}


# Instruction overheads (tokens) of each request kind: the template around the input text.
MAP_INSTR, REDUCE_INSTR = 60, 60
QUERY_INSTR, VERIFY_INSTR, EVIDENCE_TOKENS = 80, 90, 400
COT_FEWSHOT = 250
CODE_INSTR, REVIEW_INSTR = 100, 150
MERGE_INSTR, SCORE_INSTR = 200, 220
CHUNK_TOKENS = 1024


def mapreduce_summary(document: str, lengths: OutputLengths, seed: int = 0):
    """Split into ~1024-token chunks, summarise each in parallel, then reduce the summaries."""
    rng = rng_for(document, seed=seed)
    tokens = max(1, estimate_tokens(document))
    n = max(1, math.ceil(tokens / CHUNK_TOKENS))
    sizes = [tokens // n + (1 if i < tokens % n else 0) for i in range(n)]
    maps = []
    for size in sizes:
        p = MAP_INSTR + size
        maps.append(_req(p, lengths.draw(rng, "summary", p, 400)))
    stages = [maps]
    if n > 1:
        p = REDUCE_INSTR + sum(r["d"] for r in maps)
        stages.append([_req(p, lengths.draw(rng, "summary", p, 600))])
    return stages, {"n_items": n}


def fact_verification(claims: Sequence[str], lengths: OutputLengths, seed: int = 0):
    """Per claim: generate a search query, then verify the claim against retrieved evidence."""
    rng = rng_for(*claims, seed=seed)
    queries, verdicts = [], []
    for claim in claims:
        c = estimate_tokens(claim)
        p = QUERY_INSTR + c
        queries.append(_req(p, lengths.draw(rng, "short", p, 64)))
        p = VERIFY_INSTR + c + EVIDENCE_TOKENS
        verdicts.append(_req(p, lengths.draw(rng, "short", p, 160)))
    return [queries, verdicts], {"n_items": len(claims)}


def self_consistency(question: str, n_paths: int, lengths: OutputLengths, seed: int = 0):
    """``n_paths`` chain-of-thought samples of one question in parallel (the vote is local)."""
    rng = rng_for(question, str(n_paths), seed=seed)
    p = COT_FEWSHOT + estimate_tokens(question)
    return [[_req(p, lengths.draw(rng, "reasoning", p, 512)) for _ in range(n_paths)]], {"n_items": n_paths}


def code_checking(problem: str, n_candidates: int, lengths: OutputLengths, seed: int = 0):
    """Write ``n_candidates`` solutions in parallel, then review each against the problem."""
    rng = rng_for(problem, str(n_candidates), seed=seed)
    t = estimate_tokens(problem)
    gen = [_req(CODE_INSTR + t, lengths.draw(rng, "code", CODE_INSTR + t, 512)) for _ in range(n_candidates)]
    review = []
    for g in gen:
        p = REVIEW_INSTR + t + g["d"]
        review.append(_req(p, lengths.draw(rng, "short", p, 256)))
    return [gen, review], {"n_items": n_candidates}


def doc_merge(documents: Sequence[str], lengths: OutputLengths, seed: int = 0, n_merges: int = 4):
    """Graph-of-thoughts merge: ``n_merges`` merges in parallel, score each, aggregate the best two."""
    rng = rng_for(*documents, seed=seed)
    t = sum(estimate_tokens(d) for d in documents)
    p = MERGE_INSTR + t
    cap = 2048
    merges = [_req(p, lengths.draw(rng, "merge", p, cap)) for _ in range(n_merges)]
    scores = [_req(SCORE_INSTR + t + m["d"], lengths.draw(rng, "short", SCORE_INSTR + t + m["d"], 128)) for m in merges]
    best = sorted(m["d"] for m in merges)[-2:]
    p = MERGE_INSTR + t + sum(best)
    final = [_req(p, lengths.draw(rng, "merge", p, cap))]
    return [merges, scores, final], {"n_items": len(documents)}


AGENT_TYPES = ("mapreduce_summary", "fact_verification", "self_consistency", "code_checking", "doc_merge")


# -- loop-shaped agents: the number of steps depends on the task ---------------
REACT_INSTR, OBSERVATION_TOKENS = 300, 90
RESEARCH_INSTR, SYNTH_INSTR = 120, 150


def react_loop(task: str, n_lookups: int, lengths: OutputLengths, seed: int = 0):
    """A ReAct loop: think, then one tool call per thing the task asks to look up (plus a
    retry now and then), then answer. Every step's prompt carries the whole context so far
    (the task, earlier thoughts and observations), so cost grows with the square of the
    step count, and the step count follows the task's words and numbers."""
    rng = rng_for(task, str(n_lookups), seed=seed)
    retries = int(rng.poisson(0.15 * n_lookups))
    steps = 1 + n_lookups + retries + 1  # plan, lookups (and retries), final answer
    context = REACT_INSTR + estimate_tokens(task)
    stages = []
    for k in range(steps):
        kind = "reasoning" if k in (0, steps - 1) else "short"
        d = lengths.draw(rng, kind, context, 256)
        stages.append([_req(context, d)])
        context += d + (OBSERVATION_TOKENS if 0 < k < steps - 1 else 0)
    return stages, {"stages": steps}


def fan_out_research(question: str, fan_out: int, lengths: OutputLengths, seed: int = 0):
    """Fan-out: ``fan_out`` sub-questions answered in parallel (the width is declared by
    the caller in the agent's metadata), then one synthesis over every answer."""
    rng = rng_for(question, str(fan_out), seed=seed)
    q = estimate_tokens(question)
    subs = [_req(RESEARCH_INSTR + q, lengths.draw(rng, "summary", RESEARCH_INSTR + q, 400)) for _ in range(fan_out)]
    p = SYNTH_INSTR + q + sum(r["d"] for r in subs)
    return [subs, [_req(p, lengths.draw(rng, "summary", p, 600))]], {"fan_out": fan_out, "stages": 2}


def lookup_or_survey(prompt: str, lengths: OutputLengths, seed: int = 0):
    """A type whose cost follows the words of its prompt: a short lookup is one request, a
    survey four (three sources in parallel, then a summary): the online-learning target."""
    rng = rng_for(prompt, seed=seed)
    p = RESEARCH_INSTR + estimate_tokens(prompt)
    if "survey" not in prompt.lower():
        return [[_req(p, lengths.draw(rng, "short", p, 64))]], {}
    sources = [_req(p, lengths.draw(rng, "summary", p, 400)) for _ in range(3)]
    q = p + sum(r["d"] for r in sources)
    return [sources, [_req(q, lengths.draw(rng, "summary", q, 400))]], {}


#: The loop-shaped types of the benchmark (not in the committed example file).
LOOP_AGENT_TYPES = ("react_loop", "fan_out_research")
