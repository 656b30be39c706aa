"""`bench live`'s replay client (justitia_cli/bench/live_run.py) against the real app on the
fake engine: a replay's clock starts when it is told to, as a taught run's does after the
teaching's lull (the replays on the real engine are in tests/engine/test_bench_live.py)."""

from __future__ import annotations

import asyncio
import time

from justitia_cli.bench.live_run import VOCAB_HIGH, LiveOptions, _replay
from server.sim.workload import AgentSpec
from tests.support.fake_engine import FAST, FakeEngine, FakeServer
from tests.support.servers import ENGINE_KV_TOKENS, ENGINE_MAX_MODEL_LEN


def test_a_replay_starts_its_clock_no_earlier_than_it_is_told(tmp_path) -> None:
    # the replay's prompts are token ids of the tiny model's vocabulary
    engine = FakeEngine(kv_capacity_tokens=ENGINE_KV_TOKENS, max_model_len=ENGINE_MAX_MODEL_LEN,
                        time_scale=FAST, vocab_size=VOCAB_HIGH)
    with FakeServer(tmp_path, engine=engine) as srv:
        replay_twice(srv.url)


def replay_twice(url: str) -> None:
    opts = LiveOptions(kv_tokens=ENGINE_KV_TOKENS, max_model_len=ENGINE_MAX_MODEL_LEN)
    teacher = [AgentSpec("t0", "chat", 0.0, [[(40, 4)]]), AgentSpec("t1", "chat", 0.05, [[(30, 4)], [(20, 4)]])]
    outs, taught = asyncio.run(_replay(url, teacher, opts, "justitia", None))
    assert [o.get("error") for o in outs] == [None, None]
    start_at = taught["replay_t0"] + max(a.arrival for a in teacher) + 0.3
    assert time.monotonic() < start_at  # still ahead: the replay has to wait for it
    member = [AgentSpec("m0", "chat", 0.0, [[(50, 4), (50, 4)]])]
    outs, snap = asyncio.run(_replay(url, member, opts, "justitia", None, start_at=start_at))
    assert snap["replay_t0"] >= start_at
    [out] = outs
    assert "error" not in out and out["finish"] >= out["arrival"] >= 0.0
    assert out["first"]["eta_s"] is not None
