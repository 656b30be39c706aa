from hypothesis import given
from hypothesis import strategies as st

from server.scheduler import compute_cost, cost_function, kv_cost, kv_footprint


def test_kv_cost_is_the_sum_of_kv_held_per_decode_step():
    # p=3, d=4: the steps hold 4, 5, 6, 7 tokens
    assert kv_cost(3, 4) == 4 + 5 + 6 + 7
    assert kv_cost(0, 1) == 1
    assert kv_cost(100, 0) == 0


@given(st.integers(0, 5000), st.integers(0, 2000))
def test_kv_cost_closed_form_matches_the_sum(p, d):
    assert kv_cost(p, d) == sum(p + k for k in range(1, d + 1))


def test_compute_cost_and_footprint():
    assert compute_cost(812, 120) == 812 + 240
    assert kv_footprint(812, 120) == 932


def test_cost_function_by_name():
    assert cost_function("kv") is kv_cost
    assert cost_function("compute") is compute_cost
    try:
        cost_function("flops")
    except ValueError as exc:
        assert "flops" in str(exc)
    else:
        raise AssertionError("unknown cost model accepted")
