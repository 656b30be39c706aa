"""Benchmark of the cost predictors: held-out error vs baselines, latency, training time.

    python benchmarks/predictor_bench.py                       # the committed sample files
    python benchmarks/predictor_bench.py --data ../shared/data # + samples built from public data

Datasets: the committed example files, and ``loop-agents``: agent types the model was not
designed on (ReAct loops whose step count follows the task's words and numbers, fan-out
agents whose width is declared in their metadata; ``predictors/synthetic.py``).

For every dataset and agent type, ``--splits`` random splits of (up to) 125 samples into
100 training / 25 held-out (doc_merge, 100 inputs: 80 / 20). On each split: the per-type
model (its kind chosen by cross-validation on the training samples: ``model``), the paper's
MLP alone as before this choice (``mlp_paper``), the training mean and median baselines,
one global MLP trained on every type's training samples, a length-only linear model, and
the cold start fed the same training runs (plus the cold start before any observation).
Errors are pooled over the held-out samples of all splits, and so is the coverage of the
model's p50 and p90 (share of real costs at most each). Latency: single predictions on the
held-out samples. Training time: choosing and fitting the per-type model on its 100
training samples.

Prints a table and writes ``benchmarks/results/predictors.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from predictors.agent_models import LOOP_AGENT_TYPES  # noqa: E402
from predictors.cold_start import ColdStartEstimator  # noqa: E402
from predictors.evaluation import (  # noqa: E402
    LengthLinearBaseline,
    MeanBaseline,
    MedianBaseline,
    measure_latency,
    relative_errors,
)
from predictors.persistence import library_versions  # noqa: E402
from predictors.samples import read_samples  # noqa: E402
from predictors.synthetic import synthesize  # noqa: E402
from predictors.training import Candidate, fit_predictor  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

EXAMPLE = ROOT / "predictors" / "data" / "example_samples.jsonl.gz"
PROFILED = ROOT / "predictors" / "data" / "example_agents_profiled.jsonl.gz"
PREDICTORS = ("model", "mlp_paper", "mean", "median", "global", "length_linear", "cold_start", "cold_start_prior")
PAPER_MLP = Candidate("mlp")
FRESH_AGENTS, FRESH_SEED = 500, 7  # the loop agents' fresh held-out set (see bench_dataset)


def _summ(errors: list[float]) -> dict[str, float]:
    e = np.asarray(errors)
    return {"mean_relative_error": float(e.mean()), "median_relative_error": float(np.median(e)),
            "p90_relative_error": float(np.percentile(e, 90))}


def _score_fresh(errs: dict[str, list], agents: list, preds: dict) -> None:
    truth = [s.cost for s in agents]
    for name in errs:
        errs[name] += list(relative_errors([preds[name](s.prompt, s.features) for s in agents], truth))


def bench_dataset(samples, splits: int, per_type: int, ablation: bool, fresh: dict | None = None,
                  heldout: dict[str, list] | None = None) -> dict:
    """`fresh` (synthetic datasets): per type, agents drawn apart from `samples`, on which each
    split's model and median baseline are scored too. The splits' held-out sets overlap (they
    are drawn from the same 125 agents), so their pooled error varies from one set of splits
    to another (fan_out_research: 0.31-0.42 for single splits, 0.368 over splits 0-4 and 0.319
    over 0-19); a few hundred fresh agents measure the same models with less noise.
    `heldout`, where given, receives every split's held-out runs per type, pooled."""
    types = sorted({s.agent_type for s in samples})
    heldout = {} if heldout is None else heldout
    fresh_errs: dict = {t: {"model": [], "median": []} for t in (fresh or {})}
    by_type = {t: [s for s in samples if s.agent_type == t] for t in types}
    errs = {t: {k: [] for k in PREDICTORS} for t in types}
    train_s = {t: [] for t in types}
    train_n = {t: 0 for t in types}
    lat = {t: [] for t in types}
    kinds = {t: [] for t in types}
    hits = {t: {"p50": [], "p90": []} for t in types}
    for seed in range(splits):
        rng = np.random.default_rng(seed)
        split = {}
        for t in types:
            own = [by_type[t][i] for i in rng.permutation(len(by_type[t]))[:per_type]]
            n_val = max(1, round(0.2 * len(own)))
            split[t] = (own[n_val:], own[:n_val])
        glob = fit_predictor([s for t in types for s in split[t][0]], "*", seed=seed, candidate=PAPER_MLP)
        for t in types:
            train, val = split[t]
            y = [s.cost for s in val]
            p = fit_predictor(train, t, seed=seed)
            train_s[t].append(p.metadata["train_seconds"])
            train_n[t] = len(train)
            kinds[t].append(p.metadata["model"])
            heldout.setdefault(t, []).extend(val)
            for s in val:
                p50, p90 = p.predict_interval(s.prompt, s.features)
                hits[t]["p50"].append(s.cost <= p50)
                hits[t]["p90"].append(s.cost <= p90)
            preds = {
                "model": p.predict,
                "mean": MeanBaseline().fit(train).predict,
                "median": MedianBaseline().fit(train).predict,
                "global": glob.predict,
                "length_linear": LengthLinearBaseline().fit(train).predict,
            }
            if ablation:
                preds["mlp_paper"] = fit_predictor(train, t, seed=seed, candidate=PAPER_MLP).predict
            cold = ColdStartEstimator()
            preds["cold_start_prior"] = cold.for_type(t).predict
            prior = [preds["cold_start_prior"](s.prompt, s.features) for s in val]
            errs[t]["cold_start_prior"] += list(relative_errors(prior, y))
            for s in train:
                cold.observe(t, s.prompt, s.cost, s.features)
            preds["cold_start"] = cold.for_type(t).predict
            for name, fn in preds.items():
                if name == "cold_start_prior":
                    continue
                errs[t][name] += list(relative_errors([fn(s.prompt, s.features) for s in val], y))
            lat[t].append(measure_latency(p.predict, val, min_calls=300))
            if t in fresh_errs:
                _score_fresh(fresh_errs[t], fresh[t], preds)
    out = _report(types, errs, train_s, train_n, lat)
    for t, e in fresh_errs.items():
        out["per_type"][t]["fresh_heldout"] = {"agents": len(fresh[t]), "splits": splits,
                                               **{k: _summ(v) for k, v in e.items()}}
    for t in types:
        row = out["per_type"][t]
        row["kinds_chosen"] = {k: kinds[t].count(k) for k in sorted(set(kinds[t]))}
        row["p50_coverage"] = float(np.mean(hits[t]["p50"]))
        row["p90_coverage"] = float(np.mean(hits[t]["p90"]))
    out["overall"]["p90_coverage"] = float(np.mean([h for t in types for h in hits[t]["p90"]]))
    out["overall"]["p50_coverage"] = float(np.mean([h for t in types for h in hits[t]["p50"]]))
    return out


