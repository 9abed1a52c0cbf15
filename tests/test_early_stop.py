"""RAGEN-2's early-stopping rules (RAGEN `ragen/trainer/agent_trainer.py`, `fit`), one test per rule,
on hand-made step sequences whose stopping step is known in advance."""

import math

import pytest

from ragen_jax.train.early_stop import EarlyStop


def _steps(stop: EarlyStop, reward_stds, empty=False, nonfinite=False) -> list[str]:
    return [stop.after_step(rv, empty, nonfinite) for rv in reward_stds]


def test_reward_variance_collapse_needs_a_full_window_below_the_baseline_fraction():
    stop = EarlyStop(baseline_steps=3, window=4, ratio=0.1)
    # Baseline = mean(2, 4, 6) = 4; the threshold is 0.4.
    assert _steps(stop, [2.0, 4.0, 6.0]) == ["", "", ""]
    assert stop.baseline == pytest.approx(4.0)
    # Three low steps, then one at the threshold (not below) restarts the window.
    assert _steps(stop, [0.1, 0.2, 0.39, 0.4]) == [""] * 4
    assert _steps(stop, [0.0, 0.1, 0.3]) == [""] * 3
    assert stop.after_step(0.05, False, False) == "reward_variance_collapse"
    assert "below 0.1 x its baseline 4" in stop.explain()


def test_skipped_steps_neither_count_toward_the_baseline_nor_break_the_window():
    stop = EarlyStop(baseline_steps=2, window=2, ratio=0.5, empty_stop_steps=10, max_nonfinite=10)
    stop.after_step(1.0, True, False)  # empty filter: not a successful step
    stop.after_step(100.0, False, True)  # non-finite update: not a successful step
    stop.after_step(math.nan, False, False)  # no reward std measured
    assert stop.baseline is None
    _steps(stop, [1.0, 3.0])
    assert stop.baseline == pytest.approx(2.0)
    assert stop.after_step(0.5, False, False) == ""
    stop.after_step(0.5, True, False)  # an empty step between two low ones
    assert stop.after_step(0.9, False, False) == "reward_variance_collapse"


def test_low_validation_success_for_patience_consecutive_validations():
    stop = EarlyStop(low_val_success=0.01, low_val_patience=3)
    assert [stop.after_validation(s) for s in (0.0, 0.005, 0.01, 0.0, 0.0)] == [""] * 5
    assert stop.after_validation(0.009) == "low_validation_success"
    assert "for 3 consecutive validations" in stop.explain()


def test_empty_filter_stops_after_consecutive_empty_steps_only():
    stop = EarlyStop(empty_stop_steps=3)
    assert _steps(stop, [0.0, 0.0], empty=True) == ["", ""]
    assert stop.after_step(1.0, False, False) == ""  # a step with kept groups resets the count
    assert _steps(stop, [0.0, 0.0], empty=True) == ["", ""]
    assert stop.after_step(0.0, True, False) == "empty_filtered_steps"


def test_nonfinite_updates_stop_after_max_in_a_row():
    stop = EarlyStop(max_nonfinite=2)
    assert stop.after_step(1.0, False, True) == ""
    assert stop.after_step(1.0, False, False) == ""
    assert stop.after_step(1.0, False, True) == ""
    assert stop.after_step(1.0, False, True) == "nonfinite_updates"
    assert "lower the learning rate" in stop.explain()


def test_state_survives_a_json_round_trip_mid_run():
    """A resumed run continues the counters where the checkpoint left them."""
    a = EarlyStop(baseline_steps=2, window=3, ratio=0.5)
    _steps(a, [4.0, 4.0, 1.0, 1.0])
    b = EarlyStop.from_json(a.to_json())
    assert a.after_step(1.0, False, False) == b.after_step(1.0, False, False) == "reward_variance_collapse"


def test_from_config_reads_the_documented_keys():
    from ml_collections import ConfigDict

    config = ConfigDict({"trainer": {"rv_collapse_baseline_steps": 7, "rv_collapse_window": 8,
                                     "rv_collapse_ratio": 0.2, "low_val_success": 0.05, "low_val_patience": 2,
                                     "max_nonfinite_in_a_row": 4},
                         "filter": {"empty_stop_steps": 6}})
    stop = EarlyStop.from_config(config)
    assert (stop.baseline_steps, stop.window, stop.ratio, stop.low_val_success, stop.low_val_patience,
            stop.empty_stop_steps, stop.max_nonfinite) == (7, 8, 0.2, 0.05, 2, 6, 4)
