"""Small PNGs of the reproduction report: seed-band curves, correlation bars with CIs, gradient norms by bucket.

Each function takes plain data (results JSON parts) and a path, draws with matplotlib's Agg backend (as
``ragen_jax.train.plots``) and returns the path.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

import reproduce_analysis as A  # noqa: E402


def band_plot(groups: Mapping[str, Sequence[Sequence[tuple[int, float]]]], title: str, ylabel: str, path: str) -> str:
    """One line per group: the mean over its seeds' curves, and a min/max band."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, curves in groups.items():
        band = A.seed_band(curves)
        if not band["step"]:
            continue
        line, = ax.plot(band["step"], band["mean"], marker="o", markersize=3, label=f"{label} (n={len(curves)})")
        ax.fill_between(band["step"], band["min"], band["max"], color=line.get_color(), alpha=0.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def correlation_bars(table: Sequence[Mapping], path: str) -> str:
    """Spearman rho of each metric with success, bootstrap 95 % CI as error bars; MI family blue, entropy orange."""
    rows = [t for t in table if math.isfinite(t["spearman"])]
    rows.sort(key=lambda t: (t["family"] != "mi", -t["spearman"]))
    fig, ax = plt.subplots(figsize=(6, 0.25 * len(rows) + 1.2))
    for i, t in enumerate(rows):
        low, high = t["spearman_ci"]
        err = [[t["spearman"] - low], [high - t["spearman"]]] if math.isfinite(low) else None
        ax.barh(i, t["spearman"], xerr=err, color="tab:blue" if t["family"] == "mi" else "tab:orange", capsize=2)
    ax.set_yticks(range(len(rows)), [re.sub(r"^collapse_([a-z]+)_[a-z_]*sample/", r"\1/", t["metric"]) for t in rows],
                  fontsize=6)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlim(-1, 1)
    ax.invert_yaxis()
    ax.set_xlabel("Spearman with validation success (95 % bootstrap CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def gradient_bars(probes: Sequence[Mapping[str, float]], path: str) -> str:
    """Per checkpoint, the task / entropy / KL gradient norms against the reward-std bucket (1 = lowest)."""
    components = ("task", "entropy", "kl")
    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    for ax, comp in zip(axes, components):
        for probe in probes:
            buckets = A.bucket_norms(probe, comp)
            if buckets:
                ax.plot(*zip(*buckets), marker="o", markersize=3, label=f"step {probe['step']}")
        ax.set_title(f"{comp} gradient norm", fontsize=9)
        ax.set_xlabel("reward-std bucket")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
