"""Tenancy: API keys map to tenants; every agent belongs to the tenant that made it.

With no keys configured the server is single-tenant (tenant "default") and `justitia serve`
refuses to bind anything but loopback.
"""

from __future__ import annotations

import hmac
import time

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from server.runtime.limits import RateLimiter, RateLimitExceeded

DEFAULT_TENANT = "default"
ADMIN_TENANT = "admin"

# Declares the bearer scheme in the OpenAPI document (clients and fuzzers see which calls
# need a key); auto_error=False keeps the checks and their messages here.
bearer_scheme = HTTPBearer(auto_error=False, description="An API key given to `--api-key TENANT=KEY`.")


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


def _tenant_of_key(keys: dict[str, str], token: bytes) -> str | None:
    found = None
    for key, tenant in keys.items():
        # Constant-time comparison: response timing must not reveal key prefixes.
        if hmac.compare_digest(key.encode(), token):
            found = tenant
    return found


async def tenant_of(request: Request,
                    credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme)) -> str:
    """The caller's tenant (a FastAPI dependency)."""
    keys: dict[str, str] = request.app.state.config.api_keys
    if not keys:
        return DEFAULT_TENANT
    if credentials is None or not credentials.credentials:
        raise _unauthorized("missing API key: send 'Authorization: Bearer KEY'")
    tenant = _tenant_of_key(keys, credentials.credentials.encode())
    if tenant is None:
        raise _unauthorized("invalid API key")
    return tenant


async def rate_limited_tenant(request: Request, tenant: str = Depends(tenant_of)) -> str:
    """The caller's tenant, after counting this call against its rate limit (a FastAPI
    dependency of the inference and registration calls)."""
    if request.scope.get(RATE_COUNTED):  # counted by RateLimitFirst, before the body
        return tenant
    limiter: RateLimiter = request.app.state.rate_limiter
    try:
        limiter.check(tenant, time.monotonic())
    except RateLimitExceeded as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
    return tenant


def require_admin(request: Request, tenant: str) -> None:
    if request.app.state.config.api_keys and tenant != ADMIN_TENANT:
        raise HTTPException(403, f"admin calls need the key of the tenant named {ADMIN_TENANT!r}")


RATE_COUNTED = "justitia.rate_counted"
#: The calls whose rate is limited, and which carry a body.
RATE_LIMITED_POSTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/agents"})


class RateLimitFirst:
    """Count a rate-limited call against its tenant's rate before its body is read: a
    caller over its rate (sending 4 MB bodies, say) is answered 429 at the cost of its
    headers. Calls without a valid key pass through, to be answered 401 by the route."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or scope.get("path") not in RATE_LIMITED_POSTS):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        tenant = _tenant_from_headers(state.config.api_keys, scope.get("headers") or [])
        if tenant is not None:
            limiter: RateLimiter = state.rate_limiter
            try:
                limiter.check(tenant, time.monotonic())
            except RateLimitExceeded as exc:
                from server.api import errors

                # Connection: close, as the body is left unread (see app.UNREAD_BODY).
                response = errors.error_response(scope["path"], 429, str(exc),
                                                 headers={"Retry-After": str(exc.retry_after),
                                                          "Connection": "close"})
                await response(scope, receive, send)
                return
            scope[RATE_COUNTED] = True
        await self.app(scope, receive, send)


def _tenant_from_headers(keys: dict[str, str], headers: list[tuple[bytes, bytes]]) -> str | None:
    if not keys:
        return DEFAULT_TENANT
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return _tenant_of_key(keys, token.strip())
            return None
    return None
