"""What fuzzing found (tests/test_fuzz_api.py), as fast regressions: the engine tier's
regression tests, run unchanged against the real app with the same keys and limits on the
fake engine. The fuzzing itself stays in the engine tier.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from server.runtime.limits import Rate
from tests.fake_engine import FakeEngine, FakeServer
from tests.test_fuzz_api import (  # noqa: F401  (collected by pytest from this module)
    ADMIN,
    KEYS,
    MAX_MODEL_LEN,
    test_a_wrong_method_names_every_allowed_one,
    test_agent_values_that_overflowed_are_refused,
    test_lone_surrogates_are_refused,
    test_nan_and_infinity_are_refused,
    test_sampling_values_vllm_cannot_take_are_refused,
    test_the_inference_routes_check_the_key_like_the_others,
    test_the_inference_routes_refuse_malformed_bodies_with_a_message,
    test_the_schema_documents_the_errors_and_the_key,
    test_token_ids_outside_the_vocabulary_are_refused,
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    # The engine tier's options: --kv-tokens 2048 --max-model-len 512
    # --max-request-tokens 400 --rate-limit 1000:1000
    engine = FakeEngine(kv_capacity_tokens=2048, max_model_len=MAX_MODEL_LEN)
    with FakeServer(tmp_path_factory.mktemp("inputs"), engine=engine,
                    api_keys={key: tenant for tenant, key in KEYS.items()},
                    max_request_tokens=400, rate_limit=Rate(1000.0, 1000.0)) as srv:
        yield srv


@pytest.fixture()
def admin(fuzz_server: FakeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.url, headers=ADMIN, timeout=30) as c:
        yield c
