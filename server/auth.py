"""Tenancy: API keys map to tenants; every agent belongs to the tenant that made it.

With no keys configured the server is single-tenant (tenant "default") and `justitia serve`
refuses to bind anything but loopback.
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

DEFAULT_TENANT = "default"


async def tenant_of(request: Request) -> str:
    """The caller's tenant (a FastAPI dependency)."""
    keys: dict[str, str] = request.app.state.config.api_keys
    if not keys:
        return DEFAULT_TENANT
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(401, "missing API key: send 'Authorization: Bearer KEY'",
                            headers={"WWW-Authenticate": "Bearer"})
    for key, tenant in keys.items():
        # Constant-time comparison: response timing must not reveal key prefixes.
        if hmac.compare_digest(key.encode(), token.encode()):
            return tenant
    raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
