"""A finished request's time inside the engine, from vLLM's per-request timestamps
(server/engine/vllm_outputs.py `engine_times`): the parts the server's history keeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.engine.vllm_outputs import engine_times


def _stats(queued: float, scheduled: float, first: float, last: float) -> SimpleNamespace:
    # the fields of vLLM's RequestStateStats the split reads (engine core monotonic seconds)
    return SimpleNamespace(queued_ts=queued, scheduled_ts=scheduled, first_token_ts=first, last_token_ts=last)


def test_the_engines_timestamps_split_the_request_into_its_parts() -> None:
    t = engine_times(_stats(100.002, 100.010, 100.050, 100.250), sent_at=100.000, now=100.253)
    assert t is not None
    assert (t.to_engine_s, t.queued_s, t.prefill_s, t.decode_s, t.from_engine_s) == pytest.approx(
        (0.002, 0.008, 0.040, 0.200, 0.003))
    # the parts cover the hand-off to the last output's arrival, no more
    assert t.to_engine_s + t.queued_s + t.prefill_s + t.decode_s + t.from_engine_s == pytest.approx(0.253)


def test_a_request_the_engine_never_stepped_has_no_split() -> None:
    assert engine_times(_stats(0.0, 0.0, 0.0, 0.0), sent_at=1.0, now=2.0) is None  # stats off
    assert engine_times(_stats(5.0, 0.0, 0.0, 0.0), sent_at=4.0, now=6.0) is None  # aborted in the queue
    assert engine_times(None, sent_at=1.0, now=2.0) is None  # no stats object at all
