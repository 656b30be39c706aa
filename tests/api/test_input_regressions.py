"""What fuzzing the HTTP API found (tests/engine/test_fuzz_api.py), as regression tests: a
contract suite, run on the fake engine and on vLLM with the fuzzed server's keys and limits.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from server.runtime.limits import Rate
from tests.support.clients import local_client
from tests.support.servers import ENGINES, either_server

TIMEOUT_S = 30.0
MAX_MODEL_LEN = 512
KEYS = {"admin": "key-admin-fuzz-0123", "alice": "key-alice-fuzz-4567"}
ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


@pytest.fixture(scope="module", params=ENGINES)
def fuzz_server(request: pytest.FixtureRequest) -> Iterator:
    # Limits on, as under fuzzing: their code runs on every request.
    with either_server(request, kv_tokens=2048, max_model_len=MAX_MODEL_LEN, keys=KEYS,
                       args=("--max-request-tokens", "400", "--rate-limit", "1000:1000"),
                       config={"max_request_tokens": 400, "rate_limit": Rate(1000.0, 1000.0)}) as srv:
        yield srv


@pytest.fixture()
def admin(fuzz_server) -> Iterator[httpx.Client]:
    with local_client(base_url=fuzz_server.url, headers=ADMIN, timeout=TIMEOUT_S) as c:
        yield c


def test_the_schema_documents_the_errors_and_the_key(admin: httpx.Client) -> None:
    schema = admin.get("/openapi.json").json()
    completions = schema["paths"]["/v1/completions"]["post"]
    assert {"400", "401", "429"} <= set(completions["responses"])
    assert "422" not in completions["responses"]  # bad input is answered 400
    assert completions["security"] == [{"HTTPBearer": []}]
    assert "Retry-After" in completions["responses"]["429"]["headers"]


# -- regressions: what fuzzing found (docs/reliability.md), each a 400 with a message

def _assert_400(r: httpx.Response, *needles: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    for needle in needles:
        assert needle in r.json()["detail"], r.json()["detail"]


def _raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """Send `text` as the JSON body as is (httpx would escape what this test needs raw)."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


