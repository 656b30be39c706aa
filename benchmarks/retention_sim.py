"""Retention of paused agents' contexts on the simulator (A100-class profile).

Three 300-agent mixes with tool pauses (lognormal, median 0.8 s), server/sim/talk.py:
the mix whose ReAct and chat agents resend their conversation (`make-workload --tools
multi-turn`) and the same mix without them (`--tools single-turn`), both at `--load`; and
the agentic mix (`--tools agentic`: half the agents function-calling agents in a tool loop
resending their growing conversation every turn) at `--agentic-load`, where the engine is
saturated (arrivals end well before the work does), and at `--load` too. Per seed: justitia
with `--retain auto` and `always`, justitia-noretain, and vtc; the ratios the retention
targets are stated in.

Tuning: the horizon's scale (retention.HORIZON_SCALE, the break-even pause times it) and the
wait before a kept context gives way (retention.YIELD_WAIT, times its prefill) are chosen on
the tuning seeds: the pair with the best mean JCT of auto over noretain, averaged over the
multi-turn mix and the agentic mix at its load. The held-out seeds are then run with that pair
only. Writes benchmarks/results/retention_sim.json.

    .venv/bin/python benchmarks/retention_sim.py [--tune-seeds 0,1] [--seeds 2,3,4,5,6]

On the held-out multi-turn and agentic runs it also measures the ceiling of any retention rule
(`bound`: every context kept through every pause at no memory cost) and the share of the run
that re-prefill costs the engine without retention (what retention can save at most), beside
the share that prefilling every resent conversation again would cost (`resent_share`).
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
from server.sim.talk import AGENTIC_SHARE, make_agentic_mix, make_talk_mix  # noqa: E402

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


def _agents(mix: str, seed: int, load: float) -> list:
    profile = get_profile(PROFILE)
    if mix == "agentic":
        return make_agentic_mix(300, profile, seed=seed, load=load)
    return make_talk_mix(300, profile, seed=seed, load=load, multi_turn=mix == "multi-turn")


def _one(seed: int, load: float, mix: str, policies: list[str], bound: bool = False) -> dict:
    profile = get_profile(PROFILE)
    agents = _agents(mix, seed, load)
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
            kept = ("mean_jct_s", "p90_jct_s", "reprefill_tokens", "promises_kept", "promises_broken_by_tools",
                    "preemptions", "makespan_s")
            out[name] = {k: s[k] for k in kept} | {k: s.get(k) for k in (
                "retained_kv_token_s", "retention_yields", "retention_pins_broken")}
    out["agents"] = len(agents)
    # what the resent conversations would cost the engine if every one were prefilled again
    out["resent_tokens"] = sum(chain[-1][1] for a in agents for key, chain in a.prefixes.items()
                               if chain and a.ctxs.get(key) == chain[-1][0])
    none = out.get("justitia-noretain")
    if none is not None:  # what re-prefill costs the engine without retention, against the run
        out["noretain_reprefill_s"] = none["reprefill_tokens"] * profile.per_prefill_token_s
        out["noretain_makespan_s"] = none["makespan_s"]
        out["resent_prefill_s"] = out["resent_tokens"] * profile.per_prefill_token_s
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
        out["resent_share"] = r["resent_prefill_s"] / r["noretain_makespan_s"]
    return out


def _median(rows: list[dict], key: str) -> float | None:
    xs = [r["ratios"][key] for r in rows if r["ratios"].get(key) is not None]
    return statistics.median(xs) if xs else None


def _summary(rows: list[dict]) -> dict:
    """Per ratio: the median over the seeds, and [min, max] under `range`."""
    keys = list(rows[0]["ratios"])
    out: dict = {k: _median(rows, k) for k in keys}
    out["range"] = {k: [min(xs), max(xs)] for k in keys
                    if (xs := [r["ratios"][k] for r in rows if r["ratios"].get(k) is not None])}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tune-seeds", default="0,1")
    ap.add_argument("--seeds", default="2,3,4,5,6", help="held-out seeds")
    ap.add_argument("--load", type=float, default=1.2, help="offered load over the arrivals' span")
    ap.add_argument("--agentic-load", type=float, default=2.0, help="offered load of the agentic mix")
    ap.add_argument("--scales", default="0.5,1,2", help="horizon scales tried on the tuning seeds")
    ap.add_argument("--yield-waits", default="1,4,16", help="yield waits tried on the tuning seeds")
    ap.add_argument("--out", default="benchmarks/results/retention_sim.json")
    args = ap.parse_args()
    tune = [int(s) for s in args.tune_seeds.split(",") if s]
    held = [int(s) for s in args.seeds.split(",") if s]
    scales = [float(x) for x in args.scales.split(",")]
    waits = [float(x) for x in args.yield_waits.split(",")]
    tuned_on = (("multi_turn", "multi-turn", args.load), ("agentic", "agentic", args.agentic_load))

    tuning: dict[str, dict[str, list]] = {}
    score: dict[tuple[float, float], float] = {}
    for scale in scales:
        for wait in waits:
            retention.HORIZON_SCALE, retention.YIELD_WAIT = scale, wait
            name = f"scale {scale:g}, yield wait {wait:g}"
            tuning[name] = {}
            for key, mix, load in tuned_on:
                rows = []
                for seed in tune:
                    r = _one(seed, load, mix, ["justitia", "justitia-noretain"])
                    rows.append({"seed": seed, "results": r, "ratios": _ratios(r)})
                tuning[name][key] = rows
            score[(scale, wait)] = statistics.mean(_median(tuning[name][k], "auto_over_noretain_mean") or 9.0
                                                   for k, _, _ in tuned_on)
            print(f"tune {name}: auto/noretain mean " + ", ".join(
                f"{k} {_median(tuning[name][k], 'auto_over_noretain_mean'):.3f}" for k, _, _ in tuned_on), flush=True)
    chosen, chosen_wait = min(score, key=lambda sw: score[sw])
    retention.HORIZON_SCALE, retention.YIELD_WAIT = chosen, chosen_wait

    runs = {  # name -> (mix, load, policies, with the ceiling)
        "multi_turn": ("multi-turn", args.load, ["justitia", "justitia-noretain", "vtc"], True),
        "single_turn": ("single-turn", args.load, ["justitia", "justitia-noretain"], False),
        "agentic": ("agentic", args.agentic_load, ["justitia", "justitia-noretain", "vtc"], True),
        "agentic_at_load": ("agentic", args.load, ["justitia", "justitia-noretain", "vtc"], True),
    }
    held_out: dict[str, list[dict]] = {k: [] for k in runs}
    for seed in held:
        for name, (mix, load, pols, bound) in runs.items():
            r = _one(seed, load, mix, pols, bound=bound)
            held_out[name].append({"seed": seed, "results": r, "ratios": _ratios(r)})
            print(f"seed {seed} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in held_out[name][-1]["ratios"].items()
                                                      if v is not None), flush=True)

    summary = {
        "horizon_scale": chosen,
        "yield_wait": chosen_wait,
        **{name: _summary(rows) for name, rows in held_out.items()},
        # every agent's promise kept, per policy, on every held-out run
        "promises_kept_all": {name: all(r["results"][name]["promises_kept"] == r["results"]["agents"]
                                        for rows in held_out.values() for r in rows if name in r["results"])
                              for name in ("justitia-auto", "justitia-always", "justitia-noretain", "vtc")},
    }
    print("held-out medians:", {k: v for k, v in summary.items()})
    write_result(args.out, {"config": {"profile": PROFILE, "agents": 300, "load": args.load,
                                       "agentic_load": args.agentic_load, "agentic_share": AGENTIC_SHARE,
                                       "tune_seeds": tune, "held_out_seeds": held, "scales": scales,
                                       "yield_waits": waits},
                            "summary": summary, "tuning": tuning, "held_out": held_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
