"""In-process vLLM engine backend (AsyncLLM): the GPU build, or the CPU build here.

vLLM is imported only when the engine starts, so the rest of the server (and the CLI's
help) never pays for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from server.engine.base import (
    NOT_RUNNING,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InvalidRequestError,
    SampleListener,
    SamplingOptions,
    SequenceOutput,
    StateListener,
    StepListener,
    TokenLogprob,
)
from server.engine.tokens import TokenizerEngine, fast_encoder
from server.shared.step_time import StepSample

log = logging.getLogger("justitia.engine")


@dataclass(frozen=True)
class LocalEngineConfig:
    model: str
    kv_tokens: int | None = None  # None: let vLLM size the cache
    max_model_len: int = 2048
    block_size: int | None = None  # None: 32 on CPU (it must be a multiple of 32 there)
    dummy_weights: bool = False  # random weights: the embedded tiny model has none
    max_num_seqs: int = 256
    kv_cache_space_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE (whole GiB)
    seed: int = 0
    dtype: str = "auto"
    # CPU only: niceness of vLLM's EngineCore process (see _deprioritise_engine_core).
    engine_core_nice: int = 10
    # Supervision (see LocalVLLMEngine._supervise): restarts of a dead engine in a row before
    # the server gives up (0: never restart), the wait before the first one (doubling up to
    # the cap), and how long a restarted engine must run for the count to start over.
    restarts: int = 3
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    restart_stable_s: float = 600.0


# stopped: not started or closed; failed: dead and no restart left (the server exits).
EngineState = Literal["stopped", "starting", "running", "restarting", "failed"]
# The in-process engine's name in per-engine figures (the time model of each engine).
ENGINE_NAME = "local"
# How often the supervisor looks at the engine; a death is noticed within this time.
DEATH_POLL_S = 0.2


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # torch missing or broken: the CPU build's own checks will say so
        return True


class _StatsCollector:
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


def _deprioritise_engine_core(nice: int) -> None:
    """Lower the scheduling priority of vLLM's EngineCore process.

    On the CPU build the model worker is pinned to its own cores and the EngineCore shares
    the remaining core with this (API) process. While the worker computes a step, the
    EngineCore spins on the shared-memory queue (sched_yield), taking ~75% of that core
    (measured here on 2 cores); the API process then answers HTTP in seconds instead of
    milliseconds, and admission, which runs in this process, lags behind the engine. At
    nice 10 the spinning only uses what this process leaves idle.
    """
    if nice <= 0:
        return
    try:
        for child in _vllm_processes("EngineCore"):
            child.nice(nice)
            log.info("EngineCore process %d set to nice %d", child.pid, nice)
    except Exception as exc:  # best effort: only speed depends on it
        log.warning("could not lower the EngineCore's priority: %s", exc)


def _vllm_processes(kind: str, root: int | None = None) -> list[Any]:
    """vLLM's processes of one kind (`EngineCore`, `Worker`: it names them VLLM::<kind>)
    among the descendants of process `root` (default this one)."""
    import psutil

    return [child for child in psutil.Process(root).children(recursive=True)
            if kind in child.name() or kind in " ".join(child.cmdline()[:1])]


#: Whether this platform sets CPU affinities per thread (Linux; vLLM's CPU build also runs on
#: macOS, which has no such call).
PINNING = hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def worker_cores(root: int | None = None) -> set[int]:
    """The cores vLLM's CPU model workers (descendants of process `root`, default this one)
    are pinned to: empty where there is no pinned worker."""
    import psutil

    if not PINNING:
        return set()
    try:
        return {core for child in _vllm_processes("Worker", root) for core in child.cpu_affinity() or []}
    except (psutil.Error, OSError):
        return set()


def pin_threads(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` to `cores` (a process's affinity is per thread on Linux:
    setting the process's only moves its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def keep_off_worker_cores() -> set[int]:
    """Move this (API) process and vLLM's EngineCore off the cores the CPU model worker is
    pinned to; returns the cores they now use (empty: left as they were).

    vLLM pins its CPU worker's threads to its own cores but leaves every other process free
    to run there, so the scheduler of the OS now and then put this process or the bench
    client on the worker's core, and every engine step waited for them: on 2 cores the same
    schedule ran 12-23% slower from one server start to the next (session 9, live
    contended48p: the agents finished in the same order, rank correlation 0.998, each one
    slower by a common factor).
    """
    import psutil

    if not PINNING:
        return set()
    pinned = worker_cores()
    try:
        others = set(os.sched_getaffinity(0)) - pinned
    except OSError:
        return set()
    if not pinned or not others:
        return set()
    try:
        pin_threads(os.getpid(), others)
        for child in _vllm_processes("EngineCore"):
            pin_threads(child.pid, others)
    except (psutil.Error, OSError) as exc:  # best effort: only speed depends on it
        log.warning("could not keep off the engine worker's cores: %s", exc)
        return set()
    log.info("API process and EngineCore kept off the engine worker's cores %s", sorted(pinned))
    return others


def _stat_logger_factory(collector: _StatsCollector):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class JustitiaStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.collector = collector

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            self.collector.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return JustitiaStatLogger


def _sampling_params(s: SamplingOptions) -> Any:
    from vllm import SamplingParams

    structured = None
    if s.json_object or s.json_schema is not None:
        from vllm.sampling_params import StructuredOutputsParams

        structured = (StructuredOutputsParams(json=s.json_schema) if s.json_schema is not None
                      else StructuredOutputsParams(json_object=True))
    return SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=list(s.stop) or None,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        structured_outputs=structured,
    )


class _Sequences:
    """The latest state of each of a request's sequences, and what is new in each.

    vLLM's outputs are cumulative (the whole text and token list so far); an output may carry
    only some of the `n` sequences, so the last state of each is kept here.
    """

    def __init__(self, tokenizer: Any, logprobs: int | None) -> None:
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._state: dict[int, SequenceOutput] = {}

    def update(self, completions: list[Any]) -> tuple[SequenceOutput, ...]:
        for c in completions:
            prev = self._state.get(c.index)
            sent_text = len(prev.text) if prev else 0
            sent_tokens = prev.output_tokens if prev else 0
            self._state[c.index] = SequenceOutput(
                index=c.index,
                text=c.text,
                output_tokens=len(c.token_ids),
                finish_reason=c.finish_reason,
                delta_text=c.text[sent_text:],
                delta_logprobs=self._new_logprobs(c, sent_tokens),
                token_ids=tuple(c.token_ids) if c.finish_reason is not None else (),
            )
        return tuple(self._state[i] for i in sorted(self._state))

    def _new_logprobs(self, c: Any, sent: int) -> tuple[TokenLogprob, ...]:
        if self._logprobs is None or not c.logprobs:
            return ()
        return tuple(_token_logprob(tid, step, self._logprobs, self._tokenizer)
                     for tid, step in zip(c.token_ids[sent:], c.logprobs[sent:], strict=True))


def _token_logprob(token_id: int, step: dict[int, Any], k: int, tokenizer: Any) -> TokenLogprob:
    """vLLM's per-step dict (token id -> Logprob, the sampled token always included) in the
    order OpenAI gives: the sampled token, then the alternatives by rank."""

    def text(tid: int, lp: Any) -> str:
        return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])

    sampled = step[token_id]
    # vLLM adds the sampled token to the k most likely when it is not among them; OpenAI's
    # top list holds the k most likely only (ranks 1..k).
    ranked = sorted((lp.rank, tid, lp) for tid, lp in step.items() if lp.rank <= k)
    top = tuple((text(tid, lp), float(lp.logprob)) for _, tid, lp in ranked)
    return TokenLogprob(text(token_id, sampled), float(sampled.logprob), top)


def _cached_tokens(out: Any) -> int | None:
    """Prompt tokens vLLM found in its prefix cache for this request (None: not reported)."""
    cached = getattr(out, "num_cached_tokens", None)
    return int(cached) if isinstance(cached, int) and cached >= 0 else None


def without_sigint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with SIGINT blocked in this thread, so that the processes it
    starts (vLLM's EngineCore and workers) inherit the block: a Ctrl-C in the terminal goes
    to the whole foreground process group, and an engine that took it would die under the
    server, which must stop it in order instead (server/runtime/shutdown.py). SIGTERM is left as
    it is: vLLM stops its processes with it."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        return fn(*args, **kwargs)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return fn(*args, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class LocalVLLMEngine(TokenizerEngine):
    """vLLM's AsyncLLM in this process (its engine core runs in a child process).

    Capabilities (server/engine/base.py): `StepStatistics`, `StepSamples` and `Supervised`.

    A supervisor task watches the engine. When it dies, its requests fail with an
    `EngineError` (vLLM ends their streams) and the engine is restarted with exponential
    backoff, up to `config.restarts` times in a row; then the state is `failed` and the
    listeners (the server) decide what to do (exit). Requests handed to `generate` while it
    restarts wait for it instead of failing: nothing of theirs ran.
    """

    def __init__(self, config: LocalEngineConfig) -> None:
        self.config = config
        self._llm: Any = None
        self._stats = _StatsCollector()
        self.state: EngineState = "stopped"
        self.state_detail = "the engine has not started"
        self._restarts_in_a_row = 0
        self._running_since = 0.0
        self._changed = asyncio.Event()
        self._state_listeners: list[StateListener] = []
        self._supervisor: asyncio.Task[None] | None = None
        # The server is shutting down (server/runtime/shutdown.py): a death now is not a crash.
        self._stopping = False
        # This process's cores before it kept off the worker's (`keep_off_worker_cores`),
        # given back on close: an in-process engine's caller (a test, a notebook, `bench
        # calibrate`) must not stay on fewer cores, nor hand them to the servers it starts.
        self._cores_before: set[int] | None = None

    @property
    def healthy(self) -> bool:
        return self.state == "running" and self._llm is not None and not self._llm.errored

    @property
    def recovering(self) -> bool:
        """Down now, but being brought back: hold requests rather than fail them."""
        return self.state in ("starting", "restarting")

    def expect_shutdown(self) -> None:
        """The server is shutting down: if the engine dies from now on, it stopped with the
        server; it is not restarted. Only sets a flag (it may run in a signal handler)."""
        self._stopping = True

    def add_state_listener(self, listener: StateListener) -> None:
        """Call `listener(state, detail)` on every change of `state`."""
        self._state_listeners.append(listener)

    def _set_state(self, state: EngineState, detail: str) -> None:
        self.state, self.state_detail = state, detail
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for listener in self._state_listeners:
            try:
                listener(state, detail)
            except Exception:  # a listener's bug must not stop the supervision
                log.exception("engine state listener failed")

    async def start(self) -> None:
        self._set_state("starting", "the engine is starting")
        await self._launch()
        self._running_since = time.monotonic()
        self._set_state("running", "")
        self._supervisor = asyncio.create_task(self._supervise(), name="justitia-engine-supervisor")

    def _engine_args(self, on_cpu: bool) -> Any:
        cfg = self.config
        from vllm import AsyncEngineArgs

        block_size = cfg.block_size or (32 if on_cpu else 16)
        kwargs: dict[str, Any] = dict(
            model=cfg.model,
            max_model_len=cfg.max_model_len,
            block_size=block_size,
            max_num_seqs=cfg.max_num_seqs,
            seed=cfg.seed,
            dtype=cfg.dtype,
            # The server orders requests itself; vLLM's priority queue keeps engine-side
            # preemptions on the lowest-ranked agent when they happen anyway.
            scheduling_policy="priority",
            enforce_eager=on_cpu,
        )
        if cfg.dummy_weights:
            kwargs["load_format"] = "dummy"
        if on_cpu:
            # vLLM's CPU worker dies on a seeded request whose prefill is chunked; ours
            # rewinds the seeded generator the CPU way (see server/engine/cpu_worker.py).
            kwargs["worker_cls"] = "server.engine.cpu_worker.SeedSafeCPUWorker"
        if cfg.kv_tokens is not None:
            # One block is reserved by vLLM: M = (N - 1) * block_size usable tokens.
            blocks = -(-cfg.kv_tokens // block_size) + 1
            if (blocks - 1) * block_size < cfg.max_model_len:
                raise InvalidRequestError(
                    f"--kv-tokens {cfg.kv_tokens} is below the max model length "
                    f"{cfg.max_model_len}: vLLM needs room for one full-length request"
                )
            kwargs["num_gpu_blocks_override"] = blocks
        return AsyncEngineArgs(**kwargs)

    async def _launch(self) -> None:
        """Build the AsyncLLM (and its processes). It is built in a worker thread, so that
        the event loop keeps answering /healthz and /readyz during a restart; vLLM starts
        its output tasks on this loop at the first request."""
        cfg = self.config
        on_cpu = _on_cpu()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        if on_cpu:
            # Without it the CPU worker claims ~92% of the NUMA node's memory.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_space_gib))
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self._engine_args(on_cpu)
        try:
            self._llm = await asyncio.to_thread(
                without_sigint, AsyncLLM.from_engine_args, args,
                stat_loggers=[_stat_logger_factory(self._stats)]
            )
        except Exception as exc:  # vLLM raises many kinds; the user needs one sentence
            raise EngineError(f"vLLM failed to start with model {cfg.model!r}: {exc}") from exc
        vcfg = self._llm.vllm_config
        blocks = int(vcfg.cache_config.num_gpu_blocks)
        bs = int(vcfg.cache_config.block_size)
        self._tokenizer = self._llm.get_tokenizer()
        info = EngineInfo(
            model=cfg.model,
            kv_capacity_tokens=(blocks - 1) * bs,
            block_size=bs,
            max_model_len=int(vcfg.model_config.max_model_len),
            # vLLM's own rule (renderers/base.py): an id is in the vocabulary of the
            # tokenizer or of the model, whichever is larger.
            vocab_size=max(int(self._tokenizer.max_token_id) + 1,
                           int(vcfg.model_config.get_vocab_size())),
            max_logprobs=int(vcfg.model_config.max_logprobs),
            dtype=str(vcfg.model_config.dtype).removeprefix("torch."),
        )
        if self._info is not None and info != self._info:
            # Same settings, same engine: the scheduler keeps the first one's capacity.
            log.error("the restarted engine differs from the first one: %s, was %s",
                      info, self._info)
        else:
            self._info = info
        self._encode = fast_encoder(self._tokenizer)
        self._stats.kv_capacity_tokens = self.info.kv_capacity_tokens
        if on_cpu:
            _deprioritise_engine_core(cfg.engine_core_nice)
            if PINNING and self._cores_before is None:  # a restart keeps the first start's
                self._cores_before = set(os.sched_getaffinity(0))
            keep_off_worker_cores()

    # -- supervision ------------------------------------------------------------------
    async def _supervise(self) -> None:
        while True:
            while self._llm is not None and not self._llm.errored:
                await asyncio.sleep(DEATH_POLL_S)
            if self.state != "running":  # closed under us
                return
            if self._stopping:  # it stopped with the server: not a crash, no restart
                log.info("the engine stopped during the server's shutdown")
                self._stats.engine_gone()
                self._set_state("stopped", "the server is shutting down")
                return
            await self._recover()
            if self.state != "running":
                return

    async def _recover(self) -> None:
        """The engine died: restart it with backoff, or give up (state `failed`)."""
        cfg = self.config
        ran_s = time.monotonic() - self._running_since
        if ran_s >= cfg.restart_stable_s:
            self._restarts_in_a_row = 0
        log.error("THE vLLM ENGINE DIED after running %.0f s (see vLLM's error above); "
                  "its running requests fail", ran_s)
        self._stats.engine_gone()
        await self._discard_engine()
        while self._restarts_in_a_row < cfg.restarts and not self._stopping:
            self._restarts_in_a_row += 1
            n, delay = self._restarts_in_a_row, self._backoff_s(self._restarts_in_a_row)
            self._set_state("restarting", f"the engine died; restart {n} of {cfg.restarts} "
                                          f"in {delay:.0f} s")
            log.error("restarting the engine in %.1f s (restart %d of %d in a row)",
                      delay, n, cfg.restarts)
            await asyncio.sleep(delay)
            self._set_state("restarting", f"the engine died; restart {n} of {cfg.restarts} "
                                          "under way")
            started = time.monotonic()
            try:
                await self._launch()
                await self._warm_up()
            except Exception:
                log.exception("restart %d of %d failed", n, cfg.restarts)
                await self._discard_engine()
                continue
            self._running_since = time.monotonic()
            log.warning("the engine is back after a %.1f s start (restart %d of %d)",
                        self._running_since - started, n, cfg.restarts)
            self._set_state("running", "")
            return
        if self._stopping:
            self._set_state("stopped", "the server is shutting down")
            return
        detail = (f"the engine died and {cfg.restarts} restarts in a row did not bring it back"
                  if cfg.restarts else "the engine died and restarts are off (--engine-restarts 0)")
        log.critical("GIVING UP: %s", detail)
        self._set_state("failed", detail)

    def _backoff_s(self, attempt: int) -> float:
        cfg = self.config
        return min(cfg.restart_backoff_s * 2 ** (attempt - 1), cfg.restart_backoff_max_s)

    async def _discard_engine(self) -> None:
        """Shut down what is left of a dead engine (its processes, sockets, tasks)."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        try:
            await asyncio.to_thread(llm.shutdown)
        except Exception:  # it is dead already; what matters is that it is gone
            log.exception("shutting down the dead engine failed")

    async def _warm_up(self) -> None:
        """One short generation before a restarted engine takes requests (vLLM starts its
        output tasks at the first request, and the first steps are slow)."""
        from vllm import SamplingParams

        ids = self.tokenize("Justitia warms up the restarted engine.")
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        async for _ in self._llm.generate({"prompt_token_ids": ids}, params,
                                          f"justitia-warmup-{time.monotonic_ns()}"):
            pass

    async def _until_running(self) -> None:
        """Wait while the engine (re)starts; EngineError once it will not run again."""
        while not self.healthy:
            if self.state in ("stopped", "failed"):
                raise EngineError(f"{NOT_RUNNING}: {self.state_detail}")
            changed = self._changed
            try:  # a death not noticed yet leaves the state "running": look again soon
                await asyncio.wait_for(changed.wait(), DEATH_POLL_S)
            except TimeoutError:
                pass

    def add_step_listener(self, listener: StepListener) -> None:
        """Call `listener(step_seconds, kv_tokens_in_use)` after every busy engine step."""
        self._stats.listeners.append(listener)

    def add_sample_listener(self, listener: SampleListener) -> None:
        """Call `listener(engine_name, sample)` after every busy engine step, with its
        duration and batch shape (the input of the scheduler's time model)."""
        self._stats.sample_listeners.append(lambda sample: listener(ENGINE_NAME, sample))

    async def close(self) -> None:
        self._set_state("stopped", "the engine was stopped")
        if self._supervisor is not None:
            self._supervisor.cancel()
            try:
                await self._supervisor
            except asyncio.CancelledError:
                pass
        llm, self._llm = self._llm, None
        if llm is not None:
            # In a thread: the event loop goes on (a shutdown bounds this wait, and the
            # health port's heartbeat beats), and vLLM waits for its processes to end.
            await asyncio.to_thread(llm.shutdown)
        if self._cores_before is not None:
            pin_threads(os.getpid(), self._cores_before)
            self._cores_before = None

    def stats(self) -> EngineStats:
        return self._stats.snapshot()

    async def abort(self, request_id: str) -> None:
        if self.healthy:
            await self._llm.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if not self.healthy:
            await self._until_running()
        # vLLM's "the request is at fault" errors are not ValueErrors in every version.
        from vllm.exceptions import VLLMClientError

        try:
            params = _sampling_params(request.sampling)
        except (ValueError, VLLMClientError) as exc:
            raise InvalidRequestError(str(exc), getattr(exc, "parameter", None)) from exc
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        llm = self._llm  # a restart replaces self._llm; this request belongs to this one
        self._stats.work_arrived(time.monotonic())
        seqs = _Sequences(self._tokenizer, request.sampling.logprobs)
        stats = self._stats
        # every sequence of the request attends over its prompt, then its own output
        counted = len(request.prompt_token_ids) * max(1, int(getattr(request.sampling, "n", 1) or 1))
        stats.attend(counted)
        seen = 0  # output tokens counted so far
        try:
            async for out in llm.generate(
                prompt, params, request.request_id, priority=int(request.priority)
            ):
                sequences = seqs.update(out.outputs)
                output_tokens = sum(q.output_tokens for q in sequences)
                stats.attend(output_tokens - seen)
                counted, seen = counted + output_tokens - seen, output_tokens
                metrics = getattr(out, "metrics", None)
                first = sequences[0]
                yield EngineOutput(
                    request_id=request.request_id,
                    text=first.text,
                    delta_text=first.delta_text,
                    prompt_tokens=len(out.prompt_token_ids or request.prompt_token_ids),
                    output_tokens=output_tokens,
                    finished=out.finished,
                    finish_reason=first.finish_reason,
                    num_preemptions=int(getattr(metrics, "num_preemptions", 0) or 0),
                    sequences=sequences,
                    cached_tokens=_cached_tokens(out),
                )
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except (ValueError, VLLMClientError) as exc:
            raise InvalidRequestError(str(exc), getattr(exc, "parameter", None)) from exc
        except Exception as exc:
            if llm.errored and self._stopping:
                raise EngineError("the server is shutting down") from exc
            if llm.errored:
                # Not resent: the request may be what killed the engine.
                raise EngineError(
                    "the engine died while running this request; the server restarts it: "
                    "send the request again") from exc
            raise
        finally:
            stats.attend(-counted)
