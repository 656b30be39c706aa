"""Servers with API keys on the fake engine, and clients as one of their tenants: what the
tests of hostile tenants and of request limits share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support.clients import local_client
from tests.support.fake_engine import FAST, FakeEngine, FakeServer

#: tenant -> API key
KEYS = {"alice": "key-alice", "bob": "key-bob"}


@contextmanager
def keyed_server(data_dir: Path, kv_tokens: int, keys: dict[str, str] = KEYS,
                 **config: Any) -> Iterator[FakeServer]:
    """A fake-engine server (`kv_tokens` of KV cache, a context of 1,024) where each of
    `keys`' tenants holds its key; `config`: more ServerConfig fields."""
    engine = FakeEngine(kv_capacity_tokens=kv_tokens, max_model_len=1024, time_scale=FAST)
    with FakeServer(data_dir, engine=engine, api_keys={key: tenant for tenant, key in keys.items()},
                    **config) as srv:
        yield srv


def as_tenant(srv: FakeServer, tenant: str, timeout: float = 30, keys: dict[str, str] = KEYS) -> httpx.Client:
    """A client of `srv` that calls as `tenant`."""
    return local_client(base_url=srv.url, timeout=timeout,
                        headers={"Authorization": f"Bearer {keys[tenant]}"})
