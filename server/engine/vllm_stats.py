"""What vLLM's stat logger reports of each engine step, collected for the server: the
step's duration and batch (tau, the step-time model's samples), KV usage, preemptions."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from server.engine.base import (
    EngineStats,
    StepListener,
)
from server.shared.step_time import StepSample


class StatsCollector:
    """Receives vLLM's per-step statistics; keeps what the scheduler needs.

    vLLM calls `record` after every engine step (in the engine client's output loop), so the
    interval between two calls while requests are running is the iteration time tau.
    """

    def __init__(self) -> None:
        self.kv_usage = 0.0
        self.running = 0
        self.waiting = 0
        self.preemptions_total = 0
        self.steps_total = 0
        self.iteration_time_s: float | None = None
        self._last_busy_step: float | None = None
        self.kv_capacity_tokens = 0
        self.listeners: list[StepListener] = []
        # Listeners of whole step samples (duration and batch shape: the time model's input).
        self.sample_listeners: list[Callable[[StepSample], None]] = []
        self._step_gen_tokens = 0
        self._step_prompt_tokens = 0
        # Context tokens of the requests in flight, each its whole prompt and what it has
        # generated: what a decode step's attention reads. A shared prefix counts once per
        # sequence that reads it (vLLM's paged attention on the CPU reads it per sequence:
        # 16 requests over one shared 2,048-token head step 5.4 ms slower than over 16-token
        # heads, docs/benchmarks.md), where kv_usage counts its blocks once.
        self.attended_tokens = 0

    def attend(self, delta: int) -> None:
        """Requests in flight gained (or, negative, released) `delta` context tokens. Not
        clamped at 0: every request releases exactly what it counted, so a negative count
        is a bug to see, not to hide."""
        self.attended_tokens += delta

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        now = time.monotonic()
        if scheduler_stats is not None:
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
        if iteration_stats is not None:
            self.preemptions_total += int(iteration_stats.num_preempted_reqs)
            # Tokens of this step: one per request that produced a token (decode batch),
            # prompt tokens computed (prefix-cache hits excluded). vLLM counts a chunked
            # prompt at its last chunk, so a long prompt's cost lands on one step; the fit
            # still gets the sum right.
            self._step_gen_tokens += int(iteration_stats.num_generation_tokens)
            self._step_prompt_tokens += int(iteration_stats.prompt_token_stats.computed)
        self.steps_total += 1
        busy = self.running > 0
        # A step that produced tokens was a step even if it finished every request.
        worked = busy or self._step_gen_tokens > 0
        if worked and self._last_busy_step is not None:
            dt = now - self._last_busy_step
            # Gaps longer than a second are idle periods between bursts, not iterations.
            if dt < 1.0:
                prev = self.iteration_time_s
                self.iteration_time_s = dt if prev is None else 0.9 * prev + 0.1 * dt
                for listener in self.listeners:
                    listener(dt, self.kv_usage * self.kv_capacity_tokens)
                if self.sample_listeners:
                    sample = StepSample(dt, self._step_gen_tokens, self._step_prompt_tokens,
                                        max(self.attended_tokens, self.kv_usage * self.kv_capacity_tokens))
                    for sample_listener in self.sample_listeners:
                        sample_listener(sample)
        self._step_gen_tokens = self._step_prompt_tokens = 0
        self._last_busy_step = now if busy else None

    def work_arrived(self, now: float) -> None:
        """A request went to the engine. If it was idle, its next step starts now: without
        this, the first step after an idle period (the one that prefills the batch that
        woke it) would have no start and its time would be lost to the time model."""
        if self._last_busy_step is None and self.running == 0:
            self._last_busy_step = now

    def engine_gone(self) -> None:
        """The engine died: its last running/waiting counts and KV usage are stale."""
        self.kv_usage = 0.0
        self.running = 0
        self.waiting = 0
        self._last_busy_step = None

    def snapshot(self) -> EngineStats:
        return EngineStats(
            kv_usage=self.kv_usage,
            running=self.running,
            waiting=self.waiting,
            preemptions_total=self.preemptions_total,
            iteration_time_s=self.iteration_time_s,
            steps_total=self.steps_total,
        )


def stat_logger_factory(collector: StatsCollector):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class JustitiaStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.collector = collector

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            self.collector.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return JustitiaStatLogger
