"""Tenancy in the fast tier: the engine tier's tenancy tests (tests/test_tenancy.py), run
unchanged against the real app with the same API keys on the fake engine.

The test functions are imported, so pytest collects them here too, where `keyed_server`
is this module's fake server; in test_tenancy.py they keep running on vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fake_engine import FakeEngine, FakeServer
from tests.test_tenancy import (  # noqa: F401  (collected by pytest from this module)
    KEYS,
    test_admin_calls_need_the_admin_tenant,
    test_calls_without_a_valid_key_are_401,
    test_errors_reveal_nothing_of_other_tenants,
    test_event_streams_only_for_the_owner,
    test_history_and_listings_stay_with_their_tenant,
    test_metrics_hold_no_prompts_ids_tenants_or_keys,
    test_tenants_cannot_see_or_touch_each_others_agents,
    test_the_scheduler_queue_hides_other_tenants_agents,
)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    # The engine tier's server: --kv-tokens 2048 --max-model-len 512 and the same keys.
    engine = FakeEngine(kv_capacity_tokens=2048, max_model_len=512)
    with FakeServer(tmp_path_factory.mktemp("keyed"), engine=engine,
                    api_keys={key: tenant for tenant, key in KEYS.items()}) as srv:
        yield srv