def _fan_out_costs(prompt: str, width: int, first: int, draws: int) -> np.ndarray:
    """`draws` re-draws of one fan-out agent's cost (its output lengths drawn anew)."""
    from predictors.agent_models import fan_out_research
    from predictors.samples import agent_cost
    from predictors.synthetic import LognormalLengths

    lengths = LognormalLengths()
    return np.array([agent_cost(fan_out_research(prompt, width, lengths, k)[0]) for k in range(first, first + draws)])


def _best_constant(costs: np.ndarray) -> float:
    """The single prediction of least mean relative error against these costs."""
    candidates = np.quantile(costs, np.linspace(0.01, 0.99, 197))
    return float(candidates[int(np.argmin((np.abs(candidates[:, None] - costs) / costs).mean(axis=1)))])


def fan_out_oracle(samples: list, draws: int = 1000) -> float:
    """Mean relative error of a perfect predictor on these `fan_out_research` runs: for
    each, the best single value knowing its prompt and fan-out exactly (from `draws`
    re-draws), scored on the run's real cost. No predictor can expect to do better on the
    same runs; on the benchmark's 5 splits it is 0.335, above the 0.33 target."""
    best: dict[tuple[str, int], float] = {}
    errors = []
    for s in samples:
        key = (s.prompt, int(s.features["fan_out"]))
        if key not in best:
            best[key] = _best_constant(_fan_out_costs(*key, 10_000, draws))
        errors.append(abs(best[key] - s.cost) / s.cost)
    return float(np.mean(errors))


