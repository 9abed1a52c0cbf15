"""What a run tells its user at the end: validation success before vs after RL, RAGEN-2's warning
signs in plain words, and where the curves and samples are.

The warning signs (RAGEN-2, "Reasoning Collapse in Agentic RL", sections 3-4):
  * reward variance collapse: the in-group reward std is 0 over the last ``window`` steps. Every
    group's episodes got the same reward, so GRPO's and PPO's group advantages are zero: the update has
    no task signal left (SNR-Aware Filtering drops such groups; an empty batch stops the run);
  * template collapse: the trajectory MI estimate fell by more than half of its first value while the
    token entropy did not fall by more than 10%: the reasoning still looks varied but depends less and
    less on the input, which entropy alone does not show.
Both read only the rows of ``metrics.jsonl`` (``train.metrics.read_metrics``).
"""

from __future__ import annotations

import math
import os

REWARD_STD = "rollout/in_group_reward_std"
MI = "collapse_trajectory_sample/mi_estimate"
ENTROPY = "actor/entropy"
VAL_SUCCESS = "val/success"
VAL_EPISODES = "val/num_episodes"


def _series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the rows where ``key`` holds a finite number."""
    return [(int(r["step"]), float(r[key])) for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def warning_signs(rows: list[dict], window: int = 5, mi_drop: float = 0.5,
                  entropy_hold: float = 0.9) -> list[str]:
    """One plain-words line per warning sign the rows show (see the module docstring); [] for none."""
    out = []
    std = _series(rows, REWARD_STD)
    if len(std) >= window and all(v == 0.0 for _, v in std[-window:]):
        peak = max(v for _, v in std)
        out.append(f"warning: reward variance collapsed: the in-group reward std was 0 in the last {window} "
                   f"steps (at most {peak:.3g} before): every group's episodes got the same reward, so the "
                   "update has no task signal")
    mi, entropy = _series(rows, MI), _series(rows, ENTROPY)
    if len(mi) >= 2 and len(entropy) >= 2 and mi[0][1] > 0:
        (s0, mi0), (s1, mi1) = mi[0], mi[-1]
        e0, e1 = entropy[0][1], entropy[-1][1]
        if mi1 < (1.0 - mi_drop) * mi0 and e1 >= entropy_hold * e0:
            out.append(f"warning: template collapse: the MI estimate fell {mi0:.3g} -> {mi1:.3g} (steps {s0} -> "
                       f"{s1}) while token entropy held ({e0:.3g} -> {e1:.3g}): the reasoning depends less on "
                       "the input")
    return out


def change_vs_noise(v0: float, n0: float, v1: float, n1: float) -> str:
    """The change of a validation success rate against two standard errors of the difference of two
    independent binomial estimates, 2 * sqrt(p0 (1 - p0) / n0 + p1 (1 - p1) / n1)."""
    two_se = 2.0 * math.sqrt(v0 * (1.0 - v0) / n0 + v1 * (1.0 - v1) / n1)
    verdict = "beyond" if abs(v1 - v0) > two_se else "within"
    return f"change {v1 - v0:+.3f}, {verdict} two standard errors ({two_se:.3f}; {n0:.0f} and {n1:.0f} episodes)"


def summary_lines(run_dir: str, rows: list[dict]) -> list[str]:
    """The end-of-run report: validation success first vs last (and the change against the validation's
    sampling noise), the warning signs, the files to look at."""
    lines = []
    val = _series(rows, VAL_SUCCESS)
    if len(val) >= 2:
        (s0, v0), (s1, v1) = val[0], val[-1]
        start = "before RL" if s0 == 0 else f"step {s0}"
        lines.append(f"validation success: {v0:.3f} ({start}) -> {v1:.3f} (step {s1})")
        episodes = dict(_series(rows, VAL_EPISODES))
        if episodes.get(s0, 0) > 0 and episodes.get(s1, 0) > 0:
            lines.append(f"validation success {change_vs_noise(v0, episodes[s0], v1, episodes[s1])}")
    elif val:
        lines.append(f"validation success: {val[0][1]:.3f} (step {val[0][0]})")
    lines += warning_signs(rows)
    for name, what in (("plots", "curves"), ("samples.txt", "sample conversations"), ("metrics.jsonl", "metrics")):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            lines.append(f"{what}: {path}")
    return lines
