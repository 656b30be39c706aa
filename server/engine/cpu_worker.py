"""vLLM's CPU worker with seeded sampling that survives chunked prefill, and that dies
with the server.

The fault (vLLM CPU 0.32): a request with a `seed` gets its own `torch.Generator`. When a
step only prefills part of a prompt (chunked prefill: the step's token budget ran out, which
under concurrent load is most steps that admit a long prompt), the token sampled for that
request is discarded, and the model runner rewinds the request's generator so that the
discarded draw does not shift its random sequence:
`gen.set_offset(gen.get_offset() - 4)` (gpu_model_runner.py, `_bookkeeping_sync`). That is
the offset of CUDA's Philox generator; a CPU generator (Mersenne Twister) has none and
raises `RuntimeError: CPU Generator does not use offset`, which kills the worker and with it
the whole engine.

The fix does the same rewind the CPU generator's way: the state of each generator whose
draw will be discarded is saved before sampling and put back after it, and the offset rewind
is skipped for those generators. A seeded request then draws exactly the numbers it would
draw if its prompt had been prefilled in one step, so the same seed and prompt give the same
text however the prompt was chunked (as on a GPU).

The worker also warms the model's kernels for every batch size the engine can run
(`warm_up_batch_sizes`): vLLM's CPU linear layers run oneDNN matmul primitives built for the
exact number of rows (tokens in the step, or requests for the logits), and building one
(JIT code generation) costs more than the step itself. Measured here on the embedded model:
the model and its logits over batches of 1-256 tokens took 4.5 s the first time and 1.2 s
the second. A fresh server's first minute ran steps of every new size slow: a 48-agent
workload (the family's `bursts`, seed 103) took a median mean JCT of 2.77 s on six fresh
servers without the build, 2.15 s on ten with it, 2.05 s on a server taught by another
workload first (docs/server.md, "On this machine").

It also makes the engine die with the server: vLLM's worker exits when its
EngineCore does (a pipe), but the EngineCore process outlives an API process that is killed
(SIGKILL, OOM killer), and keeps its memory and a core spinning. A thread in the worker
watches the API process and, when it is gone, kills the EngineCore and exits.

This module is imported in vLLM's worker process (the engine names the class through
`worker_cls`), so it imports vLLM at the top and nothing of the server beyond it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import psutil
import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

WORKER_CLS = f"{__name__}.SeedSafeCPUWorker"
ORPHAN_POLL_S = 1.0

log = logging.getLogger("justitia.engine.worker")


class SeedSafeCPUModelRunner(CPUModelRunner):
    """CPUModelRunner whose discarded seeded draws are undone by restoring generator state."""

    def _discarded_generators(self) -> dict[int, torch.Generator]:
        """Generators of this step's requests whose sampled token will be thrown away."""
        n = self.input_batch.num_reqs
        discard = self.discard_request_mask.np[:n]
        return {i: g for i, g in self.input_batch.generators.items() if i < n and discard[i]}

    def _sample(self, logits: Any, spec_decode_metadata: Any) -> Any:
        saved = {i: g.get_state() for i, g in self._discarded_generators().items()}
        try:
            return super()._sample(logits, spec_decode_metadata)
        finally:
            generators = self.input_batch.generators
            for i, state in saved.items():
                generators[i].set_state(state)

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        # The discarded draws were undone in `_sample`; hide those generators from the
        # offset rewind, which a CPU generator cannot do. The dict object is put back
        # unchanged (the sampling metadata holds the same one).
        generators = self.input_batch.generators
        discarded = self._discarded_generators()
        if not discarded:
            return super()._bookkeeping_sync(*args, **kwargs)
        self.input_batch.generators = {i: g for i, g in generators.items() if i not in discarded}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            self.input_batch.generators = generators


class SeedSafeCPUWorker(CPUWorker):
    """CPUWorker that runs `SeedSafeCPUModelRunner` (vLLM's V1 runner; the CPU build has no
    Triton, so it never picks the V2 runner)."""

    def init_device(self) -> None:
        super().init_device()
        # The runner is built inside CPUWorker.init_device; re-classing the built instance
        # keeps vLLM's construction (buffers, config) exactly as it is.
        if type(self.model_runner) is CPUModelRunner:
            self.model_runner.__class__ = SeedSafeCPUModelRunner
        _die_with_the_server()

    def warm_up_batch_sizes(self, sizes: list[int]) -> list[int]:
        """Run the model once on a batch of each size of tokens, and its logits on as many
        rows (up to the requests a step can hold), so that the kernels of each size are built
        before a request waits for them. The engine core calls it between steps (vLLM's
        `collective_rpc`); the sizes run are returned."""
        runner: Any = self.model_runner
        done = []
        with torch.inference_mode():
            for n in sizes:
                hidden, _ = runner._dummy_run(n)
                if n <= runner.max_num_reqs:
                    runner.model.compute_logits(hidden[:n])
                done.append(n)
        return done


def _die_with_the_server() -> None:
    """Kill the EngineCore (this worker's parent) and exit once the API process (its
    parent) is gone. `is_running` compares start times, so a reused pid does not fool it;
    a killed server that its own parent has not reaped yet is a zombie, and gone too."""
    try:
        engine_core = psutil.Process(os.getppid())
        server = engine_core.parent()
    except psutil.Error:
        return
    if server is None:
        return

    def alive() -> bool:
        try:
            return server.is_running() and server.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            time.sleep(ORPHAN_POLL_S)
        log.error("the API process %d is gone: stopping the engine (EngineCore %d)",
                  server.pid, engine_core.pid)
        try:
            engine_core.kill()
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="justitia-orphan-watchdog", daemon=True).start()
