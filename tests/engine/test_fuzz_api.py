"""Fuzzing the HTTP API (schemathesis, from the server's own OpenAPI schema) against a real
server with keys and limits. What fuzzing found is kept as regression tests in
tests/api/test_input_regressions.py.

Bounded for the suite: EXAMPLES positive and EXAMPLES negative inputs per operation, each
answered within TIMEOUT_S. The larger campaign is benchmarks/fuzz_api.py.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.fuzz_driver import EXCLUDED, fuzz_operation, load_schema, operations
from tests.support.servers import embedded_server

EXAMPLES = 40
TIMEOUT_S = 30.0
MAX_MODEL_LEN = 512
KEYS = {"admin": "key-admin-fuzz-0123", "alice": "key-alice-fuzz-4567"}
ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


def _all_labels() -> list[str]:
    """Every operation of the app, read from the app object (no server needed to collect)."""
    from server.api.app import create_app
    from server.api.config import ServerConfig

    paths = create_app(ServerConfig()).openapi()["paths"]
    return sorted(f"{method.upper()} {path}" for path, item in paths.items() for method in item)


LABELS = [label for label in _all_labels() if label not in EXCLUDED]
# Operations on one agent, fuzzed again with the id of a live agent (random ids only reach
# the 404 path). Its events stream is left out: it lasts as long as the agent, by design.
LIVE_AGENT_PATH = ("GET /v1/agents/{agent_id}", "POST /v1/agents/{agent_id}/finish",
                   "DELETE /v1/agents/{agent_id}")
LIVE_AGENT_HEADER = ("POST /v1/completions", "POST /v1/chat/completions")


@pytest.fixture(scope="module")
def fuzz_server(justitia_home: str):
    with embedded_server(
        ["--kv-tokens", "2048", "--max-model-len", str(MAX_MODEL_LEN),
         # Limits on, so that their code runs under fuzzing; high enough that the
         # fuzzer's own pace never reaches them.
         "--max-request-tokens", "400", "--rate-limit", "1000:1000"], KEYS, justitia_home) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(fuzz_server):
    return operations(load_schema(fuzz_server.url))


@pytest.fixture()
def admin(fuzz_server) -> httpx.Client:
    with httpx.Client(base_url=fuzz_server.url, headers=ADMIN, timeout=60) as c:
        yield c


def _assert_clean(tallies) -> None:
    for t in tallies:
        print(f"{t.label} [{t.mode}]: {t.inputs} inputs, statuses {dict(t.statuses)}, "
              f"slowest {t.slowest_s:.2f} s")
    assert sum(t.inputs for t in tallies) > 0
    problems = {f"{t.label} [{t.mode}] {kind}": t.examples[kind]
                for t in tallies for kind in t.failures}
    assert not problems, "\n\n".join(f"{k}:\n{v}" for k, v in problems.items())


def test_the_served_schema_has_every_operation(api) -> None:
    assert sorted(api) == LABELS


@pytest.mark.parametrize("label", LABELS)
def test_fuzzed_inputs_get_documented_answers(api, label: str) -> None:
    _assert_clean(fuzz_operation(api[label], headers=ADMIN, examples=EXAMPLES,
                                 timeout_s=TIMEOUT_S, seed=7))


@pytest.mark.parametrize("label", LIVE_AGENT_PATH + LIVE_AGENT_HEADER)
def test_fuzzed_inputs_on_a_live_agent(api, admin: httpx.Client, label: str) -> None:
    agent_id = admin.post("/v1/agents", json={"type": "fuzzed"}).json()["id"]
    fixed = ({"path_parameters": {"agent_id": agent_id}} if label in LIVE_AGENT_PATH
             else {"headers": {"X-Justitia-Agent": agent_id}})
    _assert_clean(fuzz_operation(api[label], headers=ADMIN, examples=EXAMPLES,
                                 timeout_s=TIMEOUT_S, seed=11, label=f"{label} [live agent]",
                                 fixed=fixed))
