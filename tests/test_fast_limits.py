"""Per-tenant limits in the fast tier: the engine tier's server tests of rate limits (429
with Retry-After, the SDK waiting it out) and request size caps (tests/test_limits.py),
run unchanged against the real app with the same options on the fake engine; plus the body
size limit (413) at a small `max_body_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from server.runtime.limits import Rate
from tests.fake_engine import FakeEngine, FakeServer
from tests.test_limits import (  # noqa: F401  (collected by pytest from this module)
    KEYS,
    RATE,
    test_a_burst_over_the_rate_is_refused_for_that_tenant_only,
    test_requests_over_the_tenants_size_cap_are_refused,
    test_the_sdk_waits_out_the_rate_limit,
)


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    # The engine tier's options: --rate-limit 0.5:3 --rate-limit carol=off
    # --rate-limit dave=off --max-request-tokens 64 --max-request-tokens dave=300
    engine = FakeEngine(kv_capacity_tokens=2048, max_model_len=512)
    with FakeServer(tmp_path_factory.mktemp("limited"), engine=engine,
                    api_keys={key: tenant for tenant, key in KEYS.items()},
                    rate_limit=Rate(RATE, 3.0), tenant_rate_limits={"carol": None, "dave": None},
                    max_request_tokens=64, tenant_max_request_tokens={"dave": 300}) as srv:
        yield srv


def _chunks(parts: int) -> Iterator[bytes]:
    """A JSON body sent chunked (no Content-Length): the limit can only count as it reads."""
    yield b'{"type": "t", "prompt": "x", "messages": [], "metadata": {"k": "'
    for _ in range(parts):
        yield b"y" * 500
    yield b'"}}'


def test_bodies_over_the_limit_are_413(tmp_path) -> None:
    with FakeServer(tmp_path, max_body_bytes=2048) as srv, \
            httpx.Client(base_url=srv.url, timeout=20) as c:
        ok = c.post("/v1/completions", json={"prompt": "x" * 1500, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        for path in ("/v1/completions", "/v1/agents"):
            declared = c.post(path, json={"type": "t", "prompt": "x" * 3000})
            assert declared.status_code == 413, (path, declared.text)
            assert "2048" in declared.json()["detail"]
        streamed = c.post("/v1/completions", content=_chunks(10),
                          headers={"content-type": "application/json"})
        assert streamed.status_code == 413 and "2048" in streamed.json()["detail"]
        assert c.post("/v1/agents", json={"type": "t", "prompt": "small"}).status_code == 201


def test_chunked_bodies_over_the_limit_are_413_on_every_route(tmp_path) -> None:
    with FakeServer(tmp_path, max_body_bytes=2048) as srv, \
            httpx.Client(base_url=srv.url, timeout=20) as c:
        streamed = c.post("/v1/agents", content=_chunks(10),
                          headers={"content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text
