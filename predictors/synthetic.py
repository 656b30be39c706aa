"""Synthetic example samples, from texts generated here (no corpus is copied).

Used for the committed example file ``predictors/data/example_samples.jsonl.gz`` and for
the tests. Prompts are composed from small word lists and sentence templates written for
this project; agents' structures are those of :mod:`predictors.agent_models`; output lengths
are drawn from log-normal distributions whose medians and spreads were set by hand to
resemble the public traces (ShareGPT chat and arXiv summarization token counts), see
:data:`LOGNORMAL`. These costs are therefore *simulated*: good for exercising the code and
for comparing predictors with each other, not a measurement of any real model.

Regenerate with ``python -m predictors.synthetic predictors/data/example_samples.jsonl.gz``.
"""

from __future__ import annotations

import sys

import numpy as np

from . import agent_models as am
from .samples import Sample, agent_cost, write_samples

# (median output tokens, sigma of the log) per request kind.
LOGNORMAL = {
    "summary": (170, 0.6),
    "short": (40, 0.7),
    "reasoning": (180, 0.5),
    "code": (200, 0.6),
    "merge": (600, 0.5),
}


class LognormalLengths:
    """Output lengths drawn from per-kind log-normals, growing slowly with the prompt."""

    def draw(self, rng: np.random.Generator, kind: str, prompt_tokens: int, cap: int) -> int:
        median, sigma = LOGNORMAL[kind]
        scale = (max(prompt_tokens, 50) / 500.0) ** 0.15
        return int(min(cap, max(1, round(median * scale * float(np.exp(sigma * rng.standard_normal()))))))


_SUBJECTS = ["the river", "the council", "a young engineer", "the old bridge", "the museum", "the harbour",
             "the orchestra", "a local farmer", "the railway company", "the observatory", "the library",
             "the mountain village", "a famous painter", "the football club", "the university", "the factory"]
_VERBS = ["opened", "rebuilt", "described", "supported", "visited", "expanded", "recorded", "financed",
          "criticised", "restored", "celebrated", "moved", "studied", "announced", "designed", "protected"]
_OBJECTS = ["a new wing", "the northern road", "several paintings", "the annual festival", "a long report",
            "the first concert", "its wooden roof", "a public garden", "the winter market", "two new lines",
            "a small chapel", "the coastal path", "an exhibition of maps", "the original charter"]
_TAILS = ["in the spring of {y}", "after a long debate", "with help from {s}", "despite heavy rain",
          "for the first time since {y}", "according to local records", "before the war", "during {y}"]
_NAMES = ["Alder", "Brook", "Carrow", "Dunmere", "Elstow", "Fenwick", "Glenholm", "Harrowgate", "Ivel",
          "Juniper", "Kestrel", "Linford", "Marlow", "Northby", "Oakham", "Pendle"]


def _sentence(rng: np.random.Generator) -> str:
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    tail = pick(_TAILS).format(y=int(rng.integers(1850, 2020)), s=pick(_SUBJECTS))
    s = f"{pick(_SUBJECTS)} of {pick(_NAMES)} {pick(_VERBS)} {pick(_OBJECTS)} {tail}."
    return s[0].upper() + s[1:]


def _paragraphs(rng: np.random.Generator, words: int) -> str:
    out, n, para = [], 0, []
    while n < words:
        s = _sentence(rng)
        para.append(s)
        n += len(s.split())
        if len(para) >= int(rng.integers(3, 8)):
            out.append(" ".join(para))
            para = []
    if para:
        out.append(" ".join(para))
    return "\n\n".join(out)


def _document(rng):
    place = _NAMES[int(rng.integers(len(_NAMES)))]
    title = f"= {place} {['History', 'Harbour', 'Railway', 'Festival'][int(rng.integers(4))]} ="
    words = int(np.exp(rng.uniform(np.log(120), np.log(2400))))
    return title + "\n\n" + _paragraphs(rng, words)


def _claim(rng):
    return _sentence(rng)


_ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "tickets", "stamps"]


