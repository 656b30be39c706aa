"""Simulate again each run of a `bench family --live` result on other step models.

Each live run's workload is rebuilt as the run built it (the shape, seed, agent count and
load of the file's config, sized with the profile the run used, a taught member's clock at
the run's own offset), then simulated on each profile given, and its mean JCT compared with
the live one. It answers "would the simulator have been within 15% of these runs on that
profile?" without running the engine again.

    python benchmarks/family_resim.py benchmarks/results/family_live_104_repeats.json \
        calibrated=run calibrated+chunked=run+chunked refit=refit refit+chunked=refit+chunked

A profile is `NAME=SOURCE[+chunked][+turnaround=S]`. SOURCE is a `bench calibrate` file or
a built-in name; `xF`: the run's own profile with every term of its step time F times
longer; `run`: the run's own profile; `refit`: each run's engine as the server fitted it to
the run's own steps (`engine_fit`). `+chunked` adds the chunked-prefill term of prompts
longer than the engine's step budget (server/shared/profiles.py), as `bench calibrate` fits
it now to the grid points of the run's profile file (`--chunk-tokens`: the budget, where the
file does not record it). `+turnaround=S` has the simulator wait S seconds, the client's
turnaround, before each later stage of an agent (the profile's `stage_turnaround_s`); with
`S` = `run`, the turnaround the server measured during each run (`stage_turnaround_s` of the
run, recorded since the simulator models it; a run whose every stage boundary was a pause
measured none and keeps the profile's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable

from server.shared.profiles import EngineProfile, load_profile
from server.sim.calibrate import GridPoint, fit_chunked_prefill
from server.sim.family import simulate_member
from server.sim.provenance import write_result
from server.sim.shapes import ShapeSpec

WITHIN = 0.15
VLLM_CPU_CHUNK_TOKENS = 2048  # vLLM's max_num_batched_tokens for the server on the CPU

ProfileOf = Callable[[dict], EngineProfile]


def chunked(profile: EngineProfile, calibration: dict, chunk_tokens: int) -> EngineProfile:
    """`profile` with the chunked-prefill term fitted to a calibration file's grid points."""
    chunk = int((calibration.get("settings") or {}).get("max_num_batched_tokens") or chunk_tokens)
    points = [(GridPoint(p["batch"], p["prompt"], p["output"]), p["seconds"])
              for p in (calibration.get("fit") or {}).get("points", [])]
    return fit_chunked_prefill(points, profile, chunk)


def refitted(run_profile: EngineProfile, run: dict) -> EngineProfile:
    fit = run.get("engine_fit")
    if not fit:
        raise SystemExit(f"{run['shape']} seed {run['seed']} {run['mode']}: no engine_fit to refit with")
    return dataclasses.replace(run_profile, base_s=fit["base_s"], per_seq_s=fit["per_seq_s"],
                               per_prefill_token_s=fit["per_prefill_token_s"], per_kv_token_s=fit["per_kv_token_s"])


def additions_of(spec: str, additions: list[str]) -> tuple[bool, str | None]:
    """A profile's additions: whether it adds the chunked-prefill term, and its turnaround
    (seconds as text, `run`, or None)."""
    turnaround: str | None = None
    for extra in additions:
        if extra.startswith("turnaround="):
            turnaround = extra.removeprefix("turnaround=")
        elif extra != "chunked":
            raise SystemExit(f"{spec!r}: the additions are +chunked and +turnaround=S")
    if turnaround not in (None, "run"):
        try:
            float(turnaround)
        except ValueError:
            raise SystemExit(f"{spec!r}: a turnaround is seconds or `run`") from None
    return "chunked" in additions, turnaround


def turned_around(profile: EngineProfile, turnaround: str | None, run: dict) -> EngineProfile:
    """`profile` waiting `turnaround` before each later stage (`run`: the run's own)."""
    if turnaround is None:
        return profile
    if turnaround == "run":
        if "stage_turnaround_s" not in run:
            raise SystemExit(f"{run['shape']} seed {run['seed']} {run['mode']}: the run recorded no turnaround")
        if run["stage_turnaround_s"] is None:  # every stage boundary a pause: none measured
            return profile
        return dataclasses.replace(profile, stage_turnaround_s=float(run["stage_turnaround_s"]))
    return dataclasses.replace(profile, stage_turnaround_s=float(turnaround))


