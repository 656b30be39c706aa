"""`justitia demo` (the README's main job): the embedded server and a batch of example agents.

The demo starts the server (`server.launcher.EmbeddedServer`) unless given `--url`, so it lives
in the CLI host rather than in the SDK, which talks HTTP only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from justitia_cli import CommandError, Commands, formatter
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(commands: Commands) -> None:
    demo = commands.root.add_parser(
        "demo",
        help="Start the embedded server and run a batch of example agents through it, live.",
        description=(
            "The main job: start the bundled server (in-process vLLM CPU engine, embedded "
            "tiny model), submit a batch of the example agents (MapReduce summarization, "
            "document merging, fact verification, self-consistency voting, code checking, "
            "equation verification) at once, show their progress live, and end with each "
            "agent's JCT, first ETA, fair finish time and delay bound. The tiny model's "
            "weights are random, so the text is noise; the engine and the scheduling are real."
        ),
        formatter_class=formatter,
    )
    demo.add_argument("--agents", type=_positive, default=18, metavar="N",
                      help="how many agents to submit (cycling through the six kinds)")
    demo.add_argument("--kv-tokens", type=int, default=6144, metavar="N",
                      help="KV cache capacity of the embedded engine in tokens")
    demo.add_argument("--policy", default="justitia", choices=POLICY_NAMES,
                      help="scheduling policy of the embedded server")
    demo.add_argument("--max-tokens", type=_positive, default=96, metavar="N",
                      help="output tokens per request of the example agents' first stage")
    demo.add_argument("--url", default=None,
                      help="use this running server instead of starting the embedded one")
    demo.add_argument("--examples", default=None, metavar="DIR",
                      help="the examples folder (default: the repository's examples/)")
    demo.add_argument("--json", default=None, metavar="OUT",
                      help="also write each agent's JCT, ETA, fair finish and bound here")
    demo.set_defaults(handler=run_demo)


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


def demo_jobs(folder: Path, n: int, max_tokens: int) -> list[tuple[Any, dict[str, Any]]]:
    """n (agent, arguments) pairs, cycling through the kinds and through each kind's inputs."""
    loaded = [load_example(folder, name) for name in DEMO_AGENTS]
    jobs = []
    for i in range(n):
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
    jobs = demo_jobs(examples_dir(args.examples), args.agents, args.max_tokens)

    async def submit(url: str) -> tuple[Any, dict[str, Any]]:
        async with AsyncClient(url) as client:
            # The engine's first step is slow (kernels and caches warm up); one small request
            # first keeps that out of the agents' JCTs and out of the server's tau estimate.
            await client.complete("Warm up the engine before the demo begins.", max_tokens=8)
            snapshot = await client.scheduler()
            console.print(f"server ready at {url}: policy {snapshot.get('policy')}, KV "
                          f"{snapshot.get('M')} tokens; submitting {len(jobs)} agents at once")
            batch = await client.submit_many(
                [a for a, _ in jobs], [kw for _, kw in jobs],
                title=f"{len(jobs)} example agents")
            return batch, snapshot

    server = None
    if args.url:
        url = args.url
    else:
        from server.launcher import EmbeddedServer

        with console.status("starting the embedded server "
                            "(vLLM CPU engine, tiny model, about a minute on 2 CPU cores)..."):
            server = EmbeddedServer(["--kv-tokens", str(args.kv_tokens),
                                     "--policy", args.policy]).start()
        url = server.url
    try:
        started = time.monotonic()
        batch, snapshot = anyio.run(submit, url)
        wall = time.monotonic() - started
    finally:
        if server is not None:
            server.stop()

    kept = [h.kept_promise for h in batch]
    mean = batch.mean_jct_s()
    console.print(
        f"{len(batch)} agents in {wall:.1f} s; mean JCT "
        f"{'-' if mean is None else f'{mean:.2f} s'}; "
        f"{sum(1 for k in kept if k)} of {sum(1 for k in kept if k is not None)} finished "
        f"within their deadline (fair finish + bound)."
    )
    errors = sorted(e for h in batch if (e := _eta_error(h)) is not None)
    if errors:
        console.print(f"first-ETA error |1st ETA - JCT| / JCT: median {100 * errors[len(errors) // 2]:.0f}%, "
                      f"p90 {100 * errors[min(len(errors) - 1, int(0.9 * len(errors)))]:.0f}%, "
                      f"worst {100 * errors[-1]:.0f}% (how far the ETA given at submission was from the JCT)")
    console.print("[dim]JCT: submission to finish. 1st ETA: the server's ETA at submission. "
                  "fair: the finish time under an ideal fair share (GPS). bound: how late after "
                  "fair the agent may finish at worst; kept: JCT <= fair + bound.[/dim]")
    console.print("[dim]The tiny model's weights are random: its text is noise. The engine, "
                  "the KV cache and the scheduling are real.[/dim]")
    if args.json:
        rows = [{"index": h.index, "type": h.agent.name, "id": h.id, "state": h.status,
                 "jct_s": h.jct_s, "first_eta_s": h.first_eta_s, "eta_error": _eta_error(h),
                 "fair_finish_s": h.fair_finish_s, "delay_bound_s": h.delay_bound_s,
                 "deadline_s": h.deadline_s, "kept": h.kept_promise,
                 "error": repr(h.error) if h.error else None} for h in batch]
        Path(args.json).write_text(json.dumps({"url": url, "policy": snapshot.get("policy"),
                                               "wall_s": wall, "agents": rows}, indent=1))
    for index, error in batch.errors:
        console.print(f"[red]agent #{index} failed: {error!r}[/red]")
    return 1 if batch.errors else 0


def _eta_error(handle: Any) -> float | None:
    """|first ETA - JCT| / JCT of a finished agent (None while either is unknown)."""
    jct, eta = handle.jct_s, handle.first_eta_s
    if jct is None or eta is None or jct <= 0:
        return None
    return abs(eta - jct) / jct
