"""A paused agent's context kept by `serve --retain always` stays resident in vLLM's prefix
cache while another agent's work runs, where a context left to vLLM's LRU is evicted by the
same work (docs/retention.md, on the live server). A server of its own on the real engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.agents import complete, register
from tests.support.servers import ENGINE_KV_TOKENS, ENGINE_MAX_MODEL_LEN, embedded_server

pytestmark = pytest.mark.engine

CONTEXT = 900  # prompt tokens of each kept or left context
FILLER = 800  # prompt tokens of each request of the other agent's work


@pytest.fixture(scope="module")
def always_server(justitia_home: str) -> Iterator[Any]:
    args = ["--kv-tokens", str(ENGINE_KV_TOKENS), "--max-model-len", str(ENGINE_MAX_MODEL_LEN),
            "--retain", "always"]
    with embedded_server(args, None, justitia_home) as srv:
        yield srv


def _ids(seed: int, n: int) -> list[int]:
    """A prompt of `n` token ids (the tiny model's vocabulary has 788) that shares no block
    with another seed's: their first tokens differ."""
    return [50 + (seed * 97 + 13 * k) % 700 for k in range(n)]


def _turn(c: httpx.Client, agent_id: str | None, prompt: list[int], max_tokens: int) -> dict:
    r = complete(c, agent_id, max_tokens, prompt=prompt, return_token_ids=True)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_kept_context_survives_other_work_that_evicts_one_left_to_lru(always_server: Any) -> None:
    with httpx.Client(base_url=always_server.url, timeout=120.0) as c:
        block = c.get("/v1/scheduler").json()["block_size"]
        # `left`: a conversation whose agent ended, so nothing keeps it (vLLM's LRU only)
        left = register(c, type_="chat")["id"]
        left_prompt = _ids(1, CONTEXT)
        left_out = _turn(c, left, left_prompt, 16)["choices"][0]["token_ids"]
        assert c.delete(f"/v1/agents/{left}").status_code in (200, 204)
        # `kept`: an agent paused between its turns, its context kept
        kept = register(c, type_="chat")["id"]
        kept_prompt = _ids(2, CONTEXT)
        kept_out = _turn(c, kept, kept_prompt, 16)["choices"][0]["token_ids"]
        snap = c.get("/v1/scheduler").json()["retention"]
        assert snap["retain"] == "always" and snap["kept_contexts"] == 1
        assert snap["kept_kv"] >= CONTEXT
        # another agent's work, one request after the other, allocates more than the whole
        # cache: under LRU it takes the blocks of both contexts
        other = register(c, type_="filler")["id"]
        for k in range(6):
            assert _cached(_turn(c, other, _ids(10 + k, FILLER), 8)) < block
        assert 6 * FILLER > ENGINE_KV_TOKENS
        # the paused agent comes back, resending its conversation: served from the cache
        back = _turn(c, kept, kept_prompt + kept_out + _ids(3, 20), 1)
        whole = (len(kept_prompt) + len(kept_out) - 1) // block * block
        assert _cached(back) >= whole - block
        # the conversation nobody kept was evicted by the same work
        again = _turn(c, None, left_prompt + left_out + _ids(4, 20), 1)
        assert _cached(again) < (len(left_prompt) // 2)
        after = c.get("/v1/scheduler").json()["retention"]
        # the first hold ended when its agent came back and was charged; both agents are
        # paused again, each with its context kept
        assert after["retained_kv_token_s"] > 0 and after["kept_contexts"] == 2
