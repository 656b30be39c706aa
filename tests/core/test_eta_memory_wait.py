"""An agent first in the order still waits for the memory the running requests hold:
admission never preempts, so its ETA starts when enough of them have ended (eta.py
`MemoryDrain`); and admission in strict order starts no agent before the agents ahead of it
that wait for memory."""

from __future__ import annotations

import pytest

from server.scheduler import AgentShape, Dispatcher, RequestSpec
from server.scheduler.eta import MemoryDrain
from server.scheduler.time_model import TimeModel

M = 4096
STEP = TimeModel(base_s=0.005, per_seq_s=0.0, per_prefill_token_s=0.0, per_kv_token_s=0.0)  # 5 ms a step


def test_the_wait_is_the_end_of_the_first_requests_that_free_enough() -> None:
    drain = MemoryDrain.of([(3.0, 1000), (1.0, 500), (2.0, 2000)], free=100)
    assert drain.wait_s(50) == 0.0  # fits now
    assert drain.wait_s(600) == 1.0  # 100 + 500
    assert drain.wait_s(2600) == 2.0  # 100 + 500 + 2000
    assert drain.wait_s(10_000) == 3.0  # more than the cache: once every request has ended
    assert MemoryDrain.of([], free=0).wait_s(100) == 0.0  # nothing running: nothing to wait for


def _cache_held_by_one_long_request(now: float) -> Dispatcher:
    """One request of 3,500 prompt tokens and 500 expected output tokens holds the cache."""
    d = Dispatcher("justitia", M, 0.02, time_model=STEP)
    d.register_agent("long", 5e6, 0.0, shape=AgentShape(1, 500, 3500))
    d.submit(RequestSpec("long-0", "long", prompt_tokens=3500, max_tokens=500), 0.0)
    assert [s.request_id for s in d.admit(0.0)] == ["long-0"]
    d.refresh_etas(now)
    return d


@pytest.mark.parametrize("fast_pass", [False, True])
def test_an_agent_first_in_line_waits_for_the_request_holding_the_cache(fast_pass: bool) -> None:
    now = 1.0  # 200 of the long request's 500 steps run: 300 left, 1.5 s
    d = _cache_held_by_one_long_request(now)
    # small: first in Justitia's order (a far smaller cost), but 2,306 tokens do not fit
    d.register_agent("small", 1e4, now, shape=AgentShape(1, 25, 2281))
    if fast_pass:
        d.refresh_etas(now)
    eta = d.eta_time("small", now) - now
    assert d.policy.static_key(d.agents["small"]) < d.policy.static_key(d.agents["long"])
    assert eta == pytest.approx(1.5 + (25 + 1) * 0.005, rel=0.05)


def test_an_agent_that_fits_beside_the_running_requests_does_not_wait() -> None:
    now = 1.0
    d = _cache_held_by_one_long_request(now)
    d.register_agent("tiny", 1e3, now, shape=AgentShape(1, 10, 200))  # 210 tokens: 96 free
    wait_for_one_small_request = d.eta_time("tiny", now) - now
    d.register_agent("tinier", 1e2, now, shape=AgentShape(1, 10, 50))  # 60 tokens: fits now
    assert d.eta_time("tinier", now) - now < 0.1 < wait_for_one_small_request


def _busy_agent_of_four_requests(d: Dispatcher) -> None:
    """`busy` registers at t = 0 and its four requests of 500 + 100 tokens are admitted:
    2,400 tokens held for 100 steps of 5 ms."""
    d.register_agent("busy", 1e5, 0.0, shape=AgentShape(1, 100, 2000))
    for i in range(4):
        d.submit(RequestSpec(f"busy-{i}", "busy", prompt_tokens=500, max_tokens=100), 0.0)
    assert len(d.admit(0.0)) == 4


def _cache_two_thirds_held_by_small_requests(first_request_tokens: int | None) -> tuple[Dispatcher, str]:
    """Four requests of 600 tokens hold 2,400 of the cache (100 steps each, 0.4 s left at
    t = 0.1); then an agent registers whose first request needs 4,087 tokens, more than the
    1,696 free, though the mix's mean request (600) fits."""
    d = Dispatcher("justitia", M, 0.02, time_model=STEP)
    _busy_agent_of_four_requests(d)
    now = 0.1
    d.refresh_etas(now)
    d.register_agent("big", 1e4, now, shape=AgentShape(2, 20, 4100, first_request_tokens=first_request_tokens))
    return d, "big"


