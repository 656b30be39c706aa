"""The warm-up: batches of known shapes an engine runs before it serves anyone.

A fresh engine's first batches of each size and length pay for lazy set-up, and agents
admitted then would miss promises made at the measured steady speed; so the server runs this
batch before /readyz turns green (server/api/app.py). Its last round runs on a warmed engine,
and its steps, of shapes every run repeats, are a reading of the host's speed of the minute:
the server checks a measured prior against them (server/runtime/prior_check.py), and
`bench calibrate` records what the same warm-up reads against the profile it fits, on the
host it measured (server/sim/calibrate.py), so that the check compares like with like.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from server.engine.base import Engine, EngineInfo, EngineRequest, SamplingOptions, StepSamples
from server.shared.step_time import StepSample

# The warm-up: (prompt tokens, output tokens) of requests run together, WARM_UP_ROUNDS times.
# With one short generation instead, a fresh server's first agents ran slower than the same
# agents after a few seconds of traffic (the vLLM CPU engine, the family's `tenants` seed
# 102: mean JCT median 1.32 s over six fresh servers, 1.06-1.14 s after eight agents, median
# 1.14 s over four with this batch): the engine's first batches of each size and length pay
# for lazy set-up. Most of it is a CPU kernel per row count, which the engine builds itself
# for every batch size it can hold (server/engine/cpu_worker.py); this batch also reaches the
# prefill lengths and the server's own paths (streams, output tasks).
WARM_UP_BATCH = ((64, 16), (256, 16), (1024, 16), (64, 64), (256, 64), (512, 64))
WARM_UP_ROUNDS = 2


def warm_up_requests(info: EngineInfo, text_ids: Sequence[int], round_: int = 0) -> list[EngineRequest]:
    """The warm-up batch for an engine of `info`: each request cut to fit its context and
    the KV cache alone, its prompt `text_ids` repeated from a shifted start (a prompt of its
    own: the prefix cache must not make its prefill free)."""
    if not text_ids:
        return []
    requests = []
    for k, (prompt, output) in enumerate(WARM_UP_BATCH):
        prompt = min(prompt, min(info.max_model_len, info.kv_capacity_tokens) - output)
        if prompt < 1:
            continue
        shift = k * 7 + round_ * 3
        ids = tuple(text_ids[(shift + i) % len(text_ids)] for i in range(prompt))
        requests.append(EngineRequest(f"justitia-warmup-{round_}-{k}", ids,
                                      SamplingOptions(max_tokens=output, ignore_eos=True)))
    return requests


async def warm_up(engine: Engine, samples: StepSamples | None) -> tuple[StepSample, ...]:
    """A few batches before /readyz turns green: the first steps of a fresh engine are slow
    (lazy initialisation, per batch shape), and agents admitted then would miss promises
    that the measured steady-state speed makes. Returns the steps of its last round, run on
    the warmed engine (the prior's check, server/runtime/prior_check.py)."""
    ids = engine.tokenize("Justitia warms up the engine before serving agents: batches of several "
                          "lengths, so that the first agents meet the engine's steady speed.")
    steps = WarmUpSteps()
    if samples is not None:
        samples.add_sample_listener(steps.observe)

    async def run(request: EngineRequest) -> None:
        async for _ in engine.generate(request):
            pass

    for round_ in range(WARM_UP_ROUNDS):
        steps.next_round()
        async with anyio.create_task_group() as group:
            for request in warm_up_requests(engine.info, ids, round_):
                group.start_soon(run, request)
    return steps.close()


class WarmUpSteps:
    """Listens to the engine's step samples during the warm-up and keeps those of its
    current round (`next_round` forgets the ones before: the first round pays for the
    engine's lazy set-up). Once `close`d it keeps nothing more: engines offer no way to
    stop listening, and a closed listener costs one test per step."""

    def __init__(self) -> None:
        self._steps: list[StepSample] = []
        self._open = True

    def observe(self, engine: str, sample: StepSample) -> None:
        if self._open:
            self._steps.append(sample)

    def next_round(self) -> None:
        self._steps.clear()

    def close(self) -> tuple[StepSample, ...]:
        self._open = False
        steps, self._steps = tuple(self._steps), []
        return steps
