"""JSON schemas compiled under a time budget, before the engine sees them.

`response_format: {"type": "json_schema"}` is served by the engine's structured outputs
(xgrammar), which compile the schema into a grammar. A grammar's size has little to do with
its schema's: a 48-byte pattern (`^(ab|cd){5000}$`) or a long enum compiles for seconds to
minutes, inside the engine process, delaying every tenant; some schemas fail a check of the
compiler there. So the server compiles each schema first, here, in a worker process of its
own (at the lowest CPU priority, on one thread, off the cores of the engine's model worker,
off the event loop and off the engine's path):

- within `--grammar-timeout` seconds (default 2): the request goes on;
- over it: the worker is killed and replaced, and the request gets a 400;
- refused by the compiler: a 400 with the compiler's message.

Outcomes are cached by the schema's hash (a schema is compiled once, however often it is
sent), and concurrent requests with the same schema share one compile. Compiles run one at
a time, so a tenant sending pathological schemas costs at most one core-share of the budget
at a time and never the engine's time. Without xgrammar installed (the fake engine of the
fast tests), only the structural limits of server/api/request_limits.py apply.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import multiprocessing
import os
from typing import Any

from predictors.worker import init_helper
from server.api.request_limits import RequestLimitExceeded
from server.engine.processes import keep_to_spare_cpu, without_sigint

log = logging.getLogger("justitia.grammar")

#: Schemas whose outcome is remembered (each entry: a hash and a short message).
CACHE_SIZE = 4096
#: A compiler's refusal is cut to this many characters in the 400 (some quote the schema).
MAX_REFUSAL_CHARS = 500

_compiler: Any = None


def available() -> bool:
    """Whether a grammar compiler is installed here."""
    import importlib.util

    return importlib.util.find_spec("xgrammar") is not None


def compile_schema(schema_text: str) -> str | None:
    """In the worker: compile `schema_text` as the engine's backend would; the compiler's
    complaint, or None when it compiled (or when there is no compiler)."""
    global _compiler
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    try:
        if _compiler is None:
            # A byte-level vocabulary: the grammar's own size is what is measured; the
            # engine's vocabulary of the tiny model is of the same order.
            info = xgr.TokenizerInfo([bytes([i]) for i in range(256)])
            _compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        _compiler.compile_json_schema(schema_text, any_whitespace=False)
    except Exception as exc:  # noqa: BLE001 - any refusal of the compiler is the request's
        return f"{type(exc).__name__}: {exc}"[:MAX_REFUSAL_CHARS]
    return None


class GrammarChecker:
    """Compiles schemas in one worker process with a time budget per schema."""

    def __init__(self, timeout_s: float, enabled: bool | None = None) -> None:
        self.timeout_s = timeout_s
        self.enabled = available() if enabled is None else enabled
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._turn = asyncio.Lock()
        self._cache: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._inflight: dict[str, asyncio.Future[str | None]] = {}
        self._restarting: asyncio.Task[None] | None = None
        self.compiles = 0
        self.timeouts = 0
        self.refusals = 0

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # spawn: forking a process that runs threads (uvicorn, the engine's) is unsafe
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            # Dies with the server, kill -9 included (the pool may spawn it from any thread, so
            # the parent's pid is polled rather than tied to the forking thread by the kernel),
            # and runs on the CPU the engine leaves spare.
            initializer=init_helper, initargs=(os.getpid(), False, keep_to_spare_cpu))

    async def start(self) -> None:
        """Start the worker and load the compiler, so that the first schema's budget is
        spent compiling it, not starting a process."""
        if not self.enabled:
            return
        async with self._turn:
            try:
                await self._warm()
            except Exception:  # noqa: BLE001 - the first compile will try again
                log.exception("the grammar worker did not start")
                self._kill()

    async def _warm(self) -> None:
        if self._pool is None:
            self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        # SIGINT blocked while the pool may spawn its worker (the worker inherits the block):
        # a terminal's Ctrl-C is the server's to handle (server/runtime/shutdown.py), and a worker
        # that took it mid-import would break the server's shutdown.
        await without_sigint(loop.run_in_executor, self._pool, compile_schema, '{"type": "string"}')

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def _restart(self) -> None:
        """A new worker, loading its compiler now rather than at the next schema."""
        self._restarting = asyncio.get_running_loop().create_task(self.start())

    async def close(self) -> None:
        if self._restarting is not None:
            self._restarting.cancel()
        self._kill()

    async def check(self, schema_text: str) -> None:
        """Return when `schema_text` compiles within the budget; raise
        RequestLimitExceeded (a 400) when it does not or the compiler refuses it."""
        if not self.enabled:
            return
        key = hashlib.sha256(schema_text.encode()).hexdigest()
        if key in self._cache:
            self._cache.move_to_end(key)
            problem = self._cache[key]
        elif key in self._inflight:
            problem = await asyncio.shield(self._inflight[key])
        else:
            future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            self._inflight[key] = future
            try:
                problem = await self._compile(schema_text)
                self._remember(key, problem)
                future.set_result(problem)
            except BaseException as exc:
                future.set_exception(exc)
                future.exception()  # retrieved: no warning when nobody else waits
                raise
            finally:
                del self._inflight[key]
        if problem is not None:
            raise RequestLimitExceeded(problem, param="response_format")

    def _remember(self, key: str, problem: str | None) -> None:
        self._cache[key] = problem
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    async def _compile(self, schema_text: str) -> str | None:
        async with self._turn:  # one compile at a time; the budget starts when it runs
            if self._pool is None:
                await self._warm()
            assert self._pool is not None
            loop = asyncio.get_running_loop()
            self.compiles += 1
            job = without_sigint(loop.run_in_executor, self._pool, compile_schema, schema_text)
            try:
                problem = await asyncio.wait_for(job, self.timeout_s)
            except TimeoutError:
                self.timeouts += 1
                log.warning("a JSON schema did not compile within %.1f s: refused", self.timeout_s)
                self._kill()
                self._restart()
                return (f"the JSON schema's grammar did not compile within {self.timeout_s:g} s "
                        "(the server's --grammar-timeout): simplify the schema (shorter enums, "
                        "fewer properties, smaller counted repetitions)")
            except concurrent.futures.process.BrokenProcessPool:
                self._kill()  # the compiler crashed on it: refused, and a new worker
                self._restart()
                return "the JSON schema's grammar crashed the grammar compiler"
            if problem is not None:
                self.refusals += 1
                return f"the grammar compiler refuses the JSON schema: {problem}"
            return None