@pytest.mark.parametrize("fast_pass", [False, True])
def test_an_agent_whose_first_request_needs_most_of_the_cache_waits_for_it_to_drain(fast_pass: bool) -> None:
    d, big = _cache_two_thirds_held_by_small_requests(4087)
    if fast_pass:
        d.refresh_etas(0.1)
    waits = d.eta_time(big, 0.1) - 0.1
    d_mean, _ = _cache_two_thirds_held_by_small_requests(None)  # its first request unknown
    assert d_mean.eta_time(big, 0.1) - 0.1 < 0.4 <= waits  # 80 steps of 5 ms left to drain


def test_the_first_request_counts_only_until_one_of_the_agents_requests_has_finished() -> None:
    d, big = _cache_two_thirds_held_by_small_requests(4087)
    agent = d.agents[big]
    assert d.etas.request_need(agent) == 4087
    agent.requests_done = 1  # past its first request: a request of the mix, as any agent's
    assert d.etas.request_need(agent) < 4087


def _small_agent_behind_a_blocked_one(backfill: bool, fast_pass: bool, now: float = 1.0) -> Dispatcher:
    """The long request holds the cache (1.5 s left); `blocked`, first in the order, has a
    request of 2,306 tokens pending; `small`, after it, needs 60 tokens (96 are free)."""
    d = Dispatcher("justitia", M, 0.02, time_model=STEP, backfill=backfill)
    d.register_agent("long", 5e6, 0.0, shape=AgentShape(1, 500, 3500))
    d.submit(RequestSpec("long-0", "long", prompt_tokens=3500, max_tokens=500), 0.0)
    assert [s.request_id for s in d.admit(0.0)] == ["long-0"]
    d.register_agent("blocked", 1e4, now, shape=AgentShape(1, 25, 2281))
    d.submit(RequestSpec("blocked-0", "blocked", prompt_tokens=2281, max_tokens=25), now)
    assert d.admit(now) == []  # 2,306 tokens do not fit
    if fast_pass:
        d.refresh_etas(now)
    d.register_agent("small", 5e5, now, shape=AgentShape(1, 10, 50))
    if fast_pass:
        d.refresh_etas(now)
    order = [d.policy.static_key(d.agents[a]) for a in ("blocked", "small", "long")]
    assert order == sorted(order)
    return d


@pytest.mark.parametrize("fast_pass", [False, True])
def test_an_agent_behind_one_waiting_for_memory_waits_with_it(fast_pass: bool) -> None:
    now = 1.0
    d = _small_agent_behind_a_blocked_one(backfill=False, fast_pass=fast_pass, now=now)
    # what admission does: the small request fits, but the blocked one ahead holds it back
    d.submit(RequestSpec("small-0", "small", prompt_tokens=50, max_tokens=10), now)
    assert d.admit(now) == []
    if fast_pass:
        d.refresh_etas(now)
    else:
        d.agents["small"].eta_at = None
    # 300 steps of 5 ms until the long request ends and the blocked one starts, then its own
    assert d.eta_time("small", now) - now >= 1.5


def test_with_backfill_an_agent_that_fits_is_not_held_back() -> None:
    now = 1.0
    d = _small_agent_behind_a_blocked_one(backfill=True, fast_pass=True, now=now)
    # its wait is the work ahead of it at the engine's rate, not the long request's end
    assert d.eta_time("small", now) - now < 1.5
    d.submit(RequestSpec("small-0", "small", prompt_tokens=50, max_tokens=10), now)
    assert [s.request_id for s in d.admit(now)] == ["small-0"]  # admission looks past the blocked one


def _later_request_of_most_of_the_cache_pending() -> tuple[Dispatcher, float]:
    """`stages` has run its first stage (one small request) and submitted its second: one
    request of 4,087 tokens, more than the 1,696 the busy agent's four requests leave free
    (0.4 s of their steps left at t = 0.1), though the mix's mean request fits."""
    d = Dispatcher("justitia", M, 0.02, time_model=STEP)
    d.register_agent("stages", 1e4, 0.0, shape=AgentShape(2, 20, 4100))
    d.submit(RequestSpec("stages-0", "stages", prompt_tokens=10, max_tokens=3), 0.0)
    assert [s.request_id for s in d.admit(0.0)] == ["stages-0"]
    d.on_request_finished("stages-0", 10, 3, 0.0)
    _busy_agent_of_four_requests(d)
    now = 0.1
    d.submit(RequestSpec("stages-1", "stages", prompt_tokens=4080, max_tokens=7), now)
    assert d.admit(now) == []  # 4,087 tokens do not fit beside the busy agent's 2,400
    d.refresh_etas(now)
    return d, now


def test_a_pending_request_is_the_memory_its_agent_waits_for() -> None:
    d, now = _later_request_of_most_of_the_cache_pending()
    agent = d.agents["stages"]
    assert agent.requests_done == 1 and d.etas.mean_context + d.etas.mean_decode < 1000
    assert d.etas.request_need(agent) == 4087  # the request queued, not the mix's mean
    assert d.eta_time("stages", now) - now >= 0.4  # 80 steps of 5 ms left to drain


