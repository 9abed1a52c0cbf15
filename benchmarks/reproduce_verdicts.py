"""The checks behind each claim's verdict in docs/reproduction.md, from results JSON parts (pure functions).

A check is (what is checked, passed): passed is None when it cannot be decided (fewer than 2 seeds on a
side of a comparison). ``verdict`` turns a claim's checks into reproduced / partly / not reproduced / not
run yet. Every comparison of success goes through ``reproduce_analysis.compare`` (a gain only beyond the
seeds' spread), every correlation through its bootstrap CI (``ci_sign``).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

import reproduce_analysis as A

Check = tuple[str, bool | None]  # (what is checked, passed; None = cannot be decided, e.g. too few seeds)


def verdict_from_counts(passed: int, total: int) -> str:
    """"reproduced" (all checks pass), "partly" (some), "not reproduced" (none), "not run yet" (no checks)."""
    if total == 0:
        return "not run yet"
    if passed == total:
        return "reproduced"
    return "partly" if passed > 0 else "not reproduced"


def verdict(checks: list[Check]) -> str:
    """"reproduced" / "partly" / "not reproduced" over the decided checks; "not run yet" without checks,
    "undecided (too few seeds)" when none is decided."""
    decided = [ok for _, ok in checks if ok is not None]
    if not checks:
        return "not run yet"
    if not decided:
        return "undecided (too few seeds)"
    return verdict_from_counts(sum(decided), len(decided))


def _outcome(treatment: Mapping[int, float], baseline: Mapping[int, float], want: str) -> bool | None:
    result = A.compare(list(treatment.values()), list(baseline.values()))
    return None if result == "too few seeds" else result == want


def filter_checks(runs: Sequence[Mapping]) -> list[Check]:
    """Each filter (top_p_linear, top_p_softmax) against no_filter on each task: a gain beyond the spread."""
    checks = []
    for task in sorted({r["task"] for r in runs}):
        base = A.finals_by(runs, task=task, condition="no_filter")
        for cond in ("top_p_linear", "top_p_softmax"):
            treat = A.finals_by(runs, task=task, condition=cond)
            if base and treat:
                checks.append((f"{task}: {cond} > no_filter", _outcome(treat, base, "gain")))
    return checks


def top_p_checks(runs: Sequence[Mapping]) -> list[Check]:
    """p = 0.98 and 0.9 beat p = 1.0 (no filter); p = 0.6 falls below p = 0.98 (too aggressive)."""
    by = {c: A.finals_by(runs, condition=c) for c in {r["condition"] for r in runs}}
    checks = []
    for treat, base, want in (("p=0.98", "p=1.0", "gain"), ("p=0.9", "p=1.0", "gain"), ("p=0.6", "p=0.98", "loss")):
        if by.get(treat) and by.get(base):
            checks.append((f"{treat} {'>' if want == 'gain' else '<'} {base}", _outcome(by[treat], by[base], want)))
    return checks


def predictor_checks(table: Sequence[Mapping]) -> list[Check]:
    """Some MI-family metric correlates positively with success (Spearman CI above 0), no entropy-family
    metric does, and the MI family's mean Spearman exceeds the entropy family's."""
    mi = [t for t in table if t["family"] == "mi" and math.isfinite(t["spearman"])]
    ent = [t for t in table if t["family"] == "entropy" and math.isfinite(t["spearman"])]
    if not mi or not ent:
        return []
    return [("an MI-family metric has Spearman CI > 0", any(A.ci_sign(t["spearman_ci"]) > 0 for t in mi)),
            ("no entropy-family metric has Spearman CI > 0", not any(A.ci_sign(t["spearman_ci"]) > 0 for t in ent)),
            ("mean Spearman: MI family > entropy family",
             float(np.mean([t["spearman"] for t in mi])) > float(np.mean([t["spearman"] for t in ent])))]


COLLAPSE_MI = "collapse_trajectory_sample/retrieval_accuracy"
COLLAPSE_ENTROPY = "collapse_trajectory_sample/conditional_entropy_est"




def collapse_checks(runs: Sequence[Mapping]) -> list[Check]:
    """Unfiltered: MI (retrieval accuracy) falls beyond the spread while the conditional entropy does not,
    one check (an entropy that holds shows nothing when MI holds too); filtered: the final MI exceeds the
    unfiltered run's beyond the spread (template collapse, fig7). The same two checks for the runs that
    learn from a coin (``coin_`` conditions) when the study holds them."""
    checks = []
    for prefix in ("", "coin_"):
        unfiltered, filtered = f"{prefix}no_filter", f"{prefix}top_p_linear"
        mi0, mi1 = A.curve_ends(runs, unfiltered, COLLAPSE_MI)
        h0, h1 = A.curve_ends(runs, unfiltered, COLLAPSE_ENTROPY)
        if mi0 and h0:
            mi_fell, h_fell = _outcome(mi1, mi0, "loss"), _outcome(h1, h0, "loss")
            collapsed = None if mi_fell is None or h_fell is None else mi_fell and not h_fell
            checks.append((f"{unfiltered}: retrieval accuracy falls while the conditional entropy does not",
                           collapsed))
        _, f1 = A.curve_ends(runs, filtered, COLLAPSE_MI)
        if f1 and mi1:
            checks.append((f"final retrieval accuracy: {filtered} > {unfiltered}", _outcome(f1, mi1, "gain")))
    return checks


def gradient_checks(probes: Sequence[Mapping[str, float]]) -> list[Check]:
    """The task-gradient norm rises with the bucket's reward std (mean Spearman over probes > 0.5) and
    spreads over the buckets more than each regularizer's (max/min ratio), as in fig12."""
    task = A.gradient_trend(probes, "task")
    if not task["probes"]:
        return []
    checks = [("task norm rises with reward std (mean Spearman > 0.5)", task["rho"] > 0.5)]
    for reg in ("entropy", "kl"):
        r = A.gradient_trend(probes, reg)
        if r["probes"] and math.isfinite(r["ratio"]) and math.isfinite(task["ratio"]):
            checks.append((f"{reg} norm flatter than task norm across buckets (max/min ratio)", r["ratio"] < task["ratio"]))
    return checks