def fan_out_noise_floor(n: int = 100, draws: int = 1000) -> float:
    """The least mean relative error any predictor can expect on `fan_out_research`: for each
    of `n` agents, the best single prediction knowing its prompt and fan-out exactly (chosen
    on `draws` re-draws of its output lengths, the generator's noise, which no feature sees),
    scored on `draws` other re-draws. Scoring on the draws it was chosen on (200 draws of
    60 agents) reads 0.318; out of sample it reads 0.312."""
    scores = []
    for s in synthesize("fan_out_research", n, seed=0):
        key = (s.prompt, int(s.features["fan_out"]))
        best, scored_on = _best_constant(_fan_out_costs(*key, 10_000, draws)), _fan_out_costs(*key, 20_000, draws)
        scores.append(float(np.mean(np.abs(best - scored_on) / scored_on)))
    return float(np.mean(scores))


def independent_sets(types: tuple[str, ...], sets: int, fresh_agents: int = 5000,
                     fresh_seeds: tuple[int, ...] = (77, 78, 79)) -> dict:
    """The strictest measure of the loop types: `sets` predictors, each trained on 100 runs
    of its own (`synthesize(t, 100, seed=1000 + k)`, nothing shared with the others or with
    the benchmark's splits), each scored on `fresh_agents` fresh agents per seed of
    `fresh_seeds`. The mean over 5,000 agents still moves by about 0.004 from one seed to
    the next (relative errors are heavy-tailed), so three seeds are reported."""
    out = {}
    for t in types:
        trainings = [synthesize(t, 100, seed=1000 + k) for k in range(sets)]
        models = [fit_predictor(train, t, seed=k) for k, train in enumerate(trainings)]
        medians = [MedianBaseline().fit(train) for train in trainings]
        row: dict = {"training_sets": sets, "train_samples": 100, "fresh_agents": fresh_agents, "per_seed": {},
                     "kinds_chosen": dict(Counter(p.metadata["model"] for p in models))}
        for fs in fresh_seeds:
            agents = synthesize(t, fresh_agents, seed=fs)
            truth = [s.cost for s in agents]

            def mean_error(predict, agents=agents, truth=truth) -> float:
                return float(np.mean(relative_errors([predict(s.prompt, s.features) for s in agents], truth)))

            model = [mean_error(p.predict) for p in models]
            median = [mean_error(b.predict) for b in medians]
            row["per_seed"][str(fs)] = {"model_mean": float(np.mean(model)), "model_min": min(model),
                                        "model_max": max(model), "median_baseline_mean": float(np.mean(median))}
        seeds = row["per_seed"].values()
        row["model_mean"] = float(np.mean([r["model_mean"] for r in seeds]))
        row["median_baseline_mean"] = float(np.mean([r["median_baseline_mean"] for r in seeds]))
        out[t] = row
    return out


def _report(types: list[str], errs: dict, train_s: dict, train_n: dict, lat: dict) -> dict:
    """Per-type and overall errors, latencies and training times of `bench_dataset`'s splits."""
    out = {"per_type": {}, "overall": {}}
    for t in types:
        row = {"train_samples": train_n[t], "heldout_samples": len(errs[t]["model"]),
               "train_seconds_mean": float(np.mean(train_s[t])), "train_seconds_max": float(np.max(train_s[t])),
               "p50_latency_ms": float(np.median([x["p50_latency_ms"] for x in lat[t]])),
               "p99_latency_ms": float(np.max([x["p99_latency_ms"] for x in lat[t]]))}
        for k in PREDICTORS:
            if errs[t][k]:
                row[k] = _summ(errs[t][k])
        out["per_type"][t] = row
    for k in PREDICTORS:
        pooled = [e for t in types for e in errs[t][k]]
        if pooled:
            out["overall"][k] = _summ(pooled)
    out["overall"]["p50_latency_ms"] = float(np.median([r["p50_latency_ms"] for r in out["per_type"].values()]))
    out["overall"]["p99_latency_ms"] = float(np.max([r["p99_latency_ms"] for r in out["per_type"].values()]))
    hundred = [s for t in types if train_n[t] == 100 for s in train_s[t]]
    out["overall"]["train_seconds_100_samples_max"] = float(max(hundred)) if hundred else None
    out["overall"]["train_seconds_100_samples_mean"] = float(np.mean(hundred)) if hundred else None
    return out