def profile_of(spec: str, run_profile: EngineProfile, calibration: dict, chunk_tokens: int) -> tuple[str, ProfileOf]:
    name, _, value = spec.partition("=")
    if not name or not value:
        raise SystemExit(f"a profile is NAME=SOURCE[+chunked][+turnaround=S], not {spec!r}")
    source, *additions = value.split("+")
    with_chunked, turnaround = additions_of(spec, additions)
    term = chunked(run_profile, calibration, chunk_tokens) if with_chunked else None

    def finish(profile: EngineProfile, run: dict) -> EngineProfile:
        if term is not None:
            profile = dataclasses.replace(profile, prefill_chunk_tokens=term.prefill_chunk_tokens,
                                          per_chunked_prefill_s=term.per_chunked_prefill_s)
        return turned_around(profile, turnaround, run)

    if source == "refit":
        return name, lambda run: finish(refitted(run_profile, run), run)
    if source == "run":
        fixed = run_profile
    elif source.startswith("x"):
        fixed = run_profile.scaled(float(source[1:]))
    else:
        fixed = load_profile(source)
    return name, lambda run: finish(fixed, run)


def resimulate(doc: dict, profiles: dict[str, ProfileOf]) -> list[dict]:
    cfg = doc["config"]
    sized = load_profile(cfg["profile_file"]["file"])
    rows = []
    for run in doc["runs"]:
        spec = ShapeSpec(run["shape"], cfg["agents"], cfg["load"], run["seed"])
        live = run["live"]["mean_jct_s"]
        row = {"shape": run["shape"], "seed": run["seed"], "mode": run["mode"], "live_mean_jct_s": live, "sim": {}}
        for name, profile_for in profiles.items():
            [result] = simulate_member(spec, run["mode"], ["justitia"], profile_for(run), cfg["kv_tokens"],
                                       run["teach_offset_s"], sized_with=sized)
            row["sim"][name] = result.summary()["mean_jct_s"]
            row[name] = row["sim"][name] / live - 1.0
        rows.append(row)
    return rows


def members_within(rows: list[dict], name: str) -> tuple[int, int]:
    """Of the members (shape, seed, mode) run once or more: how many have the median of
    their simulated mean JCTs within WITHIN of the median of their live ones."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["seed"], r["mode"]), []).append(r)
    within = 0
    for mine in groups.values():
        live = statistics.median(r["live_mean_jct_s"] for r in mine)
        sim = statistics.median(r["sim"][name] for r in mine)
        within += abs(sim / live - 1.0) <= WITHIN
    return within, len(groups)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family_json", help="a `bench family --live --json` file")
    ap.add_argument("profiles", nargs="+", help="NAME=SOURCE[+chunked][+turnaround=S] (see above)")
    ap.add_argument("--profile-file", metavar="FILE", default=None,
                    help="the run's profile file, where it has moved since the run (default: the path the "
                         "file's config records)")
    ap.add_argument("--json", metavar="OUT", default=None, help="write the rows and the counts here")
    ap.add_argument("--chunk-tokens", type=int, default=VLLM_CPU_CHUNK_TOKENS,
                    help="the engine's token budget per step, where the calibration file does not record it "
                         "(default: %(default)s, vLLM's for the server on the CPU)")
    args = ap.parse_args(argv)
    doc = json.load(open(args.family_json))
    profile_file = args.profile_file or doc["config"]["profile_file"]["file"]
    doc["config"]["profile_file"]["file"] = profile_file  # the workloads are sized with it
    run_profile = load_profile(profile_file)
    calibration = json.load(open(profile_file))
    profiles = dict(profile_of(p, run_profile, calibration, args.chunk_tokens) for p in args.profiles)
    rows = resimulate(doc, profiles)
    for row in rows:
        errors = "  ".join(f"{n} {100 * row[n]:+.0f}%" for n in profiles)
        print(f"{row['shape']:10s} {row['seed']} {row['mode']:6s} live {row['live_mean_jct_s']:.2f} s  {errors}")
    counts = {}
    for name in profiles:
        within = sum(abs(r[name]) <= WITHIN for r in rows)
        median = statistics.median(r[name] for r in rows)
        members, of = members_within(rows, name)
        counts[name] = {"runs_within": within, "runs": len(rows), "median_error": median,
                        "members_within": members, "members": of}
        print(f"{name}: simulator within {WITHIN:.0%} of {within} of {len(rows)} live runs "
              f"(median error {100 * median:+.0f}%); of the median of each member's runs: "
              f"{members} of {of}")
    if args.json:
        write_result(args.json, {"config": {"family_json": args.family_json, "profile_file": profile_file,
                                            "profiles": args.profiles, "within": WITHIN},
                                 "rows": rows, "counts": counts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
