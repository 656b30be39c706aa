"""Per-tenant limits: a request rate (a token bucket with a burst) and a request size
(prompt tokens + max_tokens).

Pure logic with no clock of its own: every call takes `now` (seconds, any monotonic origin),
so the limiter is tested without sleeping. The app reads the clock and turns a refusal into
an HTTP answer (429 with Retry-After, or 400).

Buckets are kept per tenant. Tenants come from the configured API keys (one tenant,
"default", without keys), so the number of buckets is bounded by configuration, never by
what callers send.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from server.engine.base import InvalidRequestError

T = TypeVar("T")

OFF = "off"  # an override that lifts the default limit for one tenant


@dataclass(frozen=True)
class Rate:
    """`per_second` requests per second on average, up to `burst` at once after a pause."""

    per_second: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_second > 0 and math.isfinite(self.per_second)):
            raise ValueError(f"a rate must be a positive number of requests per second, "
                             f"got {self.per_second}")
        if not (self.burst >= 1 and math.isfinite(self.burst)):
            raise ValueError(f"a burst must be at least 1 request, got {self.burst}")

    @classmethod
    def parse(cls, text: str) -> Rate:
        """`RPS` or `RPS:BURST`; the burst defaults to one second's worth (at least 1)."""
        rps_text, sep, burst_text = text.partition(":")
        try:
            per_second = float(rps_text)
            burst = float(burst_text) if sep else max(1.0, per_second)
        except ValueError:
            raise ValueError(f"expected RPS or RPS:BURST (numbers), got {text!r}") from None
        return cls(per_second, burst)

    def __str__(self) -> str:
        return f"{self.per_second:g} requests/s (burst {self.burst:g})"


@dataclass(frozen=True)
class PerTenant(Generic[T]):
    """A limit for every tenant, and overrides by tenant name (None: no limit)."""

    default: T | None = None
    overrides: dict[str, T | None] = field(default_factory=dict)

    def for_tenant(self, tenant: str) -> T | None:
        return self.overrides[tenant] if tenant in self.overrides else self.default

    @property
    def active(self) -> bool:
        return self.default is not None or any(v is not None for v in self.overrides.values())


def parse_per_tenant(items: Iterable[str], parse_value: Callable[[str], T]) -> PerTenant[T]:
    """Repeated `VALUE` / `TENANT=VALUE` options: a bare VALUE is the default (the last one
    wins), `TENANT=off` lifts the default for that tenant. Raises ValueError naming the
    bad item."""
    default: T | None = None
    overrides: dict[str, T | None] = {}
    for item in items:
        tenant, sep, value = item.partition("=")
        if not sep:
            if item == OFF:
                raise ValueError("'off' lifts the limit of one tenant: write TENANT=off")
            default = parse_value(item)
        elif not tenant:
            raise ValueError(f"expected VALUE or TENANT=VALUE, got {item!r}")
        else:
            overrides[tenant] = None if value == OFF else parse_value(value)
    return PerTenant(default, overrides)


def _positive(text: str, whole: str, limit: str) -> int:
    """`text` as a whole number of at least 1; ValueError naming `whole` and `limit` else."""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"expected {whole}, got {text!r}") from None
    if n < 1:
        raise ValueError(f"{limit} must be at least 1, got {n}")
    return n


def parse_tokens(text: str) -> int:
    return _positive(text, "a whole number of tokens", "a token limit")


class TokenBucket:
    """Holds up to `rate.burst` tokens and gains `rate.per_second` per second; a request
    takes one."""

    def __init__(self, rate: Rate, now: float) -> None:
        self.rate = rate
        self.tokens = rate.burst
        self.updated = now

    def take(self, now: float) -> float:
        """Take a token: 0.0 if there was one, else the seconds until one will be there
        (nothing is taken then: a refused request costs the caller nothing)."""
        # A clock read out of order (two coroutines) must not drain the bucket: max().
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.rate.burst, self.tokens + elapsed * self.rate.per_second)
        self.updated = max(self.updated, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate.per_second


class RateLimitExceeded(Exception):
    def __init__(self, tenant: str, rate: Rate, retry_after_s: float) -> None:
        # Retry-After is whole seconds (RFC 9110); rounding up keeps a client that honours
        # it from being refused again.
        self.retry_after = max(1, math.ceil(retry_after_s))
        super().__init__(f"tenant {tenant!r} is over its rate limit of {rate}: "
                         f"retry after {self.retry_after} s")


class RateLimiter:
    def __init__(self, limits: PerTenant[Rate]) -> None:
        self.limits = limits
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, tenant: str, now: float) -> None:
        """Count one request of `tenant`; raise RateLimitExceeded when it is over its rate."""
        rate = self.limits.for_tenant(tenant)
        if rate is None:
            return
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = TokenBucket(rate, now)
        wait = bucket.take(now)
        if wait > 0:
            raise RateLimitExceeded(tenant, rate, wait)