def _question(rng):
    a, b, c = (int(x) for x in rng.integers(2, 60, size=3))
    item, name = _ITEMS[int(rng.integers(len(_ITEMS)))], _NAMES[int(rng.integers(len(_NAMES)))]
    parts = [f"{name} has {a} {item}.", f"A friend gives {name} {b} more {item}."]
    for _ in range(int(rng.integers(0, 4))):
        gives = int(rng.integers(1, 9))
        parts.append(f"Then {name} gives away {gives} {item} and buys {c} packs of {int(rng.integers(2, 6))}.")
    parts.append(f"How many {item} does {name} have at the end?")
    return " ".join(parts)


_VERBS_CODE = ["count", "sum", "filter", "sort", "merge", "reverse", "group", "flatten", "rotate", "encode"]
_NOUNS_CODE = ["numbers", "words", "intervals", "pairs", "digits", "strings", "matrix", "tokens"]


def _problem(rng):
    v, n = _VERBS_CODE[int(rng.integers(len(_VERBS_CODE)))], _NOUNS_CODE[int(rng.integers(len(_NOUNS_CODE)))]
    name = f"{v}_{n}"
    lines = [f"def {name}(values: list, k: int) -> list:", f'    """{v.capitalize()} the {n} in values.', ""]
    for _ in range(int(rng.integers(1, 6))):
        lines.append(f"    Keep only {n} whose position is a multiple of k, then {v} them again.")
    for _ in range(int(rng.integers(1, 4))):
        xs = [int(x) for x in rng.integers(0, 9, size=int(rng.integers(2, 7)))]
        lines.append(f"    >>> {name}({xs}, {int(rng.integers(1, 4))})")
        lines.append(f"    {sorted(xs)}")
    lines.append('    """')
    return "\n".join(lines) + "\n"


_CLAUSES = ["The receiving party shall keep all confidential information secret.",
            "This agreement is governed by the laws of the state of {n}.",
            "Breach of this agreement entitles the disclosing party to injunctive relief.",
            "Confidential information excludes information that is already public.",
            "The obligations survive for {k} years after termination.",
            "Each party may terminate this agreement with {k} days written notice.",
            "No licence to any intellectual property is granted by this agreement.",
            "All materials must be returned or destroyed upon request."]


def _nda(rng):
    n_clauses = int(rng.integers(4, 14))
    lines = ["NON-DISCLOSURE AGREEMENT", ""]
    for i in range(n_clauses):
        clause = _CLAUSES[int(rng.integers(len(_CLAUSES)))]
        c = clause.format(n=_NAMES[int(rng.integers(len(_NAMES)))], k=int(rng.integers(1, 10)))
        lines.append(f"{i + 1}. {c}")
    return "\n".join(lines)


_FACTS = ["opening year", "founder", "population", "length", "first director", "oldest building",
          "annual budget", "main export"]
_PLACES = ["the museum", "the harbour", "the library", "the observatory", "the railway", "the university",
           "the council", "the orchestra"]


def _thing(rng: np.random.Generator) -> str:
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    return f"the {pick(_FACTS)} of {pick(_PLACES)} of {pick(_NAMES)}"


def _react_task(rng: np.random.Generator) -> tuple[str, int]:
    """A ReAct task and how many lookups it needs: named things, a "top N" list, or one
    fact; "compare"/"total" add a step. Years in the text are noise."""
    form = int(rng.integers(3))
    if form == 0:
        k = int(rng.integers(2, 6))
        things = [_thing(rng) for _ in range(k)]
        text = "Find " + ", ".join(things[:-1]) + " and " + things[-1] + "."
    elif form == 1:
        k = int(rng.integers(2, 10))
        text = (f"List the {k} oldest {_PLACES[int(rng.integers(len(_PLACES)))][4:]}s of "
                f"{_NAMES[int(rng.integers(len(_NAMES)))]} and look up when each opened.")
    else:
        k = 1
        text = f"What is {_thing(rng)}?"
    if rng.random() < 0.5:
        text += f" Only count records after {int(rng.integers(1850, 2000))}."
    if k > 1 and rng.random() < 0.5:
        text += " Then " + ["compare them", "give the total", "rank them by age"][int(rng.integers(3))] + "."
        k += 1
    return text, k


