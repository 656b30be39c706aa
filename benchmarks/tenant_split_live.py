"""A tenant that splits its work, live: an honest tenant beside a flooding tenant on a real
`justitia serve` (vLLM CPU engine, tiny model).

The honest tenant runs `--honest` agents (4 stages of two parallel requests of ~200 prompt
tokens + 32 output tokens, `stages: 4` declared), one every second, while the flooding
tenant keeps `--in-flight` requests of ~300 + 60 tokens going, shaped as:

- `one`: all of them on one agent;
- `split`: a new agent per request (registered, run, finished);
- `untagged`: plain OpenAI requests (the server makes a one-request agent of each);

and `alone`, no flood at all. Per shape: the honest agents' mean and largest JCT, their
largest deadline (`deadline_s` promised at registration), promises kept, and the ratios of
`split` and `untagged` against `one` (the contract: at most 1.5x, since the fair share is
the tenant's, however it splits its work). Writes benchmarks/results/tenant_split_live.json.

    PYTHONPATH=. .venv/bin/python benchmarks/tenant_split_live.py [--honest 3] [--in-flight 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

KEYS = {"honest": "key-honest", "flood": "key-flood"}
SHAPES = ("alone", "one", "split", "untagged")
HONEST_PROMPT = "the honest tenant asks a question about a long document " * 20
FLOOD_PROMPT = "the flooding tenant sends a great deal of text to the engine " * 28


def _client(url: str, tenant: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                             headers={"Authorization": f"Bearer {KEYS[tenant]}"})


async def _flood(url: str, shape: str, in_flight: int, stop: asyncio.Event) -> dict:
    body = {"prompt": FLOOD_PROMPT, "max_tokens": 60, "ignore_eos": True}
    done = failed = 0
    async with _client(url, "flood") as c:
        one = None
        if shape == "one":
            one = (await c.post("/v1/agents", json={"type": "flood", "prompt": "x"})).json()["id"]

        async def worker() -> None:
            nonlocal done, failed
            while not stop.is_set():
                agent = one
                if shape == "split":
                    agent = (await c.post("/v1/agents", json={"type": "flood", "prompt": "x"})).json()["id"]
                headers = {"X-Justitia-Agent": agent} if agent else {}
                r = await c.post("/v1/completions", json=body, headers=headers)
                done += r.status_code == 200
                failed += r.status_code != 200
                if shape == "split":
                    await c.post(f"/v1/agents/{agent}/finish")

        await asyncio.gather(*(worker() for _ in range(in_flight)))
        if one is not None:
            await c.post(f"/v1/agents/{one}/finish")
    return {"flood_requests_done": done, "flood_requests_failed": failed}


async def _honest_agent(c: httpx.AsyncClient, k: int) -> dict:
    started = time.monotonic()
    rec = (await c.post("/v1/agents", json={"type": "honest", "prompt": HONEST_PROMPT,
                                             "metadata": {"stages": 4}})).json()
    headers = {"X-Justitia-Agent": rec["id"]}
    for stage in range(4):
        answers = await asyncio.gather(*(c.post("/v1/completions", headers=headers, json={
            "prompt": f"{HONEST_PROMPT} stage {stage} part {p} agent {k}", "max_tokens": 32,
            "ignore_eos": True}) for p in range(2)))
        for r in answers:
            r.raise_for_status()
    end = (await c.post(f"/v1/agents/{rec['id']}/finish")).json()
    jct = time.monotonic() - started
    return {"jct_s": jct, "deadline_s": rec["deadline_s"], "promise": rec["promise"],
            "kept": end["state"] == "finished" and jct <= rec["deadline_s"]}


async def _run_shape(url: str, shape: str, honest: int, in_flight: int) -> dict:
    stop = asyncio.Event()
    flood = asyncio.create_task(_flood(url, shape, in_flight, stop)) if shape != "alone" else None
    await asyncio.sleep(2.0 if flood else 0.0)  # the flood is under way
    async with _client(url, "honest") as c:
        async def later(k: int) -> dict:
            await asyncio.sleep(1.0 * k)
            return await _honest_agent(c, k)

        agents = await asyncio.gather(*(later(k) for k in range(honest)))
    stop.set()
    flooded = await flood if flood is not None else {}
    jcts = [a["jct_s"] for a in agents]
    return {"shape": shape, "honest_mean_jct_s": round(statistics.fmean(jcts), 3),
            "honest_max_jct_s": round(max(jcts), 3),
            "honest_max_deadline_s": round(max(a["deadline_s"] for a in agents), 3),
            "honest_promises_kept": sum(a["kept"] for a in agents), "honest_agents": honest,
            "promises": [a["promise"] for a in agents], **flooded}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--honest", type=int, default=3, help="honest agents per shape (default 3)")
    ap.add_argument("--in-flight", type=int, default=32, help="the flood's requests in flight (default 32)")
    ap.add_argument("--rounds", type=int, default=1, help="every shape this many times (medians reported)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/tenant_split_live.json")
    args = ap.parse_args()
    server_args = ["--kv-tokens", "4096", "--max-model-len", "2048"]
    for tenant, key in KEYS.items():
        server_args += ["--api-key", f"{tenant}={key}"]
    runs: list[dict] = []
    with EmbeddedServer(server_args, env={"JUSTITIA_HOME": tempfile.mkdtemp(prefix="justitia-split-")},
                        startup_timeout=1200) as srv:
        for rnd in range(args.rounds):
            for shape in SHAPES:  # interleaved: the machine's load falls on every shape alike
                row = asyncio.run(_run_shape(srv.url, shape, args.honest, args.in_flight))
                row["round"] = rnd
                runs.append(row)
                print(json.dumps(row), flush=True)
                time.sleep(2.0)  # what the flood left running drains
    rows = []
    for shape in SHAPES:
        mine = [r for r in runs if r["shape"] == shape]
        rows.append({"shape": shape,
                     **{k: round(statistics.median(r[k] for r in mine), 3)
                        for k in ("honest_mean_jct_s", "honest_max_jct_s", "honest_max_deadline_s")},
                     "honest_promises_kept": sum(r["honest_promises_kept"] for r in mine),
                     "honest_agents": sum(r["honest_agents"] for r in mine)})
    one = next(r for r in rows if r["shape"] == "one")
    for row in rows:
        row["jct_ratio_vs_one"] = round(row["honest_mean_jct_s"] / one["honest_mean_jct_s"], 2)
        row["deadline_ratio_vs_one"] = round(row["honest_max_deadline_s"] / one["honest_max_deadline_s"], 2)
        print(f"{row['shape']:<9} JCT {row['honest_mean_jct_s']:>7.2f} s ({row['jct_ratio_vs_one']:.2f}x one)  "
              f"deadline {row['honest_max_deadline_s']:>7.1f} s ({row['deadline_ratio_vs_one']:.2f}x one)  "
              f"kept {row['honest_promises_kept']}/{row['honest_agents']}")
    split_rows = [r for r in rows if r["shape"] in ("split", "untagged")]
    write_result(args.out, {
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "server": server_args,
                   "honest": "4 stages x 2 requests (~200 + 32 tokens), stages declared, one a second",
                   "flood": "requests of ~300 + 60 tokens kept in flight"},
        "rows": rows, "runs": runs,
        "met": {"within_1_5x": all(r["jct_ratio_vs_one"] <= 1.5 and r["deadline_ratio_vs_one"] <= 1.5
                                   for r in split_rows)},
    }, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
