"""The remote engine (`--engine-url`) on the shared placement, against a small stand-in for
vLLM's OpenAI server on loopback (its `/v1/models`, `/metrics` and streamed completions):
M from the server's KV cache, the replica listed, a request streamed and its tokens given
back to the ledger, the server going down and coming back. The real vLLM server behind it
is tests/engine/test_remote_engine.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from server.engine.base import EngineError, EngineRequest, SamplingOptions
from server.engine.remote import RemoteVLLMEngine

BLOCKS, BLOCK = 65, 32  # (65 - 1) x 32 = 2,048 KV tokens


def stub_vllm() -> web.Application:
    state = {"generated": 0}

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub-model", "root": "stub-root", "max_model_len": 1024}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=(
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="{BLOCKS}"}} 1.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"
            f"# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total {state['generated']}.0\n"))

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for i in range(n):
            state["generated"] += 1
            choice = {"index": 0, "text": f"t{i} ", "finish_reason": "length" if i == n - 1 else None}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(0.01)
        usage = {"completion_tokens": n, "prompt_tokens": len(body["prompt"])}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture()
async def served() -> AsyncIterator[tuple[web.AppRunner, str]]:
    from server.launcher import free_port

    runner = web.AppRunner(stub_vllm())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield runner, f"http://127.0.0.1:{port}"
    await runner.cleanup()


class ByteTokenizer:
    """The stand-in names no real model: a prompt's tokens are its bytes."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def remote(url: str, monkeypatch: pytest.MonkeyPatch) -> RemoteVLLMEngine:
    engine = RemoteVLLMEngine(url, poll_interval_s=0.05)
    monkeypatch.setattr(engine, "_load_tokenizer", lambda model: ByteTokenizer())
    return engine


@pytest.mark.anyio
async def test_one_server_as_a_replica_of_one(served, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, url = served
    engine = remote(url, monkeypatch)
    heard: list[int] = []
    engine.add_capacity_listener(heard.append)
    await engine.start()
    try:
        assert engine.info.kv_capacity_tokens == engine.capacity == (BLOCKS - 1) * BLOCK
        assert engine.info.model == "stub-root" and engine.info.served_name == "stub-model"
        [row] = engine.describe_replicas()
        assert (row["id"], row["state"], row["kv_capacity_tokens"], row["url"]) == (url, "serving", 2048, url)
        assert engine.place("q1", "agent", 300)
        assert engine.describe_replicas()[0]["reserved_tokens"] == 300
        request = EngineRequest("q1", tuple(range(1, 41)), SamplingOptions(max_tokens=8, ignore_eos=True))
        outs = [o async for o in engine.generate(request)]
        assert outs[-1].finished and outs[-1].output_tokens == 8 and outs[-1].finish_reason == "length"
        [row] = engine.describe_replicas()
        assert row["reserved_tokens"] == 0 and row["requests_in_flight"] == 0
        await asyncio.sleep(0.2)  # a poll: the server's counters reach the replica's row
        assert engine.describe_replicas()[0]["generation_tokens"] >= 8
        assert engine.capacity_changes()[0]["M"] == 2048
        # the server stops answering: it is down, nothing runs, M keeps its value
        await runner.cleanup()
        for _ in range(100):
            if not engine.healthy:
                break
            await asyncio.sleep(0.05)
        assert not engine.healthy and heard == []
        with pytest.raises(EngineError, match="not answering"):
            async for _ in engine.generate(EngineRequest("q2", (1, 2, 3), SamplingOptions(max_tokens=2))):
                pass
    finally:
        await engine.close()
