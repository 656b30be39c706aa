"""`justitia demo` (the README's main job): the embedded server and a batch of example agents.

The demo starts the server (`server.EmbeddedServer`) unless given `--url`, so it lives
in the CLI host rather than in the SDK, which talks HTTP only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from justitia_cli import CommandError, Commands
from justitia_cli.options import add_command, json_option, kv_tokens_option, positive_int
from server.scheduler import POLICY_NAMES

# The example agents the demo runs, one module (and inputs file) each, in examples/.
DEMO_AGENTS = (
    "mapreduce_summary",
    "document_merging",
    "fact_verification",
    "self_consistency",
    "code_checking",
    "equation_verification",
)



def register(commands: Commands) -> None:
    demo = add_command(
        commands.root,
        "demo",
        help="Start the embedded server and run a batch of example agents through it, live.",
        description=(
            "The main job: start the bundled server (in-process vLLM CPU engine, embedded "
            "tiny model), submit a batch of the example agents (MapReduce summarization, "
            "document merging, fact verification, self-consistency voting, code checking, "
            "equation verification) at once, show their progress live, and end with each "
            "agent's JCT, first ETA, fair finish time and delay bound. Then a second wave of "
            "the same kinds on new inputs: a fresh server knows nothing of these agents (their "
            "costs, their stages, the engine's speed under them), so the first wave's ETAs "
            "are guesses; the second wave's come from what the server learned from the first. "
            "The tiny model's weights are random, so the text is noise; the engine and the "
            "scheduling are real."
        ),
        handler=run_demo,
    )
    demo.add_argument("--agents", type=positive_int, default=18, metavar="N",
                      help="how many agents to submit (cycling through the six kinds)")
    demo.add_argument("--waves", type=positive_int, default=2, metavar="N",
                      help="submit the batch this many times, one wave after another, each on the "
                           "next inputs of every kind (1: only a fresh server's guesses)")
    kv_tokens_option(demo, "KV cache capacity of the embedded engine in tokens", default=6144, metavar="N")
    demo.add_argument("--policy", default="justitia", choices=POLICY_NAMES,
                      help="scheduling policy of the embedded server")
    demo.add_argument("--max-tokens", type=positive_int, default=96, metavar="N",
                      help="output tokens per request of the example agents' first stage")
    demo.add_argument("--url", default=None,
                      help="use this running server instead of starting the embedded one")
    demo.add_argument("--examples", default=None, metavar="DIR",
                      help="the examples folder (default: the repository's examples/)")
    json_option(demo, "also write each agent's JCT, ETA, fair finish and bound here")


def examples_dir(given: str | None) -> Path:
    candidates = [Path(given)] if given else [
        Path(__file__).resolve().parent.parent / "examples", Path.cwd() / "examples"]
    for path in candidates:
        if (path / "_runner.py").is_file():
            return path
    raise CommandError(
        "cannot find the examples folder (looked in "
        + ", ".join(str(p) for p in candidates) + "); pass --examples DIR"
    )


def load_example(folder: Path, name: str) -> tuple[Any, list[dict[str, Any]]]:
    """The agent defined by examples/NAME.py and the rows of examples/inputs/NAME.jsonl."""
    if str(folder) not in sys.path:
        # The examples import their shared runner as a sibling module.
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"justitia_examples.{name}", folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rows = [json.loads(line) for line in (folder / "inputs" / f"{name}.jsonl").read_text()
            .splitlines() if line.strip()]
    return getattr(module, name), rows


def demo_jobs(folder: Path, n: int, max_tokens: int, wave: int = 0) -> list[tuple[Any, dict[str, Any]]]:
    """n (agent, arguments) pairs, cycling through the kinds and through each kind's inputs;
    wave w takes the inputs after those of waves 0..w-1."""
    loaded = [load_example(folder, name) for name in DEMO_AGENTS]
    jobs = []
    for i in range(wave * n, (wave + 1) * n):
        agent, rows = loaded[i % len(loaded)]
        args = dict(rows[(i // len(loaded)) % len(rows)])
        args["max_tokens"] = max_tokens
        jobs.append((agent, args))
    return jobs


def run_demo(args: argparse.Namespace) -> int:
    import anyio
    from rich.console import Console

    from justitia_sdk import AsyncClient

    console = Console()
    folder = examples_dir(args.examples)
    waves = [demo_jobs(folder, args.agents, args.max_tokens, wave) for wave in range(args.waves)]

    async def submit(url: str) -> tuple[list[Any], dict[str, Any]]:
        async with AsyncClient(url) as client:
            # The engine's first step is slow (kernels and caches warm up); one small request
            # first keeps that out of the agents' JCTs and out of the server's tau estimate.
            await client.complete("Warm up the engine before the demo begins.", max_tokens=8)
            snapshot = await client.scheduler()
            console.print(f"server ready at {url}: policy {snapshot.get('policy')}, KV "
                          f"{snapshot.get('M')} tokens; {len(waves)} wave(s) of "
                          f"{args.agents} agents, each wave submitted at once")
            batches = []
            for number, jobs in enumerate(waves, 1):
                batches.append(await client.submit_many(
                    [a for a, _ in jobs], [kw for _, kw in jobs],
                    title=f"wave {number} of {len(waves)}: {len(jobs)} example agents"
                          + (" (a fresh server)" if number == 1 else "")))
            return batches, snapshot

    server = None
    if args.url:
        url = args.url
    else:
        from server import EmbeddedServer

        with console.status("starting the embedded server "
                            "(vLLM CPU engine, tiny model, about a minute on 2 CPU cores)..."):
            # a history of its own: a server restarts with what its history taught it
            # (server/runtime/relearn.py), and the first wave is a fresh server's
            history_dir = tempfile.mkdtemp(prefix="justitia-demo-")
            server = EmbeddedServer(["--kv-tokens", str(args.kv_tokens), "--policy", args.policy,
                                     "--data-dir", history_dir]).start()
        url = server.url
    try:
        started = time.monotonic()
        batches, snapshot = anyio.run(submit, url)
        wall = time.monotonic() - started
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(history_dir, ignore_errors=True)

    summaries = [wave_summary(number, batch) for number, batch in enumerate(batches, 1)]
    console.print(f"{len(batches)} wave(s) in {wall:.1f} s:")
    for summary in summaries:
        console.print("  " + describe_wave(summary, url=args.url))
    console.print("[dim]JCT: submission to finish. 1st ETA: the server's ETA at submission. "
                  "fair: the finish time under an ideal fair share (GPS). bound: how late after "
                  "fair the agent may finish at worst; kept: JCT <= the deadline given at submission "
                  "(its first fair + bound). ETA error: "
                  "|1st ETA - JCT| / JCT.[/dim]")
    console.print("[dim]The tiny model's weights are random: its text is noise. The engine, "
                  "the KV cache and the scheduling are real.[/dim]")
    if args.json:
        rows = [{"wave": number, "index": h.index, "type": h.agent.name, "id": h.id, "state": h.status,
                 "jct_s": h.jct_s, "first_eta_s": h.first_eta_s, "eta_error": _eta_error(h),
                 "fair_finish_s": h.fair_finish_s, "delay_bound_s": h.delay_bound_s,
                 "deadline_s": h.deadline_s, "first_deadline_s": h.first_deadline_s, "kept": h.kept_promise,
                 "error": repr(h.error) if h.error else None}
                for number, batch in enumerate(batches, 1) for h in batch]
        from server.sim.provenance import write_result

        write_result(args.json, {"url": url, "policy": snapshot.get("policy"),
                                 "wall_s": wall, "waves": summaries, "agents": rows})
    failed = 0
    for number, batch in enumerate(batches, 1):
        for index, error in batch.errors:
            failed += 1
            console.print(f"[red]wave {number}, agent #{index} failed: {error!r}[/red]")
    return 1 if failed else 0


def wave_summary(number: int, batch: Any) -> dict[str, Any]:
    """One wave's figures: mean JCT, promises kept, first-ETA error p50 / p90 / worst."""
    kept = [k for h in batch if (k := h.kept_promise) is not None]
    errors = sorted(e for h in batch if (e := _eta_error(h)) is not None)
    return {"wave": number, "agents": len(batch), "mean_jct_s": batch.mean_jct_s(),
            "kept": sum(kept), "judged": len(kept),
            "eta_error_p50": _quantile(errors, 0.5), "eta_error_p90": _quantile(errors, 0.9),
            "eta_error_max": errors[-1] if errors else None}


def describe_wave(s: dict[str, Any], url: str | None = None) -> str:
    """A wave's line of the closing summary."""
    mean = s["mean_jct_s"]
    line = (f"wave {s['wave']}: {s['agents']} agents, mean JCT "
            f"{'-' if mean is None else f'{mean:.2f} s'}, {s['kept']} of {s['judged']} within "
            f"their deadline")
    if s["eta_error_p50"] is not None:
        line += (f"; first-ETA error median {100 * s['eta_error_p50']:.0f}%, "
                 f"p90 {100 * s['eta_error_p90']:.0f}%")
    if s["wave"] == 1 and url is None:
        line += " [dim](a fresh server: costs, stages and the engine's speed are guesses)[/dim]"
    elif s["wave"] > 1:
        line += " [dim](after the server learned from the waves before)[/dim]"
    return line


def _quantile(xs: list[float], q: float) -> float | None:
    """The element of sorted `xs` at rank q * len (the median's upper middle; None if empty)."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _eta_error(handle: Any) -> float | None:
    """|first ETA - JCT| / JCT of a finished agent (None while either is unknown)."""
    jct, eta = handle.jct_s, handle.first_eta_s
    if jct is None or eta is None or jct <= 0:
        return None
    return abs(eta - jct) / jct
