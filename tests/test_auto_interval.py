"""The adaptive update interval, driven with synthetic importance sequences."""

import math

import pytest

from zenflow.runtime.auto_interval import AutoUpdateInterval
from zenflow.runtime.schedule import Schedule, lr_scale

K, COLUMNS = 10, 100


def window(selected_per_column, unselected_per_column, coherent, steps=64):
    """Energies of a weight over a window: each step gives a selected column
    ``selected_per_column`` and an unselected one ``unselected_per_column``; a coherent
    (drifting) unselected gradient piles up as n^2, noise as n."""
    for n in range(1, steps + 1):
        piled = (n * n if coherent else n) * unselected_per_column * (COLUMNS - K)
        yield {"w": (selected_per_column * K, piled, K, COLUMNS)}


def steps_until_fire(rule, energies_per_step):
    for step, energies in enumerate(energies_per_step, start=1):
        if rule.observe(energies):
            rule.reset()
            return step
    return None


@pytest.mark.parametrize(
    "ratio, coherent, expected",
    [(10.0, True, 4), (4.0, True, 2), (1.0, True, 1), (10.0, False, 10), (30.0, False, 30)],
)
def test_fires_when_the_piled_sum_matches_one_selected_step(ratio, coherent, expected):
    rule = AutoUpdateInterval(0.99, min_interval=1, max_interval=64)
    assert steps_until_fire(rule, window(ratio, 1.0, coherent)) == expected


def test_waits_for_auto_ratio_of_the_weights():
    fast, slow = window(1.0, 1.0, False), window(50.0, 1.0, False)
    steps = [{"a": a["w"], "b": b["w"]} for a, b in zip(fast, slow, strict=True)]
    assert steps_until_fire(AutoUpdateInterval(0.5, min_interval=1, max_interval=64), steps) == 1
    assert steps_until_fire(AutoUpdateInterval(0.99, min_interval=1, max_interval=64), steps) == 50


def test_max_interval_bounds_the_window():
    steps = window(1e6, 1.0, False)
    assert steps_until_fire(AutoUpdateInterval(0.99, min_interval=1, max_interval=8), steps) == 8


def test_weights_without_a_split_do_not_vote():
    steps = [{"all-selected": (1.0, 0.0, 2, 2), "none": (0.0, 1.0, 0, 2)}] * 20
    assert steps_until_fire(AutoUpdateInterval(0.99, min_interval=1, max_interval=12), steps) == 12


def test_reset_starts_a_new_window_and_state_round_trips():
    rule = AutoUpdateInterval(0.99, min_interval=1, max_interval=64)
    assert steps_until_fire(rule, window(9.0, 1.0, True)) == 3
    partial = window(9.0, 1.0, True)
    assert not rule.observe(next(partial))
    restored = AutoUpdateInterval(0.99, min_interval=1, max_interval=64)
    restored.load_state_dict(rule.state_dict())
    assert not restored.observe(next(partial))
    assert restored.observe(next(partial))


@pytest.mark.parametrize("floor, expected", [(1, 2), (3, 3), (6, 6)])
def test_no_window_closes_before_the_floor(floor, expected):
    rule = AutoUpdateInterval(0.99, min_interval=floor, max_interval=16)
    assert steps_until_fire(rule, window(4.0, 1.0, True)) == expected


def test_the_floor_defaults_to_4_or_the_ceiling():
    assert AutoUpdateInterval(0.99, min_interval=None, max_interval=16).min_interval == 4
    assert AutoUpdateInterval(0.99, min_interval=None, max_interval=2).min_interval == 2


@pytest.mark.parametrize(
    "floor, ceiling, message",
    [
        (0, 4, r"min_update_interval must be between 1 and max_update_interval \(4\), got 0"),
        (5, 4, r"min_update_interval must be between 1 and max_update_interval \(4\), got 5"),
        (None, 0, "max_update_interval must be >= 1, got 0"),
    ],
)
def test_bounds_out_of_order_are_refused(floor, ceiling, message):
    with pytest.raises(ValueError, match=message):
        AutoUpdateInterval(0.99, min_interval=floor, max_interval=ceiling)


def test_a_window_steps_with_the_square_root_of_its_length():
    auto = Schedule(warm_up_rounds=0, select_interval=8, update_interval=None, selects=True)
    assert [lr_scale(auto, n) for n in (1, 4, 9)] == [1.0, 2.0, 3.0]
    assert lr_scale(auto, 2) == math.sqrt(2)
    fixed = auto._replace(update_interval=4)
    assert [lr_scale(fixed, n) for n in (1, 4, 9)] == [1.0, 1.0, 1.0]