@pytest.mark.parametrize("fast_pass", [False, True])
def test_an_agent_behind_a_pending_request_of_most_of_the_cache_waits_for_the_drain(fast_pass: bool) -> None:
    d, now = _later_request_of_most_of_the_cache_pending()
    d.register_agent("small", 5e4, now, shape=AgentShape(1, 10, 50))
    if fast_pass:
        d.refresh_etas(now)
    order = [d.policy.static_key(d.agents[a]) for a in ("stages", "small")]
    assert order == sorted(order)  # the small agent is ordered after the pending request
    assert d.eta_time("small", now) - now >= 0.4


@pytest.mark.parametrize("fast_pass", [False, True])
def test_a_running_request_holds_its_memory_through_its_prompts_prefill(fast_pass: bool) -> None:
    # 0.1 ms a prompt token: the 3,500-token prompt just admitted takes 0.35 s to prefill,
    # then its 5 output tokens a step each
    model = TimeModel(base_s=0.005, per_seq_s=0.0, per_prefill_token_s=0.0001, per_kv_token_s=0.0)
    d = Dispatcher("justitia", M, 0.02, time_model=model)
    d.register_agent("long", 5e5, 0.0, shape=AgentShape(1, 5, 3500))
    d.submit(RequestSpec("long-0", "long", prompt_tokens=3500, max_tokens=5), 0.0)
    assert [s.request_id for s in d.admit(0.0)] == ["long-0"]
    now = 0.01
    d.refresh_etas(now)
    d.register_agent("small", 1e4, now, shape=AgentShape(1, 25, 2281))  # 2,306 tokens: 591 free
    if fast_pass:
        d.refresh_etas(now)
    it = d.etas.iteration_s()
    prefill_then_decode = 3500 * 0.0001 + 5 * it - now
    assert d.etas.memory_drain(now, it).wait_s(2306) == pytest.approx(prefill_then_decode)
    path = d.etas.critical_path_s(d.agents["small"], it)
    assert d.eta_time("small", now) - now == pytest.approx(prefill_then_decode + path, rel=0.01)


def _next_stage_of_most_of_the_cache(stage_request_tokens: tuple[int, ...] | None) -> tuple[Dispatcher, float]:
    """`stages` is running its first stage (one request of 10 + 50 tokens, 0.15 s of steps
    left at t = 0.1); its second stage's request will need 4,087 tokens, more than the 1,636
    the busy agent's four requests (0.4 s of steps left) leave free beside it. Its shape says
    so where `stage_request_tokens` is given."""
    d = Dispatcher("justitia", M, 0.02, time_model=STEP)
    d.register_agent("stages", 1e4, 0.0, shape=AgentShape(2, 57, 4090, stage_request_tokens=stage_request_tokens))
    d.submit(RequestSpec("stages-0", "stages", prompt_tokens=10, max_tokens=50), 0.0)
    assert [s.request_id for s in d.admit(0.0)] == ["stages-0"]
    _busy_agent_of_four_requests(d)
    now = 0.1
    d.refresh_etas(now)
    d.register_agent("small", 5e4, now, shape=AgentShape(1, 10, 50))
    order = [d.policy.static_key(d.agents[a]) for a in ("stages", "small", "busy")]
    assert order == sorted(order)  # the small agent is ordered after `stages`, before `busy`
    return d, now


@pytest.mark.parametrize("fast_pass", [False, True])
def test_an_agent_behind_one_whose_next_stage_needs_most_of_the_cache_waits_for_the_drain(fast_pass: bool) -> None:
    d, now = _next_stage_of_most_of_the_cache((60, 4087))
    if fast_pass:
        d.refresh_etas(now)
    assert d.agents["stages"].running == 1 and not d.agents["stages"].pending
    # the second stage's request is admitted once the busy agent's requests (80 steps of
    # 5 ms left) have ended; the small agent, ordered after it, starts no sooner
    assert d.eta_time("small", now) - now >= 0.4
    unknown, _ = _next_stage_of_most_of_the_cache(None)  # only the first stage's size known
    if fast_pass:
        unknown.refresh_etas(now)
    assert unknown.eta_time("small", now) - now < 0.4


@pytest.mark.parametrize("fast_pass", [False, True])
def test_a_next_stage_that_fits_beside_the_running_requests_holds_no_one_back(fast_pass: bool) -> None:
    d, now = _next_stage_of_most_of_the_cache((60, 500))  # fits in the 1,636 free
    if fast_pass:
        d.refresh_etas(now)
    assert d.eta_time("small", now) - now < 0.4
