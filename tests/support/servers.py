"""Servers for the tests: the real app on the fake engine or on vLLM, built from one
description, so that a contract suite runs the same calls against both.

A fixture parametrized with `ENGINES` gets `request.param` "fake" or "vllm"; the "vllm"
parameter carries the `engine` marker, so `make test-fast` (-m "not engine") leaves it out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.support.fake_engine import FAST, FakeEngine, FakeServer

# The shared engine server's KV capacity and context: small enough that a few dozen
# concurrent requests contend for KV memory.
ENGINE_KV_TOKENS = 4096
ENGINE_MAX_MODEL_LEN = 2048

# The two engines a contract suite runs against (the fixture's `params`).
ENGINES = ["fake", pytest.param("vllm", marks=pytest.mark.engine)]


@contextmanager
def embedded_server(args: list[str], keys: dict[str, str] | None, home: str) -> Iterator[Any]:
    """`justitia serve` with these options and API keys (tenant -> key) on the real engine,
    in a process of its own."""
    from server.launcher import EmbeddedServer

    for tenant, key in (keys or {}).items():
        args = [*args, "--api-key", f"{tenant}={key}"]
    with EmbeddedServer(args, env={"JUSTITIA_HOME": home}) as srv:
        yield srv


@contextmanager
def either_server(request: pytest.FixtureRequest, *, kv_tokens: int, max_model_len: int,
                  keys: dict[str, str] | None = None, args: tuple[str, ...] = (),
                  config: dict[str, Any] | None = None) -> Iterator[Any]:
    """One server described once, for a fixture parametrized with `ENGINES`: on the fake
    engine ("fake") the app with `config` (`ServerConfig` fields), on vLLM ("vllm")
    `justitia serve` with `args` (the same options as command-line flags). Both have
    `kv_tokens`, `max_model_len` and the API `keys` (tenant -> key)."""
    kind = request.param
    if kind == "fake":
        data_dir = request.getfixturevalue("tmp_path_factory").mktemp("server")
        engine = FakeEngine(kv_capacity_tokens=kv_tokens, max_model_len=max_model_len, time_scale=FAST)
        api_keys = {key: tenant for tenant, key in (keys or {}).items()}
        with FakeServer(data_dir, engine=engine, **({"api_keys": api_keys} if keys else {}),
                        **(config or {})) as srv:
            yield srv
        return
    assert kind == "vllm", kind
    with embedded_server(["--kv-tokens", str(kv_tokens), "--max-model-len", str(max_model_len),
                          *args], keys, request.getfixturevalue("justitia_home")) as srv:
        yield srv
