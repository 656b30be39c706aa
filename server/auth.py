"""Tenancy: API keys map to tenants; every agent belongs to the tenant that made it.

With no keys configured the server is single-tenant (tenant "default") and `justitia serve`
refuses to bind anything but loopback.
"""

from __future__ import annotations

import hmac
import time

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from server.limits import RateLimiter, RateLimitExceeded

DEFAULT_TENANT = "default"
ADMIN_TENANT = "admin"

# Declares the bearer scheme in the OpenAPI document (clients and fuzzers see which calls
# need a key); auto_error=False keeps the checks and their messages here.
bearer_scheme = HTTPBearer(auto_error=False, description="An API key given to `--api-key TENANT=KEY`.")


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


async def tenant_of(request: Request,
                    credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme)) -> str:
    """The caller's tenant (a FastAPI dependency)."""
    keys: dict[str, str] = request.app.state.config.api_keys
    if not keys:
        return DEFAULT_TENANT
    if credentials is None or not credentials.credentials:
        raise _unauthorized("missing API key: send 'Authorization: Bearer KEY'")
    token = credentials.credentials.encode()
    for key, tenant in keys.items():
        # Constant-time comparison: response timing must not reveal key prefixes.
        if hmac.compare_digest(key.encode(), token):
            return tenant
    raise _unauthorized("invalid API key")


async def rate_limited_tenant(request: Request, tenant: str = Depends(tenant_of)) -> str:
    """The caller's tenant, after counting this call against its rate limit (a FastAPI
    dependency of the inference and registration calls)."""
    limiter: RateLimiter = request.app.state.rate_limiter
    try:
        limiter.check(tenant, time.monotonic())
    except RateLimitExceeded as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
    return tenant


def require_admin(request: Request, tenant: str) -> None:
    if request.app.state.config.api_keys and tenant != ADMIN_TENANT:
        raise HTTPException(403, f"admin calls need the key of the tenant named {ADMIN_TENANT!r}")
