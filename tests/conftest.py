"""Shared fixtures. The real vLLM CPU engine with the embedded tiny model is started once
per test session, in its own process, exactly as `justitia serve` runs it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

# Small enough that a few dozen concurrent requests contend for KV memory.
ENGINE_KV_TOKENS = 4096
ENGINE_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def justitia_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    home = os.environ.get("JUSTITIA_TEST_HOME") or str(tmp_path_factory.mktemp("justitia-home"))
    return home


class _External:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")


@pytest.fixture(scope="session")
def server(justitia_home: str):
    # Developers may point the suite at a server they already run (same KV settings):
    # JUSTITIA_TEST_URL=http://127.0.0.1:8122 pytest ...
    if os.environ.get("JUSTITIA_TEST_URL"):
        yield _External(os.environ["JUSTITIA_TEST_URL"])
        return
    from server.launcher import EmbeddedServer

    srv = EmbeddedServer(
        ["--kv-tokens", str(ENGINE_KV_TOKENS), "--max-model-len", str(ENGINE_MAX_MODEL_LEN)],
        env={"JUSTITIA_HOME": justitia_home},
    )
    srv.start()
    yield srv
    srv.stop()


def serve_with_keys(args: list[str], keys: dict[str, str], home: str) -> Iterator:
    """A fixture body: a server of its own with these `serve` options and API keys
    (tenant -> key), for the tests of tenancy, limits and fuzzing."""
    from server.launcher import EmbeddedServer

    for tenant, key in keys.items():
        args = [*args, "--api-key", f"{tenant}={key}"]
    with EmbeddedServer(args, env={"JUSTITIA_HOME": home}) as srv:
        yield srv


@pytest.fixture()
def client(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c
