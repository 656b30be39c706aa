"""The first burst of a batch: its ETAs with and without the batch declared.

A 400-input batch at concurrency 64 of two agent types, on the real engine (vLLM, the tiny
model), on a fresh server each time:
- `research`: an LLM call, a search tool of 0.5-2 s, three calls fanned out, a last call;
- `chat`: three turns.
The SDK declares every registration's batch (`metadata["batch"]`: id, size, index,
concurrency), so the first 64 agents' ETAs can expect the 336 inputs held back in the client.
`undeclared` runs the same batch with the declaration taken out of the registrations (what a
server that ignores it sees); `declared` as the SDK sends it. The two runs alternate
(`--rounds`). Prints, per run, the first-ETA error |first ETA - JCT| / JCT of the first
burst (inputs 0-63) and of all inputs that ended (median, p90), and the promises kept.
Unless `--whole`, a run stops its batch once the first burst has ended (its inputs all ran
with the rest of the batch arriving behind them). Writes
benchmarks/results/batch_first_burst.json.

    .venv/bin/python benchmarks/batch_first_burst.py [--inputs 400] [--rounds 1] [--whole]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from justitia_sdk import AsyncClient, agent, llm, parallel_map  # noqa: E402
from server.launcher import EmbeddedServer  # noqa: E402
from server.sim.provenance import write_result  # noqa: E402

CONCURRENCY = 64
WORDS = "market policy river engine protein orbit ledger canyon archive signal".split()


@agent("bb_research")
async def research(topic: str, seed: int) -> str:
    rng = random.Random(seed)
    plan = await llm(f"Plan a search about {topic}", max_tokens=24, ignore_eos=True)
    await anyio.sleep(rng.uniform(0.5, 2.0))  # the search tool
    notes = await parallel_map(
        lambda k: llm(f"Read result {k} on {topic}: {plan[:40]}", max_tokens=24, ignore_eos=True),
        range(3))
    return await llm(f"Summarize {topic}: " + " ".join(n[:20] for n in notes), max_tokens=32,
                     ignore_eos=True)


@agent("bb_chat")
async def chat(opening: str) -> str:
    said = opening
    for turn in range(3):
        said = await llm(f"Turn {turn}. {said[:200]}", max_tokens=40, ignore_eos=True)
    return said


def inputs(n: int) -> tuple[list[Any], list[Any]]:
    rng = random.Random(7)
    agents, values = [], []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
        if i % 2 == 0:
            agents.append(research)
            values.append({"topic": text, "seed": i})
        else:
            agents.append(chat)
            values.append(text)
    return agents, values


class Undeclared(httpx.AsyncBaseTransport):
    """Takes `metadata["batch"]` out of every registration: what a server that does not
    read the declaration sees."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=512))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/agents":
            body = json.loads(request.content)
            (body.get("metadata") or {}).pop("batch", None)
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request("POST", request.url, headers=headers, json=body,
                                    extensions=request.extensions)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None}
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 3),
            "p90": round(ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)], 3)}


def _broken(h: Any) -> dict[str, Any]:
    first = h.first_record or h.record

    def field(record: Any, name: str) -> Any:
        return None if record is None else getattr(record, name, None)

    return {"index": h.index, "agent": h.agent.name, "jct_s": round(h.jct_s, 2),
            "first_deadline_s": round(h.first_deadline_s, 2), "first_eta_s": h.first_eta_s,
            "promise": field(first, "promise"), "reason": field(first, "promise_reason"),
            "delay_bound_s": field(first, "delay_bound_s"),
            "predicted_cost": field(first, "predicted_cost"),
            "predicted_cost_p90": field(first, "predicted_cost_p90"),
            "consumed_cost": field(h.record, "consumed_cost")}


def run(mode: str, n: int, whole: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as home, EmbeddedServer(
            ["--shutdown-grace-s", "10"], env={"JUSTITIA_HOME": home},
            startup_timeout=900.0) as srv:
        agents, values = inputs(n)

        async def main() -> Any:
            transport = Undeclared() if mode == "undeclared" else None
            async with AsyncClient(srv.url, transport=transport) as client:
                async with client.batch(agents, values, concurrency=CONCURRENCY,
                                        progress=False) as batch:
                    if not whole:  # the first burst is what is measured: stop once it ended
                        async for _ in batch.as_completed():
                            if all(h.done for h in batch[:CONCURRENCY]):
                                batch.cancel()
                                break
                return batch

        started = time.monotonic()
        batch = anyio.run(main)
        took = time.monotonic() - started
    first = [h for h in batch if h.index < CONCURRENCY]
    out: dict[str, Any] = {"mode": mode, "seconds": round(took, 1),
                           "finished": sum(h.ok for h in batch), "whole": whole}
    for name, group in (("first_burst", first), ("all", list(batch))):
        errors = [h.eta_error for h in group if h.eta_error is not None]
        kept = [h.kept_promise for h in group if h.kept_promise is not None]
        out[name] = {"eta_error": _stats(errors), "kept": sum(kept), "judged": len(kept),
                     "first_eta_s": _stats([h.first_eta_s for h in group if h.first_eta_s]),
                     "jct_s": _stats([h.jct_s for h in group if h.jct_s])}
        # the promises broken, with what they were made of
        out[name]["broken"] = [_broken(h) for h in group if h.kept_promise is False]
        for kind in ("bb_research", "bb_chat"):
            errs = [h.eta_error for h in group if h.agent.name == kind and h.eta_error is not None]
            out[name][f"eta_error_{kind}"] = _stats(errs)
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=400, help="inputs of the batch (400)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="undeclared/declared pairs, alternating (1)")
    parser.add_argument("--whole", action="store_true",
                        help="run every input to its end (default: stop the batch once its "
                             "first burst has ended; `all` then covers the inputs that ended)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/batch_first_burst.json"))
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    result = {"inputs": args.inputs, "concurrency": CONCURRENCY, "runs": runs,
              "note": "first-ETA error |first ETA - JCT| / JCT; first_burst = inputs 0-63, "
                      "registered at once; fresh server per run"}
    for _ in range(args.rounds):
        for mode in ("undeclared", "declared"):
            runs.append(run(mode, args.inputs, args.whole))
            write_result(args.out, result)  # after each run: a later one may not start
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
