"""An in-process engine for the fast test tier: the `Engine` contract without vLLM.

`FakeEngine` behaves like a small continuous-batching engine, closely enough that the server
cannot tell the difference through the contract (server/engine/base.py):

- a byte-level tokenizer (one token per UTF-8 byte after a BOS token), so prompt lengths are
  exact and text round-trips without a model;
- one step loop: each step gives every running request one token, in lockstep, as vLLM's
  batches do, and lasts what an engine profile says a step of that shape lasts
  (`EngineProfile.iteration_s(batch, prefill tokens, KV tokens)`: the committed `cpu-tiny`
  profile, fitted to vLLM's CPU engine on this kind of machine, unless another is given;
  `step_s=S` is a profile of constant steps), divided by `time_scale` (default 1: a test
  that measures no time runs the engine `FAST` times faster, as a faster machine of the same
  shape; the server measures it as it measures any engine); requests wait while their KV blocks do not
  fit, lower `priority` first; when a running request cannot grow, the lowest-ranked one is
  preempted (recomputed later, its prompt and output computed again as prefill);
- `max_tokens`, `min_tokens`, `ignore_eos` (an end-of-sequence token after `eos_after`
  tokens, if set) and `stop` strings end requests with vLLM's finish reasons; `seed` picks
  where in its phrase the text starts (the same seed and prompt give the same text);
- what it cannot do it refuses, as `InvalidRequestError` (a 400 naming the field): more than
  one sequence (`n`), `logprobs` and structured output (`response_format`). Sampling
  options that only change which tokens a model draws (temperature, top_p, top_k,
  penalties) are accepted and leave its text as it is: its text is not a model's;
- `abort` ends a stream with finish_reason "abort"; a consumer that stops iterating aborts
  its request (the cancellation contract);
- `stats()` reports KV usage, running/waiting, preemptions and the step time; step listeners
  (`StepStatistics`) and sample listeners (`StepSamples`: each busy step's duration and
  batch shape, the time model's input) hear every busy step, as vLLM's do;
- `info` before `start()` raises `EngineError`, as the real backends do;
- a prefix cache: a prompt's leading whole blocks (block hashes, as vLLM keys them) are
  stored once while running requests hold them, and those an earlier prompt had are
  reported as `cached_tokens` (vLLM's num_cached_tokens);
- it has no chat template (the server writes a plain transcript of chat messages);
- `kill()` makes it unhealthy and fails every stream with `EngineError`, as a dead engine
  core does; `revive()` brings it back. `SupervisedFakeEngine` is also `Supervised`, as the
  in-process vLLM engine is: a killed engine is restarted after `restart_delay_s`, at most
  `max_restarts` times, and then reported failed (the server then exits).

`FakeServer` runs the real application (`create_app(config, engine=FakeEngine())`) under
uvicorn on a free port in a background thread: real HTTP, real streaming and disconnects,
for httpx and the SDK alike, in about a tenth of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from server.engine.base import (
    NOT_RUNNING,
    NOT_STARTED,
    ChatMessages,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InvalidRequestError,
    SampleListener,
    StateListener,
    StepListener,
    check_request,
)
from server.scheduler.prefix import block_chain
from server.shared.profiles import EngineProfile, get_profile
from server.shared.step_time import StepSample
from tests.support.clients import local_client

BOS, EOS = 1, 2
BYTE_OFFSET = 3  # ids 3..258 are the 256 byte values
FAKE_MODEL = "justitia-fake"
# The name it reports step samples under (vLLM's in-process engine reports "local").
ENGINE_NAME = "fake"
# The profile its steps last by default: vLLM's CPU engine with the tiny model, as fitted.
DEFAULT_PROFILE = "cpu-tiny"
# The time scale of the fast tier's shared servers (the `server` and `fake_server` fixtures):
# their tests measure no time, and a step of 0.6 ms instead of 2.5 ms keeps the same
# batches, preemptions and order (every step still yields to the event loop).
FAST = 4.0
# What the fake "generates": readable text, so that stop strings can be tested.
PHRASE = "the quick brown fox jumps over the lazy dog "


def encode(text: str) -> list[int]:
    """BOS, then one id per UTF-8 byte (text that is not valid UTF-8 raises ValueError)."""
    return [BOS, *(b + BYTE_OFFSET for b in text.encode("utf-8"))]


def decode(ids: list[int]) -> str:
    data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
    return data.decode("utf-8", errors="replace")


@dataclass
class _Running:
    request: EngineRequest
    arrival: int  # order of submission: ties in priority go first come, first served
    queue: asyncio.Queue[EngineOutput | BaseException]
    offset: int  # where in PHRASE this request's text starts (depends on the prompt)
    text: str = ""
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    done: bool = False
    sent: int = 0  # characters of `text` already sent as delta_text
    cached: int = 0  # prompt tokens found in the prefix cache
    computed: bool = False  # its context is in the KV cache (false again once preempted)
    shared: tuple[str, ...] = ()  # ids of its leading whole prompt blocks (stored once)

    @property
    def rank(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)


class FakeEngine:
    """See the module docstring. Everything runs on the event loop that called `start()`."""

    def __init__(
        self,
        *,
        kv_capacity_tokens: int = 4096,
        block_size: int = 32,
        max_model_len: int = 2048,
        vocab_size: int = 512,
        profile: EngineProfile | str = DEFAULT_PROFILE,
        step_s: float | None = None,
        max_num_seqs: int = 256,
        eos_after: int | None = None,
        model: str = FAKE_MODEL,
        time_scale: float = 1.0,
    ) -> None:
        if kv_capacity_tokens < max_model_len:
            raise ValueError("kv_capacity_tokens must hold one request of max_model_len")
        if not time_scale > 0:
            raise ValueError("time_scale must be positive")
        self.time_scale = time_scale
        self.model = model
        self._planned = EngineInfo(model=model, kv_capacity_tokens=kv_capacity_tokens,
                                   block_size=block_size, max_model_len=max_model_len,
                                   vocab_size=vocab_size)
        self._info: EngineInfo | None = None
        # How long each step lasts: a profile's step time for the step's shape.
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        if step_s is not None:
            self.profile = constant_steps(step_s)
        self.max_num_seqs = max_num_seqs
        self.eos_after = eos_after
        self._healthy = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._waiting: list[_Running] = []
        self._running: list[_Running] = []
        self._arrivals = 0
        self._listeners: list[StepListener] = []
        self._sample_listeners: list[SampleListener] = []
        self._preemptions_total = 0
        self._steps_total = 0
        self._iteration_time_s: float | None = None
        # What tests look at: every request the engine was given, and the aborted ids.
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.peak_running = 0
        self._seen_blocks: set[str] = set()  # block-hash ids of every prompt so far
        self._shared_refs: dict[str, int] = {}  # block id -> running requests holding it

    # -- the contract: identity and lifecycle ---------------------------------------------
    @property
    def info(self) -> EngineInfo:
        """The model and the limits; EngineError before `start()`, as every engine."""
        if self._info is None:
            raise EngineError(NOT_STARTED)
        return self._info

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (the embedded tiny model's) for what reads model text
        with one, as vLLM's tool-call parsers do; the fake's own token ids stay bytes."""
        from transformers import PreTrainedTokenizerFast

        from server.engine.tiny_model import _build_tokenizer

        return PreTrainedTokenizerFast(tokenizer_object=_build_tokenizer())

    def last_prompt_text(self) -> str:
        """The text of the last prompt the engine was given."""
        return decode(list(self.requests[-1].prompt_token_ids))

    async def start(self) -> None:
        self._info = self._planned
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._healthy = True
        self._task = asyncio.create_task(self._step_loop(), name="fake-engine-steps")

    async def close(self) -> None:
        self._die(EngineError("the engine was closed"))

    def tokenize(self, text: str) -> list[int]:
        self.info  # noqa: B018  (EngineError before start, as every engine)
        return encode(text)

    def apply_chat_template(self, messages: ChatMessages, tools: Sequence[dict[str, Any]] | None = None) -> str | None:
        return None  # no template, as the embedded tiny model

    def add_step_listener(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    def add_sample_listener(self, listener: SampleListener) -> None:
        self._sample_listeners.append(listener)

    def stats(self) -> EngineStats:
        used = self._used_blocks() * self._planned.block_size
        return EngineStats(
            kv_usage=used / self._planned.kv_capacity_tokens,
            running=len(self._running),
            waiting=len(self._waiting),
            preemptions_total=self._preemptions_total,
            iteration_time_s=self._iteration_time_s,
            steps_total=self._steps_total,
        )

    # -- the contract: requests -------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        if not self._healthy:
            raise EngineError(NOT_RUNNING)
        check_request(request, self.info)  # what vLLM refuses when the request reaches it
        refuse_unsupported(request)
        self.requests.append(request)
        prompt = request.prompt_token_ids
        chain = block_chain(prompt, self.info.block_size)
        run = _Running(request, self._arrivals, asyncio.Queue(),
                       offset=(sum(prompt) + (request.sampling.seed or 0)) % len(PHRASE),
                       cached=self._cache(chain),
                       shared=tuple(key for key, _ in chain))
        self._arrivals += 1
        self._waiting.append(run)
        assert self._wake is not None
        self._wake.set()
        try:
            while True:
                item = await run.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # The consumer stopped early (client gone, agent cancelled): free its KV now.
            if not run.done:
                self._drop(run)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        for run in (*self._running, *self._waiting):
            if run.request.request_id == request_id and not run.done:
                self._finish(run, "abort")

    # -- faults -------------------------------------------------------------------------------
    def kill(self) -> None:
        """The engine dies: unhealthy, every stream fails with EngineError. Callable from
        any thread (a test's thread while the server runs on its own)."""
        self._call_on_loop(lambda: self._die(EngineError("the engine died")))

    def revive(self) -> None:
        """Back to healthy with a fresh step loop (a restarted engine core)."""

        def back() -> None:
            self._healthy = True
            self._task = asyncio.create_task(self._step_loop(), name="fake-engine-steps")

        self._call_on_loop(back)

    def _call_on_loop(self, fn: Callable[[], None]) -> None:
        assert self._loop is not None, "the engine has not started"
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            fn()
            return
        done = threading.Event()

        def call() -> None:
            try:
                fn()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(call)
        assert done.wait(10), "the engine's event loop did not run the call"

    def _die(self, error: EngineError) -> None:
        self._healthy = False
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for run in (*self._running, *self._waiting):
            run.done = True
            run.queue.put_nowait(error)
        self._running.clear()
        self._waiting.clear()
        self._shared_refs.clear()

    # -- the step loop ---------------------------------------------------------------------
    async def _step_loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            started = time.monotonic()
            prefill = self._admit()
            kv_tokens = sum(len(r.request.prompt_token_ids) + r.generated for r in self._running)
            in_use = float(self._used_blocks() * self._planned.block_size)  # during the step
            await asyncio.sleep(self.step_time(len(self._running), prefill, kv_tokens))
            decoded = self._step()
            if decoded:
                self._heard(time.monotonic() - started, decoded, prefill, kv_tokens, in_use)

    def step_time(self, batch: int, prefill: int, kv_tokens: int) -> float:
        """How long a step of this shape lasts: the profile's time, on the engine's clock."""
        return self.profile.iteration_s(batch, prefill, kv_tokens) / self.time_scale

    def _heard(self, dt: float, decoded: int, prefill: int, kv_tokens: int, in_use: float) -> None:
        """A busy step's duration and shape, to the stats and the listeners."""
        prev = self._iteration_time_s
        self._iteration_time_s = dt if prev is None else 0.9 * prev + 0.1 * dt
        for listener in self._listeners:
            listener(dt, in_use)
        if self._sample_listeners:
            sample = StepSample(dt, decoded, prefill, kv_tokens)
            for sample_listener in self._sample_listeners:
                sample_listener(ENGINE_NAME, sample)

    def _step(self) -> int:
        """Each running request's next token; how many requests produced one."""
        self._steps_total += 1
        decoded = 0
        for run in sorted(self._running, key=lambda r: r.rank):
            if run.done or run not in self._running:
                continue  # preempted by a higher-ranked request's growth in this step
            if self._grow(run):
                self._emit_token(run)
                decoded += 1
        self.peak_running = max(self.peak_running, len(self._running))
        return decoded

    def _blocks_for(self, run: _Running) -> int:
        """Blocks of its own (its shared prompt blocks are counted once, in _shared_refs)."""
        tokens = len(run.request.prompt_token_ids) + run.generated + 1
        return -(-tokens // self._planned.block_size) - len(run.shared)

    def _used_blocks(self) -> int:
        return sum(r.blocks for r in self._running) + len(self._shared_refs)

    def _free_blocks(self) -> int:
        total = self._planned.kv_capacity_tokens // self._planned.block_size
        return total - self._used_blocks()

    def _hold(self, run: _Running) -> None:
        for key in run.shared:
            self._shared_refs[key] = self._shared_refs.get(key, 0) + 1

    def _unhold(self, run: _Running) -> None:
        for key in run.shared:
            left = self._shared_refs.get(key, 0) - 1
            if left > 0:
                self._shared_refs[key] = left
            else:
                self._shared_refs.pop(key, None)

    def _admit(self) -> int:
        """Admit what fits, by rank; the prompt tokens it computes in this step (prefill: a
        new prompt past its cached blocks, or a preempted request's whole context again)."""
        prefill = 0
        self._waiting.sort(key=lambda r: r.rank)
        while self._waiting and len(self._running) < self.max_num_seqs:
            run = self._waiting[0]
            need = self._blocks_for(run)
            if need + sum(k not in self._shared_refs for k in run.shared) > self._free_blocks():
                break
            self._waiting.pop(0)
            run.blocks = need
            self._hold(run)
            self._running.append(run)
            context = len(run.request.prompt_token_ids) + run.generated
            prefill += context if run.preemptions else context - run.cached
        return prefill

    def _grow(self, run: _Running) -> bool:
        """Room for `run`'s next token, preempting the lowest-ranked running requests if
        needed; False if `run` itself was the one preempted."""
        need = self._blocks_for(run) - run.blocks
        while need > self._free_blocks():
            victim = max(self._running, key=lambda r: r.rank)
            self._preempt(victim)
            if victim is run:
                return False
        run.blocks += need
        return True

    def _preempt(self, run: _Running) -> None:
        self._running.remove(run)
        self._unhold(run)
        run.blocks = 0
        run.preemptions += 1
        self._preemptions_total += 1
        self._waiting.append(run)

    def _emit_token(self, run: _Running) -> None:
        s = run.request.sampling
        run.generated += 1
        eos = (self.eos_after is not None and run.generated >= self.eos_after
               and not s.ignore_eos and run.generated >= s.min_tokens)
        if eos:
            self._finish(run, "stop")
            return
        run.text += PHRASE[(run.offset + run.generated - 1) % len(PHRASE)]
        if run.generated >= s.min_tokens:
            for stop in s.stop:
                at = run.text.find(stop)
                if at >= 0:
                    run.text = run.text[:at]  # vLLM leaves the stop string out
                    self._finish(run, "stop")
                    return
        if run.generated >= s.max_tokens:
            self._finish(run, "length")
        else:
            self._send(run, finished=False, reason=None)

    def _finish(self, run: _Running, reason: str) -> None:
        self._send(run, finished=True, reason=reason)
        self._drop(run)

    def _send(self, run: _Running, finished: bool, reason: str | None) -> None:
        run.queue.put_nowait(EngineOutput(
            request_id=run.request.request_id,
            text=run.text,
            delta_text=run.text[run.sent:],
            prompt_tokens=len(run.request.prompt_token_ids),
            output_tokens=run.generated,
            finished=finished,
            finish_reason=reason,
            num_preemptions=run.preemptions,
            cached_tokens=run.cached,
        ))
        run.sent = len(run.text)

    def _cache(self, chain: tuple[tuple[str, int], ...]) -> int:
        """Prompt tokens in leading whole blocks an earlier prompt had (then remember them)."""
        hit = 0
        for key, tokens in chain:
            if key not in self._seen_blocks:
                break
            hit = tokens
        self._seen_blocks.update(key for key, _ in chain)
        return hit

    def _drop(self, run: _Running) -> None:
        if run in self._running:
            self._unhold(run)
        run.done = True
        run.blocks = 0
        for queue in (self._running, self._waiting):
            with contextlib.suppress(ValueError):
                queue.remove(run)


def constant_steps(step_s: float) -> EngineProfile:
    """A profile whose every step lasts `step_s`, whatever its shape (a slow engine, for
    tests that need requests to stay running for a while)."""
    return EngineProfile(name=f"constant {step_s} s", kv_tokens=0, max_num_seqs=0, max_model_len=0,
                         base_s=step_s, per_seq_s=0.0, per_prefill_token_s=0.0,
                         per_kv_token_s=0.0, source="tests/support/fake_engine.py")


def refuse_unsupported(request: EngineRequest) -> None:
    """What the fake cannot do, refused by name rather than silently ignored."""
    s = request.sampling
    if s.n != 1:
        raise InvalidRequestError("the fake engine samples one sequence per request: n must be 1",
                                  param="n")
    if s.logprobs is not None:
        raise InvalidRequestError("the fake engine has no token probabilities: drop logprobs",
                                  param="logprobs")
    if s.json_object or s.json_schema is not None:
        raise InvalidRequestError("the fake engine has no structured output: drop response_format",
                                  param="response_format")


class SupervisedFakeEngine(FakeEngine):
    """A `FakeEngine` watched and restarted as the in-process vLLM engine is (`Supervised`):
    `kill()` makes it "restarting" (requests that wait are held, not failed); after
    `restart_delay_s` it runs again, at most `max_restarts` times; killed once more, it is
    "failed" for good."""

    def __init__(self, *, max_restarts: int = 1, restart_delay_s: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_restarts = max_restarts
        self.restart_delay_s = restart_delay_s
        self.restarts = 0
        self.state = "stopped"
        self.state_detail = ""
        self._state_listeners: list[StateListener] = []

    @property
    def recovering(self) -> bool:
        return self.state == "restarting"

    def add_state_listener(self, listener: StateListener) -> None:
        self._state_listeners.append(listener)

    def _set_state(self, state: str, detail: str = "") -> None:
        self.state, self.state_detail = state, detail
        for listener in self._state_listeners:
            listener(state, detail)

    async def start(self) -> None:
        self._set_state("starting")
        await super().start()
        self._set_state("running")

    def kill(self) -> None:
        def die() -> None:
            self._die(EngineError("the engine died"))
            if self.restarts >= self.max_restarts:
                self._set_state("failed", f"the engine died and {self.restarts} restarts are used up")
                return
            self._set_state("restarting", "the engine died; restarting it")
            assert self._loop is not None
            self._loop.call_later(self.restart_delay_s, self._restarted)

        self._call_on_loop(die)

    def _restarted(self) -> None:
        self.restarts += 1
        self._healthy = True
        self._task = asyncio.create_task(self._step_loop(), name="fake-engine-steps")
        self._set_state("running")


class FakeServer:
    """The real app on a `FakeEngine`, served by uvicorn on a free port in a thread.

    `FakeServer(tmp_dir, engine=FakeEngine(...), rate_limit=..., api_keys=...)`: keyword
    arguments are `ServerConfig` fields. Use it as a context manager; `url` and `engine` are
    what tests need.
    """

    def __init__(self, data_dir: str | Path, engine: Any = None,
                 header_timeout_s: float = 10.0, **config: Any) -> None:
        from server.api.config import ServerConfig

        self.header_timeout_s = header_timeout_s
        self.engine = engine or FakeEngine()
        # The grammar worker starts at the first JSON schema, not with every test's server.
        config.setdefault("grammar_warm_up", False)
        # The fake's steps are sleeps, which the event loop overshoots by a fraction of a
        # millisecond: checked against its warm-up, a profile of its own speed reads 1.2x.
        # Tests of the check (test_api.py) set the tolerance; the rest keep their profile.
        config.setdefault("prior_tolerance", 1e9)
        self.config = ServerConfig(data_dir=str(data_dir), **config)
        self.url = ""
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None

    def start(self, port: int | None = None) -> FakeServer:
        """Serve on `port` (default: a free one) and return once /readyz answers 200."""
        import uvicorn

        from server.api.app import create_app
        from server.api.http import uvicorn_config
        from server.launcher import free_port

        app = self.app = create_app(self.config, engine=self.engine,
                                    model_name=self.engine.model)
        port = port or free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._uvicorn = uvicorn.Server(uvicorn_config(
            app, "127.0.0.1", port, log_level="warning", lifespan="on",
            header_timeout_s=self.header_timeout_s))
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True,
                                        name=f"fake-server-{port}")
        self._thread.start()
        # the app waits up to a minute for a grammar worker to load (`grammar_warm_up`)
        deadline = time.monotonic() + (90 if self.config.grammar_warm_up else 30)
        with local_client(base_url=self.url, timeout=2) as probe:
            while not self._ready(probe):
                assert self._thread.is_alive(), "the fake server's thread died while starting"
                assert time.monotonic() < deadline, "the fake server did not become ready"
                time.sleep(0.02)
        return self

    @staticmethod
    def _ready(probe: httpx.Client) -> bool:
        try:
            return probe.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    @property
    def running(self) -> bool:
        """The server still serves (it stops itself when its engine fails for good)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._uvicorn is not None and self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(30)
            assert not self._thread.is_alive(), "the fake server did not stop"
            self._uvicorn = None

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
