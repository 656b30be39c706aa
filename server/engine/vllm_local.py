"""In-process vLLM engine backend (AsyncLLM): the GPU build, or the CPU build here.

vLLM is imported only when the engine starts, so the rest of the server (and the CLI's
help) never pays for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator
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
    StateListener,
    StepListener,
)
from server.engine.processes import (
    PINNING,
    deprioritise_engine_core,
    keep_off_worker_cores,
    pin_threads,
    without_sigint,
)
from server.engine.tokens import TokenizerEngine, fast_encoder
from server.engine.vllm_outputs import Sequences, cached_tokens, engine_times, sampling_params
from server.engine.vllm_stats import StatsCollector, stat_logger_factory

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
    # CPU only: niceness of vLLM's EngineCore process (see deprioritise_engine_core).
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


def warm_batch_sizes(max_num_seqs: int, usable_blocks: int) -> list[int]:
    """The batch sizes a CPU engine warms its kernels for before it runs: 1 to the most
    sequences it can hold at once (one block each at least, `max_num_seqs` at most)."""
    return list(range(1, max(0, min(max_num_seqs, usable_blocks)) + 1))


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
        self._stats = StatsCollector()
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
        # Batch sizes whose kernels the worker built before the engine ran (CPU only).
        self.warmed_batch_sizes = 0

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
                stat_loggers=[stat_logger_factory(self._stats)]
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
            max_num_batched_tokens=int(vcfg.scheduler_config.max_num_batched_tokens or 0),
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
            deprioritise_engine_core(cfg.engine_core_nice)
            if PINNING and self._cores_before is None:  # a restart keeps the first start's
                self._cores_before = set(os.sched_getaffinity(0))
            keep_off_worker_cores()
            await self._warm_up_batch_sizes(blocks - 1)

    async def _warm_up_batch_sizes(self, usable_blocks: int) -> None:
        """Build the CPU kernels of every batch size the engine can run (see
        server/engine/cpu_worker.py): at most one sequence per usable block, and at most
        `max_num_seqs`. Prefill steps of more tokens still build theirs when first met."""
        sizes = warm_batch_sizes(self.config.max_num_seqs, usable_blocks)
        started = time.perf_counter()
        try:
            [done] = await self._llm.collective_rpc("warm_up_batch_sizes", args=(sizes,))
        except Exception as exc:  # only speed is lost: the kernels are built when first met
            log.warning("the engine's kernels could not be built ahead (%s): the first steps "
                        "of each batch size will be slow", exc)
            return
        self.warmed_batch_sizes = len(done)
        log.info("the engine's kernels are built for batches of 1-%d tokens (%.1f s)",
                 len(done), time.perf_counter() - started)

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
            params = sampling_params(request.sampling)
        except (ValueError, VLLMClientError) as exc:
            raise InvalidRequestError(str(exc), getattr(exc, "parameter", None)) from exc
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        llm = self._llm  # a restart replaces self._llm; this request belongs to this one
        self._stats.work_arrived(time.monotonic())
        seqs = Sequences(self._tokenizer, request.sampling.logprobs)
        stats = self._stats
        # every sequence of the request attends over its prompt, then its own output
        counted = len(request.prompt_token_ids) * max(1, int(getattr(request.sampling, "n", 1) or 1))
        stats.attend(counted)
        seen = 0  # output tokens counted so far
        sent_at = time.monotonic()
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
                    cached_tokens=cached_tokens(out),
                    times=engine_times(metrics, sent_at, time.monotonic()) if out.finished else None,
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
