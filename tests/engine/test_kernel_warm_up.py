"""A CPU engine builds its kernels for every batch size it can run before it takes requests
(server/engine/cpu_worker.py `warm_up_batch_sizes`, server/engine/vllm_local.py)."""

from __future__ import annotations

import asyncio

from server.engine.vllm_local import warm_batch_sizes


def test_a_started_engine_has_run_every_batch_size_it_can_hold_and_then_serves() -> None:
    from server.engine.base import EngineRequest, SamplingOptions
    from server.engine.tiny_model import embedded_engine_config
    from server.engine.vllm_local import LocalVLLMEngine

    async def run() -> tuple[int, int, list[int]]:
        # 2,048 tokens in blocks of 32: 64 usable blocks, so at most 64 sequences at once
        engine = LocalVLLMEngine(embedded_engine_config(kv_tokens=2048, max_model_len=1024, restarts=0))
        await engine.start()
        try:
            async def one(i: int) -> int:
                req = EngineRequest(f"r{i}", tuple(100 + i + k for k in range(40)),
                                    SamplingOptions(max_tokens=8, ignore_eos=True, temperature=0.0))
                tokens = 0
                async for out in engine.generate(req):
                    tokens = out.output_tokens
                return tokens
            made = await asyncio.gather(*(one(i) for i in range(3)))
            return engine.warmed_batch_sizes, engine.info.kv_capacity_tokens // engine.info.block_size, list(made)
        finally:
            await engine.close()

    warmed, blocks, made = asyncio.run(run())
    assert blocks == 64
    assert warmed == len(warm_batch_sizes(256, blocks)) == 64
    assert made == [8, 8, 8]
