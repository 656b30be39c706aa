"""Where the embedded server runs: its own session, or a process group in the caller's.

Linux's autogroup scheduler shares the CPU between sessions. With the server (and its vLLM
CPU engine, whose processes spin while the model computes) in a session of its own, other
processes on a 2-core machine were starved for seconds while a stream was generated. This
script measures it, both ways, side by side:

    # a probe process sleeps 10 ms at a time during each 4,000-token stream and reports how
    # late it woke up at worst
    python benchmarks/session_placement.py probe --streams 6 --json benchmarks/results/session_probe.json

    # `bench live` on contended48 (justitia, vtc), alternating the two placements
    python benchmarks/session_placement.py live --rounds 2 --out-dir benchmarks/results

`own` starts the server in a session of its own (start_new_session=True); `caller` in a
process group of its own within the caller's session (process_group=0), as `EmbeddedServer`
does.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.streams, as the tests use it
from server.sim.provenance import write_result  # noqa: E402

PROBE = """
import sys, time
t0 = last = time.monotonic(); worst = 0.0
while time.monotonic() - t0 < float(sys.argv[1]):
    time.sleep(0.01); now = time.monotonic(); worst = max(worst, now - last - 0.01); last = now
print(f"{worst:.3f}")
"""
PLACEMENTS = ("own", "caller")


@contextmanager
def placement(where: str) -> Iterator[None]:
    """Start servers in their own session (`own`) or in the caller's (`caller`, the default)."""
    if where == "caller":
        yield
        return
    original = subprocess.Popen

    def own_session(*args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.pop("process_group", None)
        return original(*args, start_new_session=True, **kwargs)

    subprocess.Popen = own_session  # type: ignore[misc]
    try:
        yield
    finally:
        subprocess.Popen = original  # type: ignore[misc]


def probe_streams(where: str, streams: int) -> list[float]:
    import httpx

    from server.launcher import EmbeddedServer
    from tests.support.streams import BackgroundStream

    args = ["--kv-tokens", "4096", "--max-model-len", "4096", "--max-num-seqs", "1"]
    worst = []
    with placement(where), EmbeddedServer(args) as srv, httpx.Client(base_url=srv.url, timeout=180) as c:
        for _ in range(streams):
            probe = subprocess.Popen([sys.executable, "-c", PROBE, "6"], stdout=subprocess.PIPE, text=True)
            stream = BackgroundStream(lambda: c.stream("POST", "/v1/completions", json={
                "prompt": [5] * 10, "max_tokens": 4000, "ignore_eos": True, "stream": True}))
            worst.append(float(probe.communicate()[0]))
            stream.join(60)
    return worst


def run_probe(args: argparse.Namespace) -> dict:
    out: dict = {"streams": args.streams, "placements": {}}
    for where in PLACEMENTS:
        worst = probe_streams(where, args.streams)
        late = [w for w in worst if w > 0.5]
        out["placements"][where] = {"worst_wakeup_delay_s": worst, "streams_over_0_5_s": len(late),
                                    "median_s": statistics.median(worst)}
        print(f"{where:>6}: worst wake-up delay per stream {worst}; over 0.5 s in {len(late)} of {len(worst)}",
              flush=True)
    return out


def run_live(args: argparse.Namespace) -> dict:
    import justitia_cli

    out: dict = {"rounds": []}
    for r in range(1, args.rounds + 1):
        for where in PLACEMENTS:
            path = Path(args.out_dir) / f"live_contended48_session7_{where}_{r}.json"
            with placement(where):
                justitia_cli.main(["bench", "live", "--workload", "benchmarks/workloads/contended48.jsonl",
                                   "--policies", "justitia,vtc", "--kv-tokens", "4096", "--max-model-len", "4096",
                                   "--profile", "benchmarks/results/profile_cpu_tiny_4096_epyc.json",
                                   "--json", str(path)])
            out["rounds"].append({"round": r, "placement": where, "result": str(path)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("probe", help="a sleeping probe's worst wake-up delay during each stream")
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--json", help="write the figures here")
    live = sub.add_parser("live", help="bench live on contended48, the two placements alternated")
    live.add_argument("--rounds", type=int, default=2)
    live.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    result = run_probe(args) if args.what == "probe" else run_live(args)
    if getattr(args, "json", None):
        write_result(args.json, result, indent=1)


if __name__ == "__main__":
    main()
