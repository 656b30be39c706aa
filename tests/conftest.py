"""Shared fixtures. The real vLLM CPU engine with the embedded tiny model is started once
per test session, in its own process, exactly as `justitia serve` runs it.

Two tiers (docs/architecture.md, Testing): tests that need the real engine carry the
`engine` marker (set here for every test using the engine's fixtures, by hand for tests that
start a server themselves); `make test-fast` runs the others, on `tests.fake_engine`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from tests.fake_engine import FakeEngine, FakeServer

# Small enough that a few dozen concurrent requests contend for KV memory.
ENGINE_KV_TOKENS = 4096
ENGINE_MAX_MODEL_LEN = 2048

# Fixtures of this file that start (or hand out the home of) a real engine: a test using
# any of them, directly or through another fixture, is an engine test. Servers with options
# of their own (keys, limits, replicas) take `justitia_home`, so they are covered too. A
# module that overrides `server` with a fake one (test_fast_sdk.py) is not.
ENGINE_FIXTURES = frozenset({"server", "justitia_home"})
# Per-test timeouts (pytest-timeout): a hung test fails instead of stalling the run. An
# engine test's budget includes starting the engine (20-60 s, more on a busy machine).
ENGINE_TEST_TIMEOUT_S = 600


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _uses_engine_fixtures(item):
            item.add_marker(pytest.mark.engine)
        if item.get_closest_marker("engine") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S))


def _uses_engine_fixtures(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a Python test function (none in this suite)
        return False
    for name in ENGINE_FIXTURES.intersection(info.names_closure):
        defs = info.name2fixturedefs.get(name, ())
        # the definition that applies to this test: the closest one, last in the tuple
        if defs and getattr(defs[-1].func, "__module__", None) == __name__:
            return True
    return False


def _engine_tests_deselected(config: pytest.Config) -> bool:
    return "not engine" in (config.option.markexpr or "")


@pytest.fixture(autouse=True)
def _no_engine_in_the_fast_tier(request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """In the fast tier, a test that starts a real server or engine without the `engine`
    marker fails at once with the fix, instead of quietly spending a minute on vLLM."""
    if request.node.get_closest_marker("engine") or not _engine_tests_deselected(request.config):
        return
    from server.engine.vllm_local import LocalVLLMEngine
    from server.launcher import EmbeddedServer, VLLMOpenAIServer

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts the real engine: mark it "
                           "@pytest.mark.engine (or use tests.fake_engine.FakeServer)")

    for cls in (EmbeddedServer, VLLMOpenAIServer, LocalVLLMEngine):
        monkeypatch.setattr(cls, "start", refuse)


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


# -- the fast tier: the real app on the fake engine ------------------------------------------


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    """The app as `justitia serve` builds it, no keys or limits, on a FakeEngine with the
    engine tier's KV capacity and context (a server per test module)."""
    engine = FakeEngine(kv_capacity_tokens=ENGINE_KV_TOKENS, max_model_len=ENGINE_MAX_MODEL_LEN)
    with FakeServer(tmp_path_factory.mktemp("fake-server"), engine=engine) as srv:
        yield srv


@pytest.fixture()
def fake_client(fake_server: FakeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_server.url, timeout=30.0) as c:
        yield c
