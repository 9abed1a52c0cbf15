"""The end-of-run report (ragen_jax/train/report.py): RAGEN-2's warning signs from metrics rows."""

from __future__ import annotations

import math

from ragen_jax.train.report import (ENTROPY, MI, REWARD_STD, VAL_EPISODES, VAL_SUCCESS, change_vs_noise, summary_lines,
                                    warning_signs)



def test_reward_variance_collapse_needs_a_whole_window_of_zeros():
    collapsed = [{"step": s, REWARD_STD: v} for s, v in enumerate([0.4, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0])]
    (line,) = warning_signs(collapsed, window=5)
    assert "reward variance collapsed" in line and "0.4" in line
    assert warning_signs(collapsed[:-1], window=5) == []  # 4 zeros
    with_nan = collapsed + [{"step": 7, REWARD_STD: math.nan}]  # a step without the metric changes nothing
    assert len(warning_signs(with_nan, window=5)) == 1
    recovered = collapsed + [{"step": 7, REWARD_STD: 0.1}]
    assert warning_signs(recovered, window=5) == []


def test_template_collapse_is_mi_falling_while_entropy_holds():
    def run(mi, entropy):
        return [{"step": s, MI: m, ENTROPY: e} for s, (m, e) in enumerate(zip(mi, entropy))]

    (line,) = warning_signs(run([0.8, 0.5, 0.3], [1.2, 1.3, 1.4]))
    assert "template collapse" in line and "0.8 -> 0.3" in line
    assert warning_signs(run([0.8, 0.5, 0.3], [1.2, 0.9, 0.6])) == []  # entropy fell too: ordinary sharpening
    assert warning_signs(run([0.8, 0.7, 0.6], [1.2, 1.3, 1.4])) == []  # MI fell less than half
    assert warning_signs(run([0.8], [1.2])) == []  # one measurement is no trend


def test_summary_names_success_before_and_after_and_the_files(tmp_path):
    (tmp_path / "plots").mkdir()
    (tmp_path / "samples.txt").write_text("x")
    rows = [{"step": 0, VAL_SUCCESS: 0.125}, {"step": 5, REWARD_STD: 0.3}, {"step": 10, VAL_SUCCESS: 0.5}]
    lines = summary_lines(str(tmp_path), rows)
    assert lines[0] == "validation success: 0.125 (before RL) -> 0.500 (step 10)"
    assert any(line.startswith("curves: ") and line.endswith("plots") for line in lines)
    assert any(line.startswith("sample conversations: ") for line in lines)
    assert not any(line.startswith("metrics: ") for line in lines)  # no metrics.jsonl in this directory


def test_summary_weighs_the_change_against_two_standard_errors(tmp_path):
    rows = [{"step": 0, VAL_SUCCESS: 0.25, VAL_EPISODES: 400.0}, {"step": 10, VAL_SUCCESS: 0.5, VAL_EPISODES: 400.0}]
    lines = summary_lines(str(tmp_path), rows)
    # 2 * sqrt(0.25 * 0.75 / 400 + 0.5 * 0.5 / 400) = 2 * sqrt(0.4375 / 400) = 0.0661
    assert lines[1] == "validation success change +0.250, beyond two standard errors (0.066; 400 and 400 episodes)"
    assert change_vs_noise(0.25, 400, 0.3, 400).startswith("change +0.050, within two standard errors (0.063;")
    assert len(summary_lines(str(tmp_path), [{k: v for k, v in r.items() if k != VAL_EPISODES} for r in rows])) == 1
