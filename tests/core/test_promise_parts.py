"""What a first deadline is made of (`PromiseParts`): kept with every agent, it gives the
deadline the scheduler gave, and the one another floor would have given."""

import pytest

from server.scheduler.tight_promise import PromiseParts, floor_of
from server.shared.profiles import get_profile
from server.sim.family import simulate_member
from server.sim.shapes import ShapeSpec

CPU = get_profile("cpu-tiny")


@pytest.mark.parametrize("mode", ["fresh", "taught"])
def test_every_agents_parts_give_the_deadline_it_was_promised(mode) -> None:
    # bursts: agents at the head and deep in the queue, large and typical, calibrated
    # deadlines and worst cases (a fresh server's first agents)
    result = simulate_member(ShapeSpec("bursts", seed=3), mode, ["justitia"], CPU, 4096)[0]
    agents = [a for a in result.agents if a.first_deadline_s is not None]
    assert len(agents) == 48 and all(a.first_promise is not None for a in agents)
    for a in agents:
        assert a.first_promise.deadline_s() == pytest.approx(a.first_deadline_s, rel=1e-9, abs=1e-9), a.id
        assert a.first_promise.floor == floor_of(a.first_promise.context, a.first_promise.large)
    tight = [a for a in agents if a.first_promise.tight_s() < a.first_promise.worst_s]
    worst = [a for a in agents if a.first_promise.tight_s() >= a.first_promise.worst_s]
    assert tight and worst  # both kinds of deadline occur, so both are checked
    assert all(a.first_tool_allowance_s == 0.0 for a in tight)
    assert "first_promise" in agents[0].as_dict()


def test_another_floor_moves_only_a_calibrated_deadline_and_never_past_the_worst_case() -> None:
    parts = PromiseParts(worst_s=20.0, eta_s=2.0, fair_share_s=3.0, floor=2.5, record=None, calibrated=True,
                         context=0, large=False)
    assert parts.deadline_s() == 5.0  # 2.5 x the ETA
    assert parts.deadline_s(floor=1.0) == 3.0  # no earlier than the fair share
    assert parts.deadline_s(floor=20.0) == 20.0  # no later than the worst case
    learned = PromiseParts(20.0, 2.0, 3.0, 2.5, record=4.0, calibrated=True, context=0, large=False)
    assert learned.factor == 4.0 and learned.deadline_s(floor=1.0) == 8.0  # the record still counts
    worst_only = PromiseParts(20.0, 2.0, 3.0, 2.5, record=None, calibrated=False, context=0, large=False)
    assert worst_only.deadline_s() == worst_only.deadline_s(floor=1.0) == 20.0