def test_lone_surrogates_are_refused(admin: httpx.Client) -> None:
    _assert_400(_raw(admin, "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
                "prompt", "Unicode")
    _assert_400(_raw(admin, "/v1/chat/completions",
                     '{"messages": [{"role": "user", "content": "\\udfff"}]}'),
                "messages[0].content", "Unicode")
    # Such metadata, if stored, would fail every GET /v1/agents of its tenant.
    _assert_400(_raw(admin, "/v1/agents", '{"type": "t", "metadata": {"k": ["\\ud800"]}}'),
                "metadata.k[0]", "Unicode")
    _assert_400(_raw(admin, "/v1/agents", '{"type": "t", "metadata": {"\\ud800": 1}}'),
                "metadata", "Unicode")
    assert admin.get("/v1/agents").status_code == 200
    # A well-formed surrogate pair (an emoji) is ordinary text.
    assert _raw(admin, "/v1/completions",
                '{"prompt": "\\ud83d\\ude00", "max_tokens": 2}').status_code == 200


def test_nan_and_infinity_are_refused(admin: httpx.Client) -> None:
    _assert_400(_raw(admin, "/v1/agents", '{"type": "t", "metadata": {"x": NaN}}'),
                "metadata.x", "not a JSON number")
    _assert_400(_raw(admin, "/v1/completions", '{"prompt": "x", "temperature": Infinity}'),
                "temperature")


def test_token_ids_outside_the_vocabulary_are_refused(admin: httpx.Client) -> None:
    vocab_error = "not in the model's vocabulary"
    _assert_400(admin.post("/v1/completions", json={"prompt": [5, 10**8], "max_tokens": 2}),
                "10000000", vocab_error)
    _assert_400(admin.post("/v1/completions", json={"prompt": [2**70], "max_tokens": 2}),
                vocab_error)
    _assert_400(admin.post("/v1/completions", json={"prompt": [-1], "max_tokens": 2}),
                "prompt.0", "greater than or equal to 0")
    ok = admin.post("/v1/completions", json={"prompt": [0, 5, 6], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_sampling_values_vllm_cannot_take_are_refused(admin: httpx.Client) -> None:
    for name in ("seed", "top_k"):
        _assert_400(admin.post("/v1/completions", json={"prompt": "x", name: 2**64}), name)
        ok = admin.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, name: 2**63 - 1})
        assert ok.status_code == 200, (name, ok.text)
    _assert_400(admin.post("/v1/completions", json={"prompt": "x", "stop": ""}), "stop")
    _assert_400(admin.post("/v1/completions", json={"prompt": "x", "stop": ["a", ""]}), "stop.1")


def test_agent_values_that_overflowed_are_refused(admin: httpx.Client) -> None:
    # 1.7e308 made the record's times infinite: null in JSON, against the record's schema.
    _assert_400(admin.post("/v1/agents", json={"type": "t", "predicted_cost": 1.7e308}),
                "predicted_cost")
    # A critical path of 10**400 tokens overflowed the delay bound's float arithmetic.
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 2, "critical_path_tokens": 10**400}}), "metadata.critical_path_tokens")
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 2, "prefill_tokens": -1}}), "metadata.prefill_tokens")
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 2, "first_request_tokens": 10**400}}), "metadata.first_request_tokens")
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 2, "prefill_square_tokens": 10**400}}), "metadata.prefill_square_tokens")
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 2, "prefill_square_tokens": -1}}), "metadata.prefill_square_tokens")
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 2, "stage_request_tokens": [300, 10**400]}}), "metadata.stage_request_tokens")
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 1, "stage_request_tokens": []}}), "metadata.stage_request_tokens")
    # one entry per declared stage
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {
        "stages": 3, "stage_request_tokens": [300, 4000]}}), "metadata.stage_request_tokens has 2 entries")
    # stages 0 is refused like any declared shape out of range (not ignored)
    _assert_400(admin.post("/v1/agents", json={"type": "t", "metadata": {"stages": 0}}),
                "metadata.stages")
    rec = admin.post("/v1/agents", json={"type": "t", "predicted_cost": 1e18,
                                         "metadata": {"stages": 3, "critical_path_tokens": 900,
                                                      "prefill_tokens": 10**12, "prefill_square_tokens": 10**24,
                                                      "stage_request_tokens": [10**12, 0, 4000]}})
    assert rec.status_code == 201, rec.text
    assert all(isinstance(rec.json()[k], float)
               for k in ("fair_finish_s", "eta_s", "delay_bound_s", "deadline_s"))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_inference_routes_refuse_malformed_bodies_with_a_message(admin: httpx.Client,
                                                                      path: str) -> None:
    # These two routes parse their bodies directly (server/openai_api.py, the hot path),
    # not through FastAPI: the answers must stay those of every other route.
    _assert_400(_raw(admin, path, ""), "not valid JSON")
    _assert_400(_raw(admin, path, '{"prompt": 5'), "not valid JSON")
    _assert_400(_raw(admin, path, "[]"), "object")
    _assert_400(_raw(admin, path, "{}"), "prompt" if path == "/v1/completions" else "messages",
                "required")
    _assert_400(_raw(admin, path, '{"prompt": "x", "messages": [], "max_tokens": NaN}'),
                "max_tokens", "not a JSON number")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_inference_routes_check_the_key_like_the_others(fuzz_server, path: str) -> None:
    api = fuzz_server.url
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": f"Basic {KEYS['alice']}"},
                    {"Authorization": "Bearer wrong-key"}):
        r = httpx.post(api + path, json=body, headers=headers, timeout=TIMEOUT_S)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", r.text
        # the same answer as a route that FastAPI's dependencies serve
        assert httpx.get(api + "/v1/models", headers=headers).status_code == 401
    ok = httpx.post(api + path, json=body, headers={"Authorization": f"Bearer {KEYS['alice']}"},
                    timeout=TIMEOUT_S)
    assert ok.status_code == 200, ok.text


def test_a_wrong_method_names_every_allowed_one(admin: httpx.Client) -> None:
    # /v1/agents is one route per method: Starlette's own 405 named only the first one's.
    r = admin.put("/v1/agents")
    assert r.status_code == 405 and r.headers["Allow"] == "GET, POST", r.headers
    assert "allowed: GET, POST" in r.json()["detail"]
    r = admin.request("PATCH", "/v1/admin/pause")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    assert admin.delete("/v1/completions").headers["Allow"] == "POST"
