"""Admission after kept contexts give way (server/runtime/admission.py, retain.py): the head of
the queue does not fit beside a paused agent's kept context, the context gives way and is
charged, and the head is admitted at the clock's time after that, never before the virtual
clock. Pure: the real dispatcher, admission and live retention on a clock that moves with
every reading, as the server's does; no engine runs (nothing is touched)."""

from __future__ import annotations

from server.runtime.admission import Admission
from server.runtime.agents import AgentEntry
from server.runtime.limits import Quotas
from server.runtime.retain import LiveRetention
from server.scheduler import Dispatcher, RequestSpec
from server.scheduler.retention import Retention
from tests.support.fake_engine import FakeEngine


class TickingClock:
    """The server's clock: every reading is a little later than the one before."""

    def __init__(self, start: float, tick: float = 0.01) -> None:
        self.t, self.tick, self.reads = start, tick, []

    def __call__(self) -> float:
        self.t += self.tick
        self.reads.append(self.t)
        return self.t


def entry(agent_id: str) -> AgentEntry:
    return AgentEntry(id=agent_id, type="t", tenant="x", prompt="p", metadata={}, submitted_at=0.0,
                      submitted_mono=0.0, predicted_cost=1.0)


def test_the_head_is_admitted_at_the_clocks_time_after_a_kept_context_gives_way() -> None:
    d = Dispatcher("justitia", kv_capacity_tokens=2048, iteration_time_s=0.01)
    clock = TickingClock(1.0)
    engine = FakeEngine(kv_capacity_tokens=2048, block_size=32, max_model_len=2048)
    retention = LiveRetention(Retention("always", d.pauses), d, engine, clock, block_size=32)
    admission = Admission(d, Quotas(), max_num_seqs=8, now=clock)
    admission.retention = retention
    # a paused agent (a large one: behind in the fair order) whose stage left 1,500 tokens
    d.register_agent("paused", 500_000.0, 0.0)
    d.submit(RequestSpec("p0", "paused", prompt_tokens=1400, max_tokens=100), 0.0)
    assert [s.request_id for s in d.admit(0.0)] == ["p0"]
    d.on_request_finished("p0", 1400, 100, 0.5)
    retention.stage_sequences["paused"] = [tuple(range(1500))]
    retention.paused("paused")
    assert "paused" in retention.kept and d.ledger.pinned_kv >= 1500
    # a small agent, ahead in the fair order, whose request does not fit beside the kept context
    d.register_agent("head", 2_000.0, 0.9)
    ticket = admission.submit(entry("head"), RequestSpec("h0", "head", prompt_tokens=900, max_tokens=100), 0.9)
    before = clock.t
    admission.pump()
    assert retention.yields == 1 and "paused" not in retention.kept  # the context gave way...
    assert d.agents["paused"].charged_cost > 500_000.0  # ...and was charged what it held
    assert not ticket.waiting and ticket.error is None  # the head was admitted, not failed
    assert ticket.admitted is not None and ticket.admitted >= d.clock.now
    # at the clock's time read after the context gave way, not the one the pump began with
    began = next(t for t in clock.reads if t > before)
    assert ticket.admitted > began