def print_dataset(name: str, res: dict) -> None:
    cols = ("model", "mlp_paper", "mean", "median", "global", "length_linear", "cold_start")
    print(f"\n== {name}: mean relative error on held-out samples (median in brackets)")
    head = (f"{'agent type':18s} " + " ".join(f"{c:>17s}" for c in cols)
            + f" {'p50 ms':>7s} {'p99 ms':>7s} {'train s':>7s} {'cov90':>6s}")
    print(head)
    rows = list(res["per_type"].items()) + [("OVERALL", res["overall"])]
    for t, r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v['mean_relative_error']:7.3f} ({v['median_relative_error']:5.3f})" if v else f"{'-':>17s}")
        tr = r.get("train_seconds_max", r.get("train_seconds_100_samples_max"))
        print(f"{t:18s} " + " ".join(f"{c:>17s}" for c in cells)
              + f" {r['p50_latency_ms']:7.3f} {r['p99_latency_ms']:7.3f} {tr if tr is None else round(tr, 2)!s:>7s}"
              + f" {r['p90_coverage']:6.2f}" + (f"  {r['kinds_chosen']}" if "kinds_chosen" in r else ""))
    for t, r in res["per_type"].items():
        if "fresh_heldout" in r:
            f = r["fresh_heldout"]
            print(f"{t}: on {f['agents']} fresh agents, each split's model {f['model']['mean_relative_error']:.3f}, "
                  f"median baseline {f['median']['mean_relative_error']:.3f}")
        if "oracle_on_heldout" in r:
            print(f"{t}: a perfect predictor on the same held-out runs: {r['oracle_on_heldout']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description="Benchmark the cost predictors.")
    ap.add_argument("--samples", action="append", default=[], metavar="FILE",
                    help="extra samples file(s) to benchmark (JSON Lines)")
    ap.add_argument("--data", default=None, metavar="DIR",
                    help="../shared/data: also build samples from the public data in memory (not written)")
    ap.add_argument("--no-example", action="store_true", help="skip the committed sample files")
    ap.add_argument("--splits", type=int, default=5, help="random train/held-out splits per dataset")
    ap.add_argument("--per-type", type=int, default=125, help="samples per type used (80%% train)")
    ap.add_argument("--no-ablation", action="store_true", help="skip the paper's MLP alone")
    ap.add_argument("--only", action="append", default=[], metavar="DATASET",
                    help="benchmark only this dataset (repeatable): synthetic-example, "
                         "example-agents-profiled, loop-agents, or a --samples file's name")
    ap.add_argument("--independent-sets", type=int, default=10, metavar="K",
                    help="loop agents: also train K predictors on independent training sets and score "
                         "each on 3 x 5,000 fresh agents (0: skip)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "predictors.json"), help="output JSON")
    args = ap.parse_args()

    datasets = {}
    if not args.no_example:
        datasets["synthetic-example"] = (read_samples(EXAMPLE), "predictors/data/example_samples.jsonl.gz")
        datasets["example-agents-profiled"] = (read_samples(PROFILED),
                                               "predictors/data/example_agents_profiled.jsonl.gz")
        datasets["loop-agents"] = ([s for t in LOOP_AGENT_TYPES for s in synthesize(t, 125, seed=0)],
                                   "predictors.synthetic.synthesize(react_loop | fan_out_research, 125, seed 0)")
    for f in args.samples:
        datasets[Path(f).name] = (read_samples(f), f)
    if args.data:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from make_predictor_samples import build

        datasets["public-data"] = (build(Path(args.data), 150, 0),
                                   f"make_predictor_samples.build({args.data}, 150, seed 0)")
    results = {
        "config": {"splits": args.splits, "per_type": args.per_type, "validation_fraction": 0.2,
                   "command": "python " + " ".join(sys.argv)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **library_versions()},
        "datasets": {},
    }
    if args.only:
        datasets = {k: v for k, v in datasets.items() if k in args.only}
    t0 = time.perf_counter()
    for name, (samples, source) in datasets.items():
        fresh = ({t: synthesize(t, FRESH_AGENTS, seed=FRESH_SEED) for t in LOOP_AGENT_TYPES}
                 if name == "loop-agents" else None)
        heldout: dict[str, list] = {}
        res = bench_dataset(samples, args.splits, args.per_type, not args.no_ablation, fresh, heldout)
        res["source"] = source
        if name == "loop-agents":  # what a perfect predictor scores on the same held-out runs
            res["per_type"]["fan_out_research"]["oracle_on_heldout"] = fan_out_oracle(heldout["fan_out_research"])
            res["fan_out_research_noise_floor"] = fan_out_noise_floor()
            print(f"fan_out_research: least mean relative error any predictor can expect "
                  f"(output-length noise): {res['fan_out_research_noise_floor']:.3f}")
            if args.independent_sets > 0:
                res["independent_sets"] = independent_sets(LOOP_AGENT_TYPES, args.independent_sets)
                for t, r in res["independent_sets"].items():
                    print(f"{t}: {r['training_sets']} predictors on independent training sets, on "
                          f"3 x {r['fresh_agents']} fresh agents: " + ", ".join(
                              f"{v['model_mean']:.3f}" for v in r["per_seed"].values())
                          + f" (median baseline {r['median_baseline_mean']:.3f})")
        results["datasets"][name] = res
        print_dataset(name, res)
    ok = {}
    for name, res in results["datasets"].items():
        o = res["overall"]
        per_type = res["per_type"]
        ok[name] = {
            "mean_relative_error<=0.5": o["model"]["mean_relative_error"] <= 0.5,
            "below_mean_baseline": o["model"]["mean_relative_error"] < o["mean"]["mean_relative_error"],
            "p50_latency<=0.5ms": o["p50_latency_ms"] <= 0.5,
            "train_100_samples<=10s": (o["train_seconds_100_samples_max"] or 0) <= 10.0,
            # the predictors' targets, per type: at least 0.02 below the median baseline and at most 0.33
            "below_median_baseline_by_0.02_every_type": all(
                r["model"]["mean_relative_error"] <= r["median"]["mean_relative_error"] - 0.02
                for r in per_type.values()),
            "mean_relative_error<=0.33_every_type": all(
                r["model"]["mean_relative_error"] <= 0.33 for r in per_type.values()),
            # the same two on the fresh agents, where the dataset has them
            "fresh_heldout_targets_every_type": all(
                f["model"]["mean_relative_error"] <= min(0.33, f["median"]["mean_relative_error"] - 0.02)
                for f in fresh) if (fresh := [r["fresh_heldout"] for r in per_type.values()
                                              if "fresh_heldout" in r]) else None,
            # and on every fresh seed with predictors trained on independent sets
            "independent_sets_targets_every_type": all(
                v["model_mean"] <= min(0.33, v["median_baseline_mean"] - 0.02)
                for r in res["independent_sets"].values() for v in r["per_seed"].values())
            if "independent_sets" in res else None,
            "p90_coverage_in_0.80-0.95": 0.80 <= o["p90_coverage"] <= 0.95,
            # per type: the baselines (and cold start) whose mean error is below the model's
            "model_beaten_by": {
                t: [k for k in ("mean", "median", "global", "length_linear", "cold_start")
                    if r[k]["mean_relative_error"] < r["model"]["mean_relative_error"]]
                for t, r in per_type.items()
            },
        }
    results["targets"] = ok
    results["bench_seconds"] = time.perf_counter() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, results, indent=2)
    print("\ntargets:", json.dumps(ok, indent=1))
    print(f"wrote {args.json} ({results['bench_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