def parse_count(text: str) -> int:
    return _positive(text, "a whole number", "a quota")


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """A size in bytes: a whole number with an optional K, M or G (binary) suffix."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"expected a size such as 65536, 512K or 64M, got {text!r}")
    n = int(m.group(1)) * _BYTE_UNITS[m.group(2).upper()]
    if n < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return n


class QuotaExceeded(Exception):
    """A tenant is at its quota of live agents or queued requests (answered 429)."""

    retry_after = 2  # seconds: quotas free up as the tenant's own work ends

    def __init__(self, tenant: str, what: str, quota: int, option: str, message: str | None = None) -> None:
        super().__init__(message or f"tenant {tenant!r} has {quota} {what}, its quota ({option}): "
                         "retry once some of them have ended")


#: One agent's metadata, as compact JSON (--max-metadata-bytes).
DEFAULT_MAX_METADATA_BYTES = 64 * 1024


class TooLarge(Exception):
    """What a request asks the server to hold is over a limit it can never fit (413, with
    the limit named)."""


@dataclass(frozen=True)
class Quotas:
    """Per-tenant quotas on what a tenant holds in the server at once."""

    live_agents: PerTenant[int] = field(default_factory=PerTenant)
    queued_requests: PerTenant[int] = field(default_factory=PerTenant)
    # bytes of prompt and metadata the tenant's live agents hold in the server's memory
    agent_bytes: PerTenant[int] = field(default_factory=PerTenant)
    # bytes of one agent's metadata (compact JSON)
    metadata_bytes: PerTenant[int] = field(default_factory=lambda: PerTenant(DEFAULT_MAX_METADATA_BYTES))

    def check_metadata(self, tenant: str, size: int, *, at_least: bool = False) -> None:
        """Refuse metadata of `size` bytes of JSON (`at_least`: a lower bound of its size)."""
        limit = self.metadata_bytes.for_tenant(tenant)
        if limit is not None and size > limit:
            holds = f"at least {size}" if at_least else f"{size}"
            raise TooLarge(f"the metadata holds {holds} bytes of JSON; tenant {tenant!r} may keep "
                           f"at most {limit} bytes of metadata with an agent (--max-metadata-bytes)")

    def check_agents(self, tenant: str, live: int) -> None:
        quota = self.live_agents.for_tenant(tenant)
        if quota is not None and live >= quota:
            raise QuotaExceeded(tenant, "live agents", quota, "--max-agents")

    def check_queued(self, tenant: str, queued: int) -> None:
        quota = self.queued_requests.for_tenant(tenant)
        if quota is not None and queued >= quota:
            raise QuotaExceeded(tenant, "queued requests", quota, "--max-queued")

    def check_bytes(self, tenant: str, held: int, adding: int) -> None:
        quota = self.agent_bytes.for_tenant(tenant)
        if quota is not None and adding > quota:  # it would never fit: retrying is no use
            raise TooLarge(f"this agent's prompt and metadata hold {adding} bytes, over tenant "
                           f"{tenant!r}'s whole quota of {quota} bytes (--max-agent-bytes)")
        if quota is not None and held + adding > quota:
            raise QuotaExceeded(tenant, "bytes", quota, "--max-agent-bytes", message=(
                f"tenant {tenant!r} has {held} bytes of prompts and metadata in live agents and this "
                f"agent would add {adding}, over its quota of {quota} (--max-agent-bytes): retry "
                "once some of them have ended"))


class RequestTooLarge(InvalidRequestError):
    """Over the tenant's --max-request-tokens (answered 400, like a context overflow)."""


def check_request_size(limits: PerTenant[int], tenant: str, prompt_tokens: int,
                       max_tokens: int) -> None:
    """Raise RequestTooLarge when prompt + max_tokens is over the tenant's cap."""
    cap = limits.for_tenant(tenant)
    if cap is None or prompt_tokens + max_tokens <= cap:
        return
    raise RequestTooLarge(
        f"the request needs {prompt_tokens + max_tokens} tokens (prompt {prompt_tokens} + "
        f"max_tokens {max_tokens}); tenant {tenant!r} may use at most {cap} tokens per "
        "request (the server's --max-request-tokens): shorten the prompt or lower max_tokens"
    )
