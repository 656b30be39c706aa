"""Simulate again each run of a `bench family --live` result on other step models.

Each live run's workload is rebuilt as the run built it (the shape, seed, agent count and
load of the file's config, sized with the profile the run used, a taught member's clock at
the run's own offset), then simulated on each profile given, and its mean JCT compared with
the live one. It answers "would the simulator have been within 15% of these runs on that
profile?" without running the engine again.

    python benchmarks/family_resim.py benchmarks/results/family_live_all.json \
        engine-alone=x0.877

A profile is `NAME=FILE` (a `bench calibrate` file or a built-in name) or `NAME=xF` (the
run's own profile with every term of its step time F times longer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from server.shared.profiles import EngineProfile, load_profile
from server.sim.family import simulate_member
from server.sim.shapes import ShapeSpec

WITHIN = 0.15


def profile_of(spec: str, run_profile: EngineProfile) -> tuple[str, EngineProfile]:
    name, _, value = spec.partition("=")
    if not name or not value:
        raise SystemExit(f"a profile is NAME=FILE or NAME=xF, not {spec!r}")
    if value.startswith("x"):
        f = float(value[1:])
        return name, dataclasses.replace(
            run_profile, base_s=run_profile.base_s * f, per_seq_s=run_profile.per_seq_s * f,
            per_prefill_token_s=run_profile.per_prefill_token_s * f,
            per_kv_token_s=run_profile.per_kv_token_s * f)
    return name, load_profile(value)


def resimulate(doc: dict, profiles: dict[str, EngineProfile]) -> list[dict]:
    cfg = doc["config"]
    sized = load_profile(cfg["profile_file"]["file"])
    rows = []
    for run in doc["runs"]:
        spec = ShapeSpec(run["shape"], cfg["agents"], cfg["load"], run["seed"])
        live = run["live"]["mean_jct_s"]
        row = {"shape": run["shape"], "seed": run["seed"], "mode": run["mode"], "live_mean_jct_s": live}
        for name, profile in profiles.items():
            [result] = simulate_member(spec, run["mode"], ["justitia"], profile, cfg["kv_tokens"],
                                       run["teach_offset_s"], sized_with=sized)
            row[name] = result.summary()["mean_jct_s"] / live - 1.0
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family_json", help="a `bench family --live --json` file")
    ap.add_argument("profiles", nargs="+", help="NAME=FILE or NAME=xF (see above)")
    args = ap.parse_args(argv)
    doc = json.load(open(args.family_json))
    run_profile = load_profile(doc["config"]["profile_file"]["file"])
    profiles = dict(profile_of(p, run_profile) for p in args.profiles)
    rows = resimulate(doc, profiles)
    for row in rows:
        errors = "  ".join(f"{n} {100 * row[n]:+.0f}%" for n in profiles)
        print(f"{row['shape']:10s} {row['seed']} {row['mode']:6s} live {row['live_mean_jct_s']:.2f} s  {errors}")
    for name in profiles:
        within = sum(abs(r[name]) <= WITHIN for r in rows)
        print(f"{name}: simulator within {WITHIN:.0%} of {within} of {len(rows)} live runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
