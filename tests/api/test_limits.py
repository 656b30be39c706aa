"""Per-tenant limits: the limiter on its own (pure, `now` passed in), the command line, a
server with keys and limits (a contract suite: on the fake engine and on vLLM), and the body
size limit (413) at a small `max_body_bytes`."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import httpx
import pytest

from justitia_cli import main
from server.runtime.limits import (
    PerTenant,
    Rate,
    RateLimiter,
    RateLimitExceeded,
    RequestTooLarge,
    TokenBucket,
    check_request_size,
    parse_per_tenant,
    parse_tokens,
)
from tests.support.clients import local_client
from tests.support.fake_engine import FakeServer
from tests.support.servers import ENGINES, either_server

# -- the limiter -------------------------------------------------------------------------------


def test_a_bucket_allows_its_burst_then_one_request_per_interval() -> None:
    bucket = TokenBucket(Rate(per_second=2.0, burst=3.0), now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.5)  # one token in 1/2 s
    assert bucket.take(100.25) == pytest.approx(0.25)  # refused calls take nothing
    assert bucket.take(100.5) == 0.0
    assert bucket.take(100.5) == pytest.approx(0.5)


def test_a_bucket_refills_to_its_burst_and_no_further() -> None:
    bucket = TokenBucket(Rate(per_second=1.0, burst=2.0), now=0.0)
    bucket.take(0.0), bucket.take(0.0)
    assert [bucket.take(1000.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(1.0)]


def test_a_clock_read_out_of_order_does_not_drain_the_bucket() -> None:
    bucket = TokenBucket(Rate(per_second=1.0, burst=1.0), now=10.0)
    assert bucket.take(10.0) == 0.0
    assert bucket.take(9.5) == pytest.approx(1.0)  # earlier than the last read: no refill
    assert bucket.take(11.0) == 0.0


def test_tenants_have_their_own_buckets_and_overrides() -> None:
    limiter = RateLimiter(PerTenant(Rate(1.0, 2.0), {"batch": Rate(10.0, 10.0), "ops": None}))
    for _ in range(2):
        limiter.check("alice", now=0.0)
    with pytest.raises(RateLimitExceeded) as refused:
        limiter.check("alice", now=0.0)
    assert refused.value.retry_after == 1
    assert "'alice'" in str(refused.value) and "1 requests/s (burst 2)" in str(refused.value)
    for _ in range(2):
        limiter.check("bob", now=0.0)  # alice's calls cost bob nothing
    for _ in range(10):
        limiter.check("batch", now=0.0)
    for _ in range(1000):
        limiter.check("ops", now=0.0)  # lifted for this tenant


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    limiter = RateLimiter(PerTenant(Rate(0.3, 1.0)))
    limiter.check("t", now=0.0)
    with pytest.raises(RateLimitExceeded) as refused:
        limiter.check("t", now=0.0)
    assert refused.value.retry_after == 4  # 1 / 0.3 = 3.33 s
    limiter.check("t", now=4.0)  # and after that long it is allowed


def test_no_limits_by_default() -> None:
    limiter = RateLimiter(PerTenant())
    for _ in range(10_000):
        limiter.check("t", now=0.0)
    check_request_size(PerTenant(), "t", prompt_tokens=10**6, max_tokens=10**6)


def test_request_size_cap_names_the_numbers() -> None:
    caps = PerTenant(100, {"big": 1000, "free": None})
    check_request_size(caps, "t", prompt_tokens=60, max_tokens=40)
    with pytest.raises(RequestTooLarge) as refused:
        check_request_size(caps, "t", prompt_tokens=60, max_tokens=41)
    message = str(refused.value)
    assert "101 tokens" in message and "at most 100" in message
    assert "--max-request-tokens" in message
    check_request_size(caps, "big", prompt_tokens=60, max_tokens=900)
    check_request_size(caps, "free", prompt_tokens=10**6, max_tokens=10**6)


def test_option_values_parse_with_defaults_and_overrides() -> None:
    assert Rate.parse("5") == Rate(5.0, 5.0)
    assert Rate.parse("0.5") == Rate(0.5, 1.0)  # a burst is at least one request
    assert Rate.parse("2:10") == Rate(2.0, 10.0)
    limits = parse_per_tenant(["2", "bob=off", "carol=5:10"], Rate.parse)
    assert limits.default == Rate(2.0, 2.0)
    assert limits.overrides == {"bob": None, "carol": Rate(5.0, 10.0)}
    assert parse_per_tenant(["alice=300"], parse_tokens).for_tenant("alice") == 300
    assert parse_per_tenant(["alice=300"], parse_tokens).for_tenant("bob") is None
    for bad in ("0", "-1", "x", "2:0.5", "inf", "nan", "2:"):
        with pytest.raises(ValueError):
            Rate.parse(bad)
    for bad in (["off"], ["=5"]):
        with pytest.raises(ValueError):
            parse_per_tenant(bad, Rate.parse)
    for bad in ("0", "1.5", "many"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


# -- the command line ----------------------------------------------------------------------------


def test_serve_refuses_bad_limit_options(capsys: pytest.CaptureFixture) -> None:
    cases = [
        (["--rate-limit", "fast"], "--rate-limit"),
        (["--max-request-tokens", "0"], "--max-request-tokens"),
        # An override for a tenant no key defines is a typo that would leave it unlimited.
        (["--api-key", "alice=k1", "--rate-limit", "alcie=2"], "'alcie'"),
        (["--max-request-tokens", "bob=100"], "'bob'"),
    ]
    for args, needle in cases:
        assert main(["serve", *args]) == 2, args
        assert needle in capsys.readouterr().err, args


def test_serve_help_explains_the_limit_options(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--rate-limit [TENANT=]RPS[:BURST]" in out and "Retry-After" in out
    assert "--max-request-tokens [TENANT=]N" in out and "TENANT=off" in out


# -- a real server ---------------------------------------------------------------------------------

KEYS = {name: f"key-{name}-limits" for name in ("alice", "bob", "carol", "dave", "erin")}
RATE = 0.5  # requests per second, burst 3: refills slowly enough to observe


@pytest.fixture(scope="module", params=ENGINES)
def limited_server(request: pytest.FixtureRequest):
    with either_server(
            request, kv_tokens=2048, max_model_len=512, keys=KEYS,
            args=("--rate-limit", f"{RATE}:3", "--rate-limit", "carol=off", "--rate-limit", "dave=off",
                  "--max-request-tokens", "64", "--max-request-tokens", "dave=300"),
            config={"rate_limit": Rate(RATE, 3.0), "tenant_rate_limits": {"carol": None, "dave": None},
                    "max_request_tokens": 64, "tenant_max_request_tokens": {"dave": 300}}) as srv:
        yield srv


def as_tenant(srv, tenant: str) -> httpx.Client:
    return local_client(base_url=srv.url, headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                        timeout=60)


def _register(c: httpx.Client) -> httpx.Response:
    return c.post("/v1/agents", json={"type": "limited", "prompt": "p"})


def test_a_burst_over_the_rate_is_refused_for_that_tenant_only(limited_server) -> None:
    with as_tenant(limited_server, "alice") as alice, as_tenant(limited_server, "bob") as bob, \
            as_tenant(limited_server, "carol") as carol:
        assert [_register(alice).status_code for _ in range(3)] == [201, 201, 201]
        refused = _register(alice)
        assert refused.status_code == 429, refused.text
        retry_after = int(refused.headers["Retry-After"])
        assert 1 <= retry_after <= 1 / RATE
        detail = refused.json()["detail"]
        assert "'alice'" in detail and "rate limit" in detail and "0.5 requests/s" in detail
        # Inference counts against the same budget; reading does not count at all.
        late = alice.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert late.status_code == 429 and "Retry-After" in late.headers
        assert all(alice.get("/v1/agents").status_code == 200 for _ in range(10))
        # bob has a bucket of his own, and carol has no limit.
        assert [_register(bob).status_code for _ in range(3)] == [201, 201, 201]
        assert all(_register(carol).status_code == 201 for _ in range(12))
        time.sleep(retry_after)
        assert _register(alice).status_code == 201


def test_the_sdk_waits_out_the_rate_limit(limited_server) -> None:
    from justitia_sdk import AsyncClient

    async def register_five() -> list[str]:
        async with AsyncClient(limited_server.url, api_key=KEYS["erin"]) as client:
            return [(await client.register_agent("sdk_limited", "p")).id for _ in range(5)]

    start = time.monotonic()
    ids = anyio.run(register_five)
    elapsed = time.monotonic() - start
    assert len(set(ids)) == 5
    # Three at once, then one every 1 / RATE s: the SDK honoured Retry-After twice.
    assert elapsed >= 2 * (1 / RATE) - 0.5, elapsed


def test_requests_over_the_tenants_size_cap_are_refused(limited_server) -> None:
    with as_tenant(limited_server, "carol") as carol, as_tenant(limited_server, "dave") as dave:
        for path, body in (("/v1/completions", {"prompt": "hello there"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hello there"}]})):
            over = carol.post(path, json={**body, "max_tokens": 100})
            assert over.status_code == 400, over.text
            detail = over.json()["detail"]
            assert "at most 64 tokens" in detail and "--max-request-tokens" in detail
            assert "max_tokens 100" in detail
            assert carol.post(path, json={**body, "max_tokens": 20}).status_code == 200
            # dave's own cap is 300
            assert dave.post(path, json={**body, "max_tokens": 100}).status_code == 200
            assert dave.post(path, json={**body, "max_tokens": 299}).status_code == 400
        # Without max_tokens a chat answer fills the tenant's cap, not the model's context.
        r = carol.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello there"}], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 64, r.text
        # The model's context still bounds everyone, with its own message.
        r = dave.post("/v1/completions", json={"prompt": "x", "max_tokens": 600})
        assert r.status_code == 400 and "maximum context length" in r.json()["detail"]


# -- the body size limit -----------------------------------------------------------------------


def _chunks(parts: int) -> Iterator[bytes]:
    """A JSON body sent chunked (no Content-Length): the limit can only count as it reads."""
    yield b'{"type": "t", "prompt": "x", "messages": [], "metadata": {"k": "'
    for _ in range(parts):
        yield b"y" * 500
    yield b'"}}'


def test_bodies_over_the_limit_are_413(tmp_path) -> None:
    with FakeServer(tmp_path, max_body_bytes=2048) as srv, \
            local_client(base_url=srv.url, timeout=20) as c:
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
            local_client(base_url=srv.url, timeout=20) as c:
        streamed = c.post("/v1/agents", content=_chunks(10),
                          headers={"content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text
