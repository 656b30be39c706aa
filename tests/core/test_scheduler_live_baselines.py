"""The live scheduler runs ewsjf and equinox like any policy (`justitia serve --policy ...`),
here in front of a stand-in engine (no vLLM): requests flow, finish, cancel, and the
dispatcher's and the policy's bookkeeping return to zero."""

import asyncio

import pytest

from server.engine.base import EngineInfo, EngineOutput, EngineStats, SamplingOptions
from server.runtime.live import AgentConflict, LiveConfig, LiveScheduler


class StandInEngine:
    """Generates `max_tokens` tokens, one per event-loop turn; at most `slots` at a time."""

    info = EngineInfo(model="stand-in", kv_capacity_tokens=4096, block_size=16, max_model_len=2048)
    healthy = True

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.peak = 0

    async def generate(self, request):
        self.running.add(request.request_id)
        self.peak = max(self.peak, len(self.running))
        try:
            n = request.sampling.max_tokens
            for k in range(1, n + 1):
                await asyncio.sleep(0)
                if request.request_id in self.aborted:
                    yield EngineOutput(request.request_id, "", len(request.prompt_token_ids), k, True, "abort")
                    return
                yield EngineOutput(request.request_id, "x", len(request.prompt_token_ids), k, k == n,
                                   "length" if k == n else None)
        finally:
            self.running.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running))


@pytest.mark.parametrize("policy", ["ewsjf", "equinox"])
def test_live_scheduler_serves_finishes_and_cancels(policy):
    async def main():
        engine = StandInEngine()
        live = LiveScheduler(engine, LiveConfig(policy=policy, max_num_seqs=4))
        entries = [live.register("t", "prompt " * 20, "tenant", predicted_cost=1e5) for _ in range(4)]

        async def one(entry, k, tokens):
            sampling = SamplingOptions(max_tokens=tokens, ignore_eos=True)
            last = None
            async for out in live.run(entry, f"{entry.id}-{k}", tuple(range(30)), sampling):
                last = out
            return last.output_tokens

        async def agent(entry, n, tokens):
            outs = await asyncio.gather(*(one(entry, k, tokens) for k in range(n)))
            await live.finish(entry)
            return outs

        victim = live.register("t", "prompt", "tenant", predicted_cost=1e5)
        doomed = asyncio.gather(*(one(victim, k, 50) for k in range(6)), return_exceptions=True)
        await asyncio.sleep(0)
        results = await asyncio.gather(*(agent(e, 5, 4 + 3 * i) for i, e in enumerate(entries)),
                                       live.cancel(victim))
        cancelled = await doomed
        assert [sorted(r) for r in results[:-1]] == [[4 + 3 * i] * 5 for i in range(4)]
        assert all(isinstance(x, (AgentConflict, int)) for x in cancelled)
        assert engine.peak <= 4
        assert all(e.state == "finished" for e in entries) and victim.state == "cancelled"
        assert live.dispatcher.is_idle()
        snap = live.dispatcher.snapshot(live.now())
        assert snap["policy"] == policy and snap["pending_requests"] == 0

    asyncio.run(main())
