"""ETAs that know the batch an agent belongs to: a client running 400 inputs 64 at a time
declares the batch, and its first agents' ETAs expect the 336 inputs still held back."""

from __future__ import annotations

import statistics

import pytest

from server.scheduler import Dispatcher
from server.scheduler.declared import BatchDeclaration, DeclaredBatches

SIZE, CONCURRENCY = 400, 64
CHEAP, DEAR = 200_000.0, 4_000_000.0  # two agent types' predicted KV costs, +-50% by prompt


def cost(i: int) -> float:
    return (CHEAP if i % 2 else DEAR) * (0.5 + (i * 37 % 64) / 64)


def first_etas(size: int | None) -> list[float]:
    """The ETAs given at registration to the first burst of a batch of `size` inputs
    (undeclared with None), the two types alternating."""
    d = Dispatcher("justitia", 50_000, 0.02)
    etas = []
    for i in range(CONCURRENCY):
        t = 0.001 * i
        view = d.register_agent(f"a{i}", cost(i), t)
        # what the live server does with a registration's metadata["batch"]
        if size is not None and d.arrivals.declare(t, view.charged_cost,
                                                   BatchDeclaration("b1", size, i), d.eta_rate):
            view = d.view(f"a{i}", t)
        etas.append(view.eta_s)
    return etas


def test_a_declared_batch_makes_its_first_agents_expect_the_rest() -> None:
    undeclared = first_etas(None)
    declared = first_etas(SIZE)
    # the dear agents' ETAs count the cheap inputs still to come, which go ahead of them
    dear_before = statistics.median(undeclared[0::2])
    dear_after = statistics.median(declared[0::2])
    assert dear_after > 1.2 * dear_before
    assert max(declared) > 2 * max(undeclared)  # the last in order wait behind the most
    # nothing goes ahead of the cheap ones' share that was not there already
    assert statistics.median(declared[1::2]) >= statistics.median(undeclared[1::2])


def test_held_back_work_shrinks_as_inputs_register_and_an_idle_batch_is_forgotten() -> None:
    batches = DeclaredBatches(idle_s=120.0)
    batches.add(0.0, 100.0, "b", 10, 0)
    batches.add(0.0, 300.0, "b", 10, 1)
    assert batches.held_back(1.0) == pytest.approx(8 * 200.0)
    batches.add(5.0, 200.0, "b", 10, 1)  # a retry of input 1: no new input
    assert batches.held_back(5.0) == pytest.approx(8 * 200.0)
    for i in range(2, 10):
        batches.add(6.0, 200.0, "b", 10, i)
    assert batches.held_back(6.0) == 0.0 and len(batches) == 0  # all registered: forgotten
    batches.add(10.0, 100.0, "c", 1_000, 0)
    assert batches.held_back(100.0) > 0
    assert batches.held_back(131.0) == 0.0 and "c" not in batches  # idle past idle_s