def lookup_or_survey_prompt(rng: np.random.Generator) -> str:
    """A short lookup question or a long survey request (the `lookup_or_survey` type)."""
    if rng.random() < 0.5:
        return f"What is {_thing(rng)}?"
    topic = _thing(rng)
    return (f"Write a survey of {topic}, covering its history, the records kept about it, "
            f"and how {_SUBJECTS[int(rng.integers(len(_SUBJECTS)))]} changed it over the years.")


def _synthesize_loop(agent_type: str, rng: np.random.Generator, lengths: LognormalLengths, seed: int):
    """One sample of a loop-shaped type: (prompt, stages, submission features)."""
    if agent_type == "react_loop":
        prompt, k = _react_task(rng)
        stages, _ = am.react_loop(prompt, k, lengths, seed)
        return prompt, stages, {}  # the step count is not declared: it is what is predicted
    if agent_type == "fan_out_research":
        prompt = " ".join(_sentence(rng) for _ in range(int(rng.integers(1, 4)))) + " What follows from this?"
        stages, feats = am.fan_out_research(prompt, int(rng.integers(2, 13)), lengths, seed)
        return prompt, stages, feats
    prompt = lookup_or_survey_prompt(rng)
    stages, feats = am.lookup_or_survey(prompt, lengths, seed)
    return prompt, stages, feats


#: Every type :func:`synthesize` makes.
ALL_TYPES = am.AGENT_TYPES + am.LOOP_AGENT_TYPES + ("lookup_or_survey",)


def synthesize(agent_type: str, n: int, seed: int = 0) -> list[Sample]:
    """``n`` simulated samples of one of :data:`ALL_TYPES`."""
    if agent_type not in ALL_TYPES:
        raise ValueError(f"unknown agent type {agent_type!r}; known: {', '.join(ALL_TYPES)}")
    rng = np.random.default_rng([seed, ALL_TYPES.index(agent_type)])
    lengths = LognormalLengths()
    out = []
    for _ in range(n):
        if agent_type not in am.AGENT_TYPES:
            prompt, stages, feats = _synthesize_loop(agent_type, rng, lengths, seed)
        elif agent_type == "mapreduce_summary":
            prompt = _document(rng)
            stages, feats = am.mapreduce_summary(prompt, lengths, seed)
        elif agent_type == "fact_verification":
            claims = [_claim(rng) for _ in range(int(rng.integers(1, 17)))]
            prompt = "\n".join(claims)
            stages, feats = am.fact_verification(claims, lengths, seed)
        elif agent_type == "self_consistency":
            prompt = _question(rng)
            stages, feats = am.self_consistency(prompt, int(rng.choice([3, 5, 8, 10, 16])), lengths, seed)
        elif agent_type == "code_checking":
            prompt = _problem(rng)
            stages, feats = am.code_checking(prompt, int(rng.integers(1, 9)), lengths, seed)
        elif agent_type == "doc_merge":
            docs = [_nda(rng) for _ in range(4)]
            prompt = "\n\n---\n\n".join(docs)
            stages, feats = am.doc_merge(docs, lengths, seed)
        else:
            raise ValueError(f"unknown agent type {agent_type!r}; known: {', '.join(am.AGENT_TYPES)}")
        out.append(Sample(agent_type=agent_type, prompt=prompt, cost=agent_cost(stages), features=feats))
    return out


def synthesize_all(n_per_type: int = 125, seed: int = 0) -> list[Sample]:
    return [s for t in am.AGENT_TYPES for s in synthesize(t, n_per_type, seed)]


if __name__ == "__main__":  # pragma: no cover
    path = sys.argv[1] if len(sys.argv) > 1 else "predictors/data/example_samples.jsonl.gz"
    n = write_samples(synthesize_all(int(sys.argv[2]) if len(sys.argv) > 2 else 125), path)
    print(f"wrote {n} samples to {path}")
