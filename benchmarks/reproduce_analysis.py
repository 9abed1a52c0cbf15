"""Pure analysis behind ``benchmarks/reproduce.py``: alignment, correlations, bootstrap CIs, seed spread, the gain rule.

Inputs are the rows of runs' ``metrics.jsonl`` (``ragen_jax.train.metrics.read_metrics``) or plain lists; no
file is written here. Kept next to the benchmark rather than in ``ragen_jax.diagnostics``: it compares many
finished runs (a study's bookkeeping), while the library's diagnostics act on one training batch.

Definitions used in the report (RAGEN-2, arXiv 2604.06268, fig10 and the filter tables):
  point         one (run, validation step s): val/success at s and each training metric at the logged step
                nearest s (|t - s| <= max_gap; ties to the earlier step)
  Spearman rho  Pearson correlation of the average ranks (ties share their mean rank)
  bootstrap CI  the (2.5, 97.5) percentiles of the statistic over n_boot resamples of the points with
                replacement (numpy Generator seeded); resamples where the statistic is undefined are dropped
  spread        max(std over seeds of the treatment's finals, std of the baseline's) (population std)
  gain          mean(treatment finals) - mean(baseline finals) > spread, with >= 2 seeds on each side
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

# The proxies RAGEN-2 calls the MI family (higher = more input-dependent reasoning) and the entropy family.
MI_FAMILY = (
    r"^collapse_[a-z_]+/mi_estimate$", r"^collapse_[a-z_]+/mi_seq_estimate$",
    r"^collapse_[a-z_]+/mi_zscore$", r"^collapse_[a-z_]+/mi_zscore_seq$",
    r"^collapse_[a-z_]+/mi_zscore_ema$", r"^collapse_[a-z_]+/mi_zscore_ema_seq$",
    r"^collapse_[a-z_]+/retrieval_accuracy$", r"^collapse_[a-z_]+/retrieval_above_chance$",
)
ENTROPY_FAMILY = (
    r"^collapse_[a-z_]+/conditional_entropy_est$", r"^collapse_[a-z_]+/conditional_entropy_seq_est$",
    r"^collapse_[a-z_]+/reasoning_entropy_est$", r"^collapse_[a-z_]+/reasoning_entropy_seq_est$",
    r"^actor/entropy$",
)


def family_of(key: str) -> str | None:
    """"mi", "entropy" or None for a metric key."""
    if any(re.match(p, key) for p in MI_FAMILY):
        return "mi"
    if any(re.match(p, key) for p in ENTROPY_FAMILY):
        return "entropy"
    return None


def predictor_keys(rows: Iterable[Mapping]) -> list[str]:
    """Sorted keys of the MI and entropy families that have a value in any row."""
    keys = {k for row in rows for k, v in row.items() if v is not None}
    return sorted(k for k in keys if family_of(k) is not None)


def validation_points(rows: Sequence[Mapping], keys: Sequence[str], max_gap: int = 5) -> list[dict]:
    """One point per validation row: {"step", "success", key: value or None for each key}.

    A key's value is that of the logged step t nearest the validation step s with |t - s| <= max_gap
    (ties: the earlier t); MI metrics are logged only every ``mi.every`` steps, so max_gap is that period.
    """
    points = []
    for val in rows:
        if val.get("val/success") is None:
            continue
        s = int(val["step"])
        point = {"step": s, "success": float(val["val/success"])}
        for key in keys:
            best = None
            for row in rows:
                value = row.get(key)
                if value is None:
                    continue
                gap = abs(int(row["step"]) - s)
                if gap <= max_gap and (best is None or gap < best[0] or (gap == best[0] and row["step"] < best[1])):
                    best = (gap, int(row["step"]), float(value))
            point[key] = None if best is None else best[2]
        points.append(point)
    return points


def rank(x: Sequence[float]) -> np.ndarray:
    """Average ranks, 1-based: rank([10, 20, 20, 5]) = [2, 3.5, 3.5, 1]."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.arange(1, x.size + 1)
    for value in np.unique(x):
        tied = x == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """sum((x - mx)(y - my)) / sqrt(sum((x - mx)^2) sum((y - my)^2)); NaN for < 3 points or a constant side."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / denom if denom > 0 else math.nan


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of the average ranks."""
    return pearson(rank(x), rank(y))


