"""The engine's warm-up before the server is ready: batches of several lengths, each request
fitted to the engine, none sharing another's prefix (server/api/app.py)."""

from __future__ import annotations

from server.api.app import WARM_UP_BATCH, WARM_UP_ROUNDS, warm_up_requests
from server.engine.base import EngineInfo
from tests.support.fake_engine import FakeEngine, FakeServer

TEXT = list(range(100, 140))


def _info(max_model_len: int, kv_tokens: int) -> EngineInfo:
    return EngineInfo(model="m", kv_capacity_tokens=kv_tokens, block_size=16, max_model_len=max_model_len)


def test_the_batch_has_every_length_and_no_shared_prefix() -> None:
    requests = warm_up_requests(_info(4096, 8192), TEXT)
    assert [(len(r.prompt_token_ids), r.sampling.max_tokens) for r in requests] == list(WARM_UP_BATCH)
    # no two prompts start alike: the prefix cache would make their prefill free
    assert len({r.prompt_token_ids[:16] for r in requests}) == len(requests)
    assert len({r.request_id for r in requests}) == len(requests)
    # the next round's prompts are new too
    again = warm_up_requests(_info(4096, 8192), TEXT, round_=1)
    assert not {r.prompt_token_ids for r in again} & {r.prompt_token_ids for r in requests}


def test_each_request_fits_a_small_engine() -> None:
    requests = warm_up_requests(_info(300, 200), TEXT)
    assert requests and all(len(r.prompt_token_ids) + r.sampling.max_tokens <= 200 for r in requests)
    assert warm_up_requests(_info(300, 200), []) == []


def test_a_fresh_server_has_run_the_warm_up_before_it_is_ready(tmp_path) -> None:
    engine = FakeEngine()
    with FakeServer(tmp_path, engine=engine):
        warm = [r for r in engine.requests if r.request_id.startswith("justitia-warmup")]
    assert len(warm) == WARM_UP_ROUNDS * len(WARM_UP_BATCH)
    assert {len(r.prompt_token_ids) for r in warm} == {p for p, _ in WARM_UP_BATCH}
