"""Retention of paused agents' contexts on the simulator (A100-class profile).

The 300-agent mix with tool pauses (lognormal, median 0.8 s) and resent conversations
(`make-workload --tools multi-turn`, server/sim/talk.py), and the same mix without multi-turn
agents (`--tools single-turn`). Per seed: justitia with `--retain auto` and `always`,
justitia-noretain, and vtc; the ratios the retention targets are stated in.

Tuning: the horizon's scale (retention.HORIZON_SCALE, the break-even pause times it) is chosen
on the tuning seeds (best mean JCT of auto over noretain, multi-turn mix); the held-out seeds
are then run with that scale only. Writes benchmarks/results/retention_sim.json.

    .venv/bin/python benchmarks/retention_sim.py [--tune-seeds 0,1] [--seeds 2,3,4,5,6]

On the held-out multi-turn runs it also measures the ceiling of any retention rule (`bound`:
every context kept through every pause at no memory cost) and the share of the run that
re-prefill costs the engine without retention: what retention can save at most.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import server.scheduler.retention as retention  # noqa: E402
from server.shared.profiles import get_profile  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402
from server.sim.retain import SimRetention  # noqa: E402
from server.sim.simulator import run_comparison  # noqa: E402
from server.sim.talk import make_talk_mix  # noqa: E402

PROFILE = "a100-llama7b"


@contextlib.contextmanager
def _free_pins() -> Iterator[None]:
    """The ceiling of any retention rule: contexts kept through every pause at no memory
    cost (the engine's capacity grows by what is pinned while it is pinned)."""
    pause, let_go = SimRetention.pause, SimRetention._let_go

    def free_pause(self: SimRetention, agent_id: str, agent_type: str, now: float) -> None:
        pause(self, agent_id, agent_type, now)
        if (held := self.pins.get(agent_id)) is not None:
            self.engine.capacity += held.tokens

    def free_let_go(self: SimRetention, agent_id: str, held, keys: list[str], now: float) -> None:  # noqa: ANN001
        self.engine.capacity -= sum(held.keys[k][0] for k in keys)
        let_go(self, agent_id, held, keys, now)

    SimRetention.pause, SimRetention._let_go = free_pause, free_let_go  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimRetention.pause, SimRetention._let_go = pause, let_go  # type: ignore[method-assign]


def _one(seed: int, load: float, multi_turn: bool, policies: list[str], bound: bool = False) -> dict:
    profile = get_profile(PROFILE)
    agents = make_talk_mix(300, profile, seed=seed, load=load, multi_turn=multi_turn)
    out: dict = {}
    if bound:
        with _free_pins():
            [r] = run_comparison(agents, ["justitia"], profile, retain="always")
        s = r.summary()
        out["bound-free-pins"] = {k: s[k] for k in ("mean_jct_s", "p90_jct_s", "reprefill_tokens", "promises_kept")}
    for mode in ("auto", "always"):
        pols = policies if mode == "auto" else ["justitia"]
        for r in run_comparison(agents, pols, profile, retain=mode):
            s = r.summary()
            name = r.policy if r.policy != "justitia" else f"justitia-{mode}"
            out[name] = {k: s[k] for k in ("mean_jct_s", "p90_jct_s", "reprefill_tokens", "promises_kept",
                                           "preemptions", "makespan_s")} | {k: s.get(k) for k in (
                                               "retained_kv_token_s", "retention_yields", "retention_pins_broken")}
    out["agents"] = len(agents)
    none = out.get("justitia-noretain")
    if none is not None:  # what re-prefill costs the engine without retention, against the run
        out["noretain_reprefill_s"] = none["reprefill_tokens"] * profile.per_prefill_token_s
        out["noretain_makespan_s"] = none["makespan_s"]
    out["resending_agents"] = sum(bool(a.ctxs) for a in agents)
    return out


def _ratios(r: dict) -> dict:
    auto, none, vtc = r["justitia-auto"], r["justitia-noretain"], r.get("vtc")
    out = {
        "auto_over_noretain_mean": auto["mean_jct_s"] / none["mean_jct_s"],
        "auto_over_noretain_p90": auto["p90_jct_s"] / none["p90_jct_s"],
        "auto_over_noretain_reprefill": (auto["reprefill_tokens"] / none["reprefill_tokens"]
                                         if none["reprefill_tokens"] else None),
        "always_over_noretain_mean": r["justitia-always"]["mean_jct_s"] / none["mean_jct_s"],
    }
    if vtc:
        out["auto_over_vtc_mean"] = auto["mean_jct_s"] / vtc["mean_jct_s"]
    if bound := r.get("bound-free-pins"):
        out["bound_over_noretain_mean"] = bound["mean_jct_s"] / none["mean_jct_s"]
        out["bound_over_noretain_p90"] = bound["p90_jct_s"] / none["p90_jct_s"]
    if "noretain_reprefill_s" in r:
        out["noretain_reprefill_share"] = r["noretain_reprefill_s"] / r["noretain_makespan_s"]
    return out


def _median(rows: list[dict], key: str) -> float | None:
    xs = [r["ratios"][key] for r in rows if r["ratios"].get(key) is not None]
    return statistics.median(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune-seeds", default="0,1")
    ap.add_argument("--seeds", default="2,3,4,5,6", help="held-out seeds")
    ap.add_argument("--load", type=float, default=1.2, help="offered load over the arrivals' span")
    ap.add_argument("--scales", default="0.5,1,2", help="horizon scales tried on the tuning seeds")
    ap.add_argument("--out", default="benchmarks/results/retention_sim.json")
    args = ap.parse_args()
    tune = [int(s) for s in args.tune_seeds.split(",") if s]
    held = [int(s) for s in args.seeds.split(",") if s]
    scales = [float(x) for x in args.scales.split(",")]

    tuning: dict[str, list] = {}
    for scale in scales:
        retention.HORIZON_SCALE = scale
        rows = []
        for seed in tune:
            r = _one(seed, args.load, True, ["justitia", "justitia-noretain"])
            rows.append({"seed": seed, "results": r, "ratios": _ratios(r)})
        tuning[str(scale)] = rows
        print(f"tune scale {scale}: auto/noretain mean "
              f"{_median(rows, 'auto_over_noretain_mean'):.3f}", flush=True)
    chosen = min(scales, key=lambda sc: _median(tuning[str(sc)], "auto_over_noretain_mean") or 9.0)
    retention.HORIZON_SCALE = chosen

    held_multi, held_single = [], []
    for seed in held:
        r = _one(seed, args.load, True, ["justitia", "justitia-noretain", "vtc"], bound=True)
        held_multi.append({"seed": seed, "results": r, "ratios": _ratios(r)})
        r1 = _one(seed, args.load, False, ["justitia", "justitia-noretain"])
        held_single.append({"seed": seed, "results": r1, "ratios": _ratios(r1)})
        print(f"seed {seed}: multi {held_multi[-1]['ratios']}  single {held_single[-1]['ratios']}", flush=True)

    summary = {
        "horizon_scale": chosen,
        "multi_turn": {k: _median(held_multi, k) for k in held_multi[0]["ratios"]},
        "single_turn": {k: _median(held_single, k) for k in held_single[0]["ratios"]},
        # every agent's promise kept, per policy, on every held-out run
        "promises_kept_all": {name: all(r["results"][name]["promises_kept"] == r["results"]["agents"]
                                        for r in held_multi + held_single if name in r["results"])
                              for name in ("justitia-auto", "justitia-always", "justitia-noretain", "vtc")},
    }
    print("held-out medians:", summary)
    write_result(args.out, {"config": {"profile": PROFILE, "agents": 300, "load": args.load,
                                       "tune_seeds": tune, "held_out_seeds": held, "scales": scales},
                            "summary": summary, "tuning": tuning,
                            "held_out": {"multi_turn": held_multi, "single_turn": held_single}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
