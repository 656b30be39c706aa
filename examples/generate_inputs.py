"""Write the examples' inputs files: a few hand-written rows, then generated ones.

    .venv/bin/python examples/generate_inputs.py [--rows 24] [--seed 7]

Every text here was written for this project; the generator recombines it (seeded, so the
files are reproducible) into inputs of varied size, so that profiling them gives a cost
predictor runs of different costs to learn from (`justitia train-predictor AGENT --file
examples/AGENT.py --inputs examples/inputs/AGENT.jsonl --server URL --out DIR`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

TOPICS = {
    "harbor": [
        "The harbor town of Keelmouth grew around a stone pier built by fishermen centuries ago.",
        "Its boats worked the cold northern banks and salted cod in sheds along the waterfront.",
        "The railway let the catch reach inland cities within a day, and the town doubled in size.",
        "Merchants built brick houses on the hill, and a customs office opened beside the pier.",
        "When the banks were overfished, most boats were sold and the sheds stood empty.",
        "Today the sheds hold galleries, a ropewalk museum and a boatbuilding school.",
        "Summer visitors outnumber residents three to one, and house prices have climbed.",
        "The council is debating whether the customs office should become flats or a visitor center.",
    ],
    "garden": [
        "A community garden began on an abandoned parking lot with six raised beds.",
        "Soil tests found traces of oil and lead, so every bed was filled with imported compost.",
        "The first harvest of beans, squash and tomatoes went mostly to a nearby food pantry.",
        "A rainwater tank and a tool shed built from pallets arrived in the second year.",
        "Some members wanted flowers while others insisted every bed should grow food.",
        "A short charter now assigns beds for one season and asks for four hours of shared work a month.",
        "Two beds are reserved for a school class that visits every Friday.",
        "The city offered a five-year lease on condition that the garden opens to the public on weekends.",
    ],
    "consensus": [
        "Distributed databases must decide what happens when the network splits the cluster.",
        "A system that answers on both sides of a partition may accept conflicting writes.",
        "Raft commits a write only after a majority of replicas have stored it.",
        "Followers wait a randomized timeout before calling an election, which avoids split votes.",
        "Replicas are spread over three or five failure domains so that one outage never costs the majority.",
        "A leader holding a lease can serve reads alone, relying on bounded clock drift.",
        "Short election timeouts cause needless elections under load; long ones stall clients after failures.",
        "Snapshots keep the replicated log from growing without bound.",
    ],
    "bakery": [
        "The bakery on Mill Lane starts its ovens at four in the morning.",
        "Its sourdough starter has been fed every day for eleven years.",
        "Rye loaves need a longer proof in winter, when the kitchen is cold.",
        "The owner switched to a local mill after the old supplier raised prices twice in a year.",
        "Unsold bread goes to a shelter at the end of each day.",
        "A new apprentice learned to shape baguettes in three weeks.",
        "Customers asked for a gluten-free option, which needs a separate preparation area.",
        "The bakery plans to open a second counter at the railway station next spring.",
    ],
    "bridge": [
        "The old iron bridge over the river was closed after inspectors found corroded rivets.",
        "Engineers proposed replacing the deck while keeping the original trusses.",
        "Traffic was diverted to a ferry that runs every twenty minutes during the works.",
        "Shopkeepers on the east bank reported fewer customers during the closure.",
        "The repaired bridge will carry pedestrians and bicycles but no heavy trucks.",
        "Historians asked that the original lamp posts be restored rather than replaced.",
        "Night work was limited to protect a colony of bats nesting under the arches.",
        "The reopening is planned for the autumn festival.",
    ],
    "library": [
        "The village library moved into the former fire station last year.",
        "Its lending of tools, from drills to sewing machines, has become more popular than its novels.",
        "Volunteers run a homework club three afternoons a week.",
        "A grant paid for a ramp and a lift, so the upper floor is finally accessible.",
        "The library hosts a repair café on the first Saturday of each month.",
        "Opening hours were extended into the evening after a survey of commuters.",
        "The local history collection is being scanned so that it can be searched online.",
        "The budget for new books fell, and donations now fill most of the shelves.",
    ],
}

CLAIMS = [
    ("The customs office in Keelmouth opened before the railway arrived.", "harbor"),
    ("Soil tests at the community garden found no contamination.", "garden"),
    ("Raft allows a minority partition to commit writes.", "consensus"),
    ("The bakery on Mill Lane buys its flour from a local mill.", "bakery"),
    ("The repaired iron bridge will be open to heavy trucks.", "bridge"),
    ("The village library lends tools as well as books.", "library"),
    ("Keelmouth's population is larger in summer because of visitors.", "harbor"),
    ("The community garden is closed to the public on weekends.", "garden"),
    ("Randomized election timeouts help Raft avoid split votes.", "consensus"),
    ("The bakery throws away the bread it does not sell.", "bakery"),
    ("Night work on the bridge was restricted to protect wildlife.", "bridge"),
    ("The library's upper floor is still not reachable by wheelchair.", "library"),
]

FUNCTIONS = [
    ("mean(xs) returns the arithmetic mean of a non-empty list.",
     "def mean(xs):\n    return sum(xs) / len(xs)\n"),
    ("clamp(x, lo, hi) limits x to the closed interval [lo, hi].",
     "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"),
    ("last(xs) returns the last item of a list, or None if it is empty.",
     "def last(xs):\n    return xs[len(xs)]\n"),
    ("count_words(text) counts the words separated by whitespace.",
     "def count_words(text):\n    return len(text.split(' '))\n"),
    ("is_palindrome(s) tells whether s reads the same backwards, ignoring case.",
     "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n"),
    ("factorial(n) returns n! for n >= 0.",
     "def factorial(n):\n    out = 1\n    for k in range(1, n):\n        out *= k\n    return out\n"),
    ("flatten(xss) concatenates a list of lists into one list.",
     "def flatten(xss):\n    return [x for xs in xss for x in xs]\n"),
    ("safe_div(a, b) divides a by b and returns None when b is zero.",
     "def safe_div(a, b):\n    if b == 0:\n        return None\n    return a / b\n"),
    ("title_case(s) capitalizes the first letter of every word.",
     "def title_case(s):\n    return ' '.join(w[:1].upper() + w[1:] for w in s.split())\n"),
    ("running_max(xs) returns the running maximum of a list of numbers.",
     "def running_max(xs):\n    out, best = [], None\n    for x in xs:\n"
     "        best = x if best is None or x > best else best\n        out.append(best)\n    return out\n"),
]

QUESTION_TEMPLATES = [
    "A bus leaves at {h}:{m:02d} and the trip takes {d} minutes. "
    "At what minute past the hour does it arrive, if it stays within the hour?",
    "A crate holds {a} bottles. How many crates are needed for {b} bottles?",
    "If {a} tickets cost {c} coins in total, how much do {b} tickets cost?",
    "A garden bed is {a} meters long and {b} meters wide. What is its area in square meters?",
    "A baker makes {a} loaves an hour for {b} hours and sells {c} of them. How many are left?",
    "A cyclist rides {a} kilometers a day for {b} days. How many kilometers is that?",
]


def clause(rng: random.Random, topic: str, n: int) -> str:
    sentences = TOPICS[topic]
    start = rng.randrange(len(sentences))
    return " ".join(sentences[(start + i) % len(sentences)] for i in range(n))


def gen_mapreduce(rng: random.Random) -> dict[str, Any]:
    topics = rng.sample(sorted(TOPICS), rng.randint(1, 3))
    return {"document": " ".join(clause(rng, t, rng.randint(3, 8)) for t in topics)}


def gen_merging(rng: random.Random) -> dict[str, Any]:
    topic = rng.choice(sorted(TOPICS))
    n = rng.randint(2, 6)
    return {"documents": [f"Draft {i + 1}: " + clause(rng, topic, rng.randint(1, 3))
                          for i in range(n)]}


def gen_fact(rng: random.Random) -> dict[str, Any]:
    claim, topic = rng.choice(CLAIMS)
    others = [t for t in sorted(TOPICS) if t != topic]
    evidence = [clause(rng, topic, 1) for _ in range(rng.randint(1, 4))]
    evidence += [clause(rng, rng.choice(others), 1) for _ in range(rng.randint(0, 2))]
    rng.shuffle(evidence)
    return {"claim": claim, "evidence": evidence}


def gen_question(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randint(2, 15), rng.randint(10, 120)
    q = rng.choice(QUESTION_TEMPLATES).format(h=rng.randint(6, 21), m=rng.randint(0, 30),
                                              d=rng.randint(5, 29), a=a, b=b, c=a * rng.randint(2, 9))
    return {"question": q, "samples": rng.randint(3, 8)}


def gen_code(rng: random.Random) -> dict[str, Any]:
    picked = rng.sample(FUNCTIONS, rng.randint(1, 3))
    code = "\n".join(src for _, src in picked)
    if rng.random() < 0.15:  # now and then a syntax error, which the agent checks locally
        code = code.replace("):", ")", 1)
    return {"spec": " ".join(spec for spec, _ in picked), "code": code}


def gen_equations(rng: random.Random) -> dict[str, Any]:
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    steps = [f"{a} + {b} = {a + b}", f"{a + b} * {c} = {(a + b) * c}"]
    if rng.random() < 0.5:
        steps.append(f"{(a + b) * c} - {a} = {(a + b) * c - a}")
    if rng.random() < 0.5:
        steps.append(f"{(a + b) * c} / {c} = {a + b}")
    if rng.random() < 0.4:  # a wrong step to catch
        i = rng.randrange(len(steps))
        lhs, rhs = steps[i].split(" = ")
        steps[i] = f"{lhs} = {int(rhs) + rng.choice([-2, -1, 1, 3])}"
    problem = f"Start from {a} and {b}: add them, multiply by {c}, then check the rest of the steps."
    return {"problem": problem, "steps": steps}


GENERATORS = {
    "mapreduce_summary": gen_mapreduce,
    "document_merging": gen_merging,
    "fact_verification": gen_fact,
    "self_consistency": gen_question,
    "code_checking": gen_code,
    "equation_verification": gen_equations,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=24, help="rows per inputs file")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", type=int, default=3,
                        help="hand-written rows kept at the top of each file")
    args = parser.parse_args()
    for name, gen in GENERATORS.items():
        path = HERE / "inputs" / f"{name}.jsonl"
        kept = [line for line in path.read_text().splitlines() if line.strip()][: args.keep] \
            if path.exists() else []
        rng = random.Random(f"{args.seed}-{name}")
        rows = kept + [json.dumps(gen(rng)) for _ in range(max(0, args.rows - len(kept)))]
        path.write_text("\n".join(rows) + "\n")
        print(f"{path.relative_to(HERE.parent)}: {len(rows)} rows")


if __name__ == "__main__":
    main()