def bootstrap_ci(x: Sequence[float], y: Sequence[float], stat: Callable = spearman, n_boot: int = 1000,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile CI of stat(x, y) over resamples of the (x_i, y_i) pairs; (NaN, NaN) when none is defined."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_boot):
        idx = rng.integers(0, x.size, x.size)
        value = stat(x[idx], y[idx])
        if math.isfinite(value):
            values.append(value)
    if not values:
        return math.nan, math.nan
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def correlation_table(points: Sequence[Mapping], keys: Sequence[str], n_boot: int = 1000, seed: int = 0) -> list[dict]:
    """Per key: {"metric", "family", "n", "spearman", "spearman_ci", "pearson", "pearson_ci"} with success,
    over the points where the key has a value."""
    table = []
    for key in keys:
        pairs = [(p[key], p["success"]) for p in points if p.get(key) is not None]
        x = [a for a, _ in pairs]
        y = [b for _, b in pairs]
        table.append({"metric": key, "family": family_of(key), "n": len(pairs),
                      "spearman": spearman(x, y), "spearman_ci": bootstrap_ci(x, y, spearman, n_boot, seed),
                      "pearson": pearson(x, y), "pearson_ci": bootstrap_ci(x, y, pearson, n_boot, seed)})
    return table


def seed_band(curves: Sequence[Sequence[tuple[int, float]]]) -> dict[str, list[float]]:
    """Mean, std (population), min, max over seeds at each step that every curve has.

    curves: one [(step, value), ...] per seed. Returns {"step", "mean", "std", "min", "max"} lists.
    """
    if not curves:
        return {"step": [], "mean": [], "std": [], "min": [], "max": []}
    maps = [dict(c) for c in curves]
    steps = sorted(set.intersection(*(set(m) for m in maps)))
    values = np.array([[m[s] for s in steps] for m in maps], np.float64).reshape(len(maps), len(steps))
    return {"step": steps, "mean": values.mean(0).tolist(), "std": values.std(0).tolist(),
            "min": values.min(0).tolist(), "max": values.max(0).tolist()}


def paired_final_deltas(treatment: Mapping[int, float], baseline: Mapping[int, float]) -> dict[int, float]:
    """treatment[seed] - baseline[seed] for the seeds both have (finals keyed by seed)."""
    return {s: treatment[s] - baseline[s] for s in sorted(set(treatment) & set(baseline))}


def spread(treatment: Sequence[float], baseline: Sequence[float]) -> float:
    """max(std of treatment, std of baseline) over seeds (population std)."""
    return max(float(np.std(treatment)), float(np.std(baseline)))


def compare(treatment: Sequence[float], baseline: Sequence[float]) -> str:
    """"gain", "loss", "within spread", or "too few seeds" (< 2 on either side): the mean difference
    counts only when it exceeds ``spread`` (the seeds' own variation)."""
    if len(treatment) < 2 or len(baseline) < 2:
        return "too few seeds"
    diff = float(np.mean(treatment) - np.mean(baseline))
    width = spread(treatment, baseline)
    if diff > width:
        return "gain"
    if -diff > width:
        return "loss"
    return "within spread"


def ci_sign(ci: tuple[float, float]) -> int:
    """+1 when the CI lies above 0, -1 below 0, 0 when it contains 0 or is undefined."""
    low, high = ci
    if not (math.isfinite(low) and math.isfinite(high)):
        return 0
    return 1 if low > 0 else -1 if high < 0 else 0




def bucket_norms(probe: Mapping[str, float], component: str) -> list[tuple[int, float]]:
    """[(bucket index, norm)] of ``grad_norm/bucket_<i>/<component>`` in a probe, by index (1 = lowest std)."""
    found = []
    for key, value in probe.items():
        m = re.match(rf"^grad_norm/bucket_(\d+)/{component}$", key)
        if m and value is not None:
            found.append((int(m.group(1)), float(value)))
    return sorted(found)


def gradient_trend(probes: Sequence[Mapping[str, float]], component: str) -> dict[str, float]:
    """How a component's gradient norm moves with the reward-std bucket, over probes (one per checkpoint).

    probes: flat dicts of ``grad_norm/bucket_<i>/<component>`` (``diagnostics.gradients``). Per probe,
    rho = Spearman(bucket index, norm) and the range ratio max/min over buckets with a positive norm.
    Returns their means: {"rho", "ratio", "probes"} (NaN when no probe has >= 3 buckets).
    """
    rhos, ratios = [], []
    for probe in probes:
        buckets = bucket_norms(probe, component)
        if len(buckets) < 3:
            continue
        idx, norms = zip(*buckets)
        rho = spearman(idx, norms)
        if math.isfinite(rho):
            rhos.append(rho)
        positive = [n for n in norms if n > 0]
        if positive:
            ratios.append(max(positive) / min(positive))
    mean = lambda v: float(np.mean(v)) if v else math.nan  # noqa: E731
    return {"rho": mean(rhos), "ratio": mean(ratios), "probes": float(len(rhos))}


# ---------------------------------------------------------------- one run's record, from its metrics rows
CURVE_KEYS = (  # the collapse study's curves (RAGEN-2 fig7: retrieval accuracy, MI, reasoning entropy)
    "collapse_trajectory_sample/retrieval_accuracy", "collapse_trajectory_sample/mi_estimate",
    "collapse_trajectory_sample/mi_zscore", "collapse_trajectory_sample/conditional_entropy_est",
    "collapse_trajectory_sample/reasoning_entropy_seq_est", "actor/entropy", "filter/kept_ratio",
    "rollout/in_group_reward_std",
)


def curve(rows: Sequence[Mapping], key: str) -> list[tuple[int, float]]:
    """[(step, value)] of the rows that have ``key``."""
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]


def run_record(rows: Sequence[Mapping], max_gap: int = 5) -> dict:
    """What the report needs of one run: its validation curve, its (validation, predictors) points and
    the ``CURVE_KEYS`` curves."""
    keys = predictor_keys(rows)
    return {"val_curve": curve(rows, "val/success"), "points": validation_points(rows, keys, max_gap),
            "curves": {k: c for k in CURVE_KEYS if (c := curve(rows, k))}}


def final(record: Mapping) -> float | None:
    """The last validation success of a run record (None before any validation)."""
    return record["val_curve"][-1][1] if record.get("val_curve") else None


def finals_by(runs: Sequence[Mapping], **match) -> dict[int, float]:
    """{seed: final success} of the runs whose fields equal ``match`` (e.g. task=..., condition=...)."""
    out = {}
    for r in runs:
        if all(r.get(k) == v for k, v in match.items()) and final(r) is not None:
            out[int(r["seed"])] = final(r)
    return out


def curve_ends(runs: Sequence[Mapping], condition: str, key: str) -> tuple[dict[int, float], dict[int, float]]:
    """({seed: first value}, {seed: last value}) of a curve over the runs of ``condition``."""
    first, last = {}, {}
    for r in runs:
        c = r.get("curves", {}).get(key)
        if r["condition"] == condition and c:
            first[int(r["seed"])], last[int(r["seed"])] = c[0][1], c[-1][1]
    return first, last
