"""Build agent-cost samples from the public data in ../shared/data (developer machines only).

    python benchmarks/make_predictor_samples.py --data /work/shared/data --out /tmp/predictor_samples.jsonl

or profile the SDK's example agents on a live server (what made the committed
predictors/data/example_agents_profiled.jsonl.gz; their inputs are project-written texts):

    justitia serve --port 8765 --kv-tokens 16384 &
    python benchmarks/make_predictor_samples.py --profile-examples http://127.0.0.1:8765 \
        --per-type 125 --out predictors/data/example_agents_profiled.jsonl.gz

The output embeds text from corpora (WikiText-2, FEVER, GSM8K, HumanEval, GoT doc_merge) and
must not be committed. How each sample's cost is obtained (no LLM is run):

* the agent's *structure* follows from its real input text (predictors/agent_models.py):
  MapReduce summarization chunks a WikiText-2 document (a run of sections of one article,
  at least 256 tokens) into ~1024-token pieces, fact
  verification issues a query and a verdict request per FEVER claim, self-consistency samples
  several chain-of-thought paths per GSM8K question, code checking writes and reviews
  candidate solutions of a HumanEval problem, document merging merges / scores / aggregates a
  set of four NDAs from GoT's doc_merge; prompt tokens are estimated from that text;
* every request's *output length* is drawn from a real trace, from the rows whose prompt
  length is nearest to the request's (the 200 nearest by prefill tokens): summaries from
  Vidur's arXiv summarization trace, merges from Sarathi's ShareGPT trace, short answers
  (queries, verdicts, reviews) from ShareGPT scaled by 0.1, reasoning paths from ShareGPT
  scaled by 0.5, code from the completion lengths of ParrotServe's MetaGPT logs; each capped
  at the request's max_tokens. Draws are seeded by the input text (temperature-0 profiling:
  the same input always costs the same).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictors import agent_models as am  # noqa: E402
from predictors.prompt_features import estimate_tokens  # noqa: E402
from predictors.samples import Sample, agent_cost, write_samples  # noqa: E402

#: Documents (runs of WikiText-2 sections) shorter than this are not summarization inputs.
MIN_DOC_TOKENS = 256


class TraceLengths:
    """Output lengths from real traces, conditioned on the request's prompt length."""

    SCALE = {"summary": 1.0, "merge": 1.0, "short": 0.1, "reasoning": 0.5, "code": 1.0}

    def __init__(self, data: Path, window: int = 200):
        self.window = window
        sharegpt = self._csv(data / "sarathi" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
        arxiv = self._csv(data / "vidur" / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv")
        metagpt = self._metagpt(data / "parrot" / "metagpt")
        self.traces = {"summary": arxiv, "merge": sharegpt, "short": sharegpt, "reasoning": sharegpt, "code": metagpt}

    @staticmethod
    def _csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
        with open(path, newline="") as f:
            rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
        rows.sort()
        a = np.array(rows)
        return a[:, 0], a[:, 1]

    @staticmethod
    def _metagpt(folder: Path) -> tuple[np.ndarray, np.ndarray]:
        pairs = []
        for p in sorted(folder.glob("*.jsonl")):
            text = p.read_text(encoding="utf-8")
            for m in re.finditer(r'"prompt_tokens":\s*(\d+),\s*"completion_tokens":\s*(\d+)', text):
                pairs.append((int(m.group(1)), int(m.group(2))))
        pairs.sort()
        a = np.array(pairs)
        return a[:, 0], a[:, 1]

    def draw(self, rng: np.random.Generator, kind: str, prompt_tokens: int, cap: int) -> int:
        prefill, decode = self.traces[kind]
        i = int(np.searchsorted(prefill, prompt_tokens))
        w = min(self.window, len(prefill))
        lo = max(0, min(i - w // 2, len(prefill) - w))
        d = decode[lo + int(rng.integers(w))] * self.SCALE[kind]
        return int(min(cap, max(1, round(d))))


def wikitext_documents(path: Path, n: int, rng: np.random.Generator) -> list[str]:
    text = path.read_text(encoding="utf-8")
    articles = [a for a in re.split(r"\n (?== [^=].* = \n)", text) if a.strip()]
    docs = []
    while len(docs) < n:
        art = articles[int(rng.integers(len(articles)))]
        sections = re.split(r"\n (?== = )", art)
        start = int(rng.integers(len(sections)))
        k = int(rng.integers(1, len(sections) - start + 1))
        doc = "\n".join(sections[start : start + k]).strip()
        if estimate_tokens(doc) >= MIN_DOC_TOKENS:  # nobody runs a summarizer on a lone heading
            docs.append(doc)
    return docs


def build(data: Path, n: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    lengths = TraceLengths(data)
    out: list[Sample] = []

    for doc in wikitext_documents(data / "wikitext2" / "test.txt", n, rng):
        stages, feats = am.mapreduce_summary(doc, lengths, seed)
        out.append(Sample(agent_type="mapreduce_summary", prompt=doc, cost=agent_cost(stages), features=feats))

    claims = [json.loads(line)["claim"] for line in open(data / "fever" / "paper_dev.jsonl", encoding="utf-8")]
    for _ in range(n):
        k = int(rng.integers(1, 17))
        batch = [claims[int(i)] for i in rng.choice(len(claims), size=k, replace=False)]
        stages, feats = am.fact_verification(batch, lengths, seed)
        out.append(Sample(agent_type="fact_verification", prompt="\n".join(batch), cost=agent_cost(stages),
                          features=feats))

    questions = [json.loads(line)["question"] for line in open(data / "gsm8k" / "test.jsonl", encoding="utf-8")]
    for i in rng.choice(len(questions), size=n, replace=False):
        q = questions[int(i)]
        paths = int(rng.choice([3, 5, 8, 10, 16]))
        stages, feats = am.self_consistency(q, paths, lengths, seed)
        out.append(Sample(agent_type="self_consistency", prompt=q, cost=agent_cost(stages), features=feats))

    humaneval = gzip.open(data / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8")
    problems = [json.loads(line)["prompt"] for line in humaneval]
    for i in rng.permutation(len(problems))[:n]:
        prob = problems[int(i)]
        cands = int(rng.integers(1, 9))
        stages, feats = am.code_checking(prob, cands, lengths, seed)
        out.append(Sample(agent_type="code_checking", prompt=prob, cost=agent_cost(stages), features=feats))

    csv.field_size_limit(10**7)
    with open(data / "got_doc_merge" / "documents.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for r in rows[:n]:
        docs = [r[f"document{j}"] for j in range(1, 5)]
        stages, feats = am.doc_merge(docs, lengths, seed)
        out.append(Sample(agent_type="doc_merge", prompt="\n\n---\n\n".join(docs), cost=agent_cost(stages),
                          features=feats))
    return out


def profile_examples(server: str, per_type: int, seed: int, concurrency: int = 8) -> list[Sample]:
    """Run the SDK's example agents (examples/) on a live server and measure their costs.

    Inputs come from examples/generate_inputs.py's generators (texts written for the
    project, recombined with ``seed``); costs are what the server measured (the token counts
    of every request the engine ran). Output lengths are whatever the served model wrote.
    """
    import random

    import justitia_sdk

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import importlib

    gen = importlib.import_module("generate_inputs")
    out: list[Sample] = []
    for name, make in gen.GENERATORS.items():
        module = importlib.import_module(name)  # registers the @agent
        del module
        agent = justitia_sdk.get_agent(name)
        rng = random.Random(f"profile-{seed}-{name}")
        inputs = [make(rng) for _ in range(per_type)]
        rows = justitia_sdk.profile_agent(agent, inputs, server=server, concurrency=concurrency)
        for r in rows:
            feats = {k: v for k, v in (r.get("features") or {}).items()}
            out.append(Sample(agent_type=r["agent_type"], prompt=r["prompt"], cost=r["cost"], features=feats))
        print(f"{name}: {len(rows)} of {per_type} runs finished", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data", help="folder of the public data (see its README)")
    ap.add_argument("--out", required=True, help="JSON Lines to write (do not commit it: it embeds corpus text)")
    ap.add_argument("--per-type", type=int, default=150, help="agents per type (doc_merge has at most 100 inputs)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the input choice and output-length draws")
    ap.add_argument("--profile-examples", metavar="URL", default=None,
                    help="instead: profile the SDK's example agents on the server at URL "
                         "(their inputs are project-written texts: the output may be committed)")
    args = ap.parse_args()
    if args.profile_examples:
        samples = profile_examples(args.profile_examples, args.per_type, args.seed)
    else:
        samples = build(Path(args.data), args.per_type, args.seed)
    n = write_samples(samples, args.out)
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.agent_type] = counts.get(s.agent_type, 0) + 1
    print(f"wrote {n} samples to {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
