"""Shared fixtures and the tiers (docs/architecture.md, Testing).

- tests/core: pure parts (scheduler core, simulator, predictors, CLI parsing), no server;
- tests/api: the real app over HTTP on the fake engine (tests/support/fake_engine.py); the
  contract suites there run against the fake and the real engine alike (`ENGINES`);
- tests/engine: the real vLLM CPU engine only.

A test needs the real engine, and carries the `engine` marker, when it lives in
tests/engine, when it uses `vllm_server` (directly or through another fixture), or when it
runs on the "vllm" parameter of a contract fixture (`server`, or a module's own fixture
parametrized with `ENGINES`).

A test carries the `slow` marker when it costs seconds of CPU for a reason of its own: it runs
a Python process of its own (a whole server, the command line, an example script, the grammar
compiler's worker), trains scikit-learn predictors, loads transformers, or runs a long
simulation. The modules in `SLOW_MODULES` are slow as a whole. `make test-fast` runs what is
neither `engine` nor `slow`; `make test` runs every test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engine import FAST, FakeEngine, FakeServer
from tests.support.servers import ENGINE_KV_TOKENS, ENGINE_MAX_MODEL_LEN, ENGINES

TESTS_DIR = Path(__file__).parent
ENGINE_DIR = TESTS_DIR / "engine"
# Modules whose every test is `slow`: whole server processes, predictor training, long
# simulations. Listed here (not marked inside) so that the fast tier does not even import them.
SLOW_MODULES = frozenset(TESTS_DIR / name for name in (
    "api/test_shutdown.py",
    "core/test_predictors_model.py",
    "core/test_predictors_cli.py",
    "core/test_sim_bound.py",
    "core/test_sim_baselines.py",
))
# Per-test timeouts (pytest-timeout): a hung test fails instead of stalling the run. An
# engine test's budget includes starting the engine (20-60 s, more on a busy machine).
ENGINE_TEST_TIMEOUT_S = 600


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(ENGINE_DIR) or "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)
        if item.path in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("engine"):
            # One worker runs every engine test (pytest-xdist's loadgroup): one engine at a time.
            item.add_marker(pytest.mark.xdist_group("engine"))
            if not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S))


def _engine_tests_deselected(config: pytest.Config) -> bool:
    return "not engine" in (config.option.markexpr or "")


# The mark expressions that deselect every engine test, and those that deselect every slow
# one: under them, the deselected modules are not even imported.
_NO_ENGINE = ("not engine", "not engine and not slow", "not slow and not engine")
_NO_SLOW = ("not slow", "not engine and not slow", "not slow and not engine")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With `-m "not engine"` (`make test`'s first tier) or `-m "not engine and not slow"`
    (`make test-fast`), tests/engine is not even imported: every test there is deselected,
    and importing its modules (the OpenAI client, aiohttp, ...) cost each worker seconds.
    Likewise `SLOW_MODULES` without the slow tests (scikit-learn, for one)."""
    expr = " ".join((config.option.markexpr or "").split())
    if expr in _NO_ENGINE and collection_path == ENGINE_DIR:
        return True
    if expr in _NO_SLOW and collection_path in SLOW_MODULES:
        return True
    return None


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
        raise RuntimeError(f"{request.node.nodeid} starts the real engine: move it to "
                           "tests/engine, mark it @pytest.mark.engine, or use the fake engine")

    for cls in (EmbeddedServer, VLLMOpenAIServer, LocalVLLMEngine):
        monkeypatch.setattr(cls, "start", refuse)


@pytest.fixture(scope="session")
def justitia_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    """JUSTITIA_HOME of the engine servers: the embedded tiny model is written there once."""
    return os.environ.get("JUSTITIA_TEST_HOME") or str(tmp_path_factory.mktemp("justitia-home"))


class _External:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")


@pytest.fixture(scope="session")
def vllm_server(justitia_home: str) -> Iterator:
    """`justitia serve` on the real engine, one per test session, shared by the engine tests.

    Developers may point the suite at a server they already run (same KV settings):
    JUSTITIA_TEST_URL=http://127.0.0.1:8122 pytest ..."""
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


@pytest.fixture()
def vllm_client(vllm_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_server.url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    """The app as `justitia serve` builds it, no keys or limits, on a FakeEngine with the
    engine server's KV capacity and context, its clock `FAST` (a server per test module)."""
    engine = FakeEngine(kv_capacity_tokens=ENGINE_KV_TOKENS, max_model_len=ENGINE_MAX_MODEL_LEN,
                        time_scale=FAST)
    with FakeServer(tmp_path_factory.mktemp("fake-server"), engine=engine) as srv:
        yield srv


@pytest.fixture()
def fake_client(fake_server: FakeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_server.url, timeout=30.0) as c:
        yield c


@pytest.fixture(scope="module", params=ENGINES)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The contract suites' server: the fake engine's (one per module) or the shared real
    engine's, with the same KV capacity and context."""
    if request.param == "vllm":
        yield request.getfixturevalue("vllm_server")
        return
    engine = FakeEngine(kv_capacity_tokens=ENGINE_KV_TOKENS, max_model_len=ENGINE_MAX_MODEL_LEN,
                        time_scale=FAST)
    with FakeServer(tmp_path_factory.mktemp("server"), engine=engine) as srv:
        yield srv


@pytest.fixture()
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c
