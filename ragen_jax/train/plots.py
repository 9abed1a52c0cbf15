"""PNG curves of a run's diagnostics: ``python -m ragen_jax.train.plots RUN_DIR``.

Reads ``RUN_DIR/metrics.jsonl`` and writes ``RUN_DIR/plots/<panel>.png`` for each panel that has data,
plus ``RUN_DIR/plots/overview.png`` with all of them. The panels are the curves RAGEN-2 reads to spot
template collapse: task success, in-group reward std (the filter's signal), the filter's kept ratio, the
MI family (estimate, retrieval accuracy, z-score) and the two entropies (conditional, token).
"""

from __future__ import annotations

import os
import re
import sys

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from ragen_jax.train.metrics import read_metrics  # noqa: E402

# (file name, title, regexes of the metric keys drawn in the panel)
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("success", "Success rate", (r"^val/success$", r"^train/success$")),
    ("reward_std", "In-group reward std", (r"^rollout/in_group_reward_std$", r"^rollout/chosen_in_group_reward_std$")),
    ("kept_ratio", "Filter kept ratio", (r"^filter/kept_ratio$",)),
    ("mi_estimate", "MI estimate", (r"^collapse_[a-z_]+/mi_estimate$", r"^collapse_[a-z_]+/mi_seq_estimate$")),
    ("retrieval_accuracy", "Retrieval accuracy", (r"^collapse_[a-z_]+/retrieval_accuracy$", r"^collapse_[a-z_]+/retrieval_chance_level$")),
    ("mi_zscore", "MI z-score", (r"^collapse_[a-z_]+/mi_zscore(_ema)?$",)),
    ("conditional_entropy", "Conditional entropy", (r"^collapse_[a-z_]+/conditional_entropy_est$",)),
    ("token_entropy", "Token entropy", (r"^actor/entropy$",)),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if value is not None:
            steps.append(row["step"])
            values.append(value)
    return steps, values


def panel_keys(rows: list[dict], patterns: tuple[str, ...]) -> list[str]:
    keys = sorted({k for row in rows for k, v in row.items() if k not in ("step", "time") and v is not None})
    return [k for p in patterns for k in keys if re.match(p, k)]


def draw_panel(ax, rows: list[dict], title: str, keys: list[str]) -> None:
    for key in keys:
        steps, values = _series(rows, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def make_plots(run_dir: str) -> list[str]:
    """Write the PNGs; returns their paths. A run with no metrics yet raises ValueError."""
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"no metrics in {os.path.join(run_dir, 'metrics.jsonl')}: nothing to plot")
    out_dir = os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    drawn = [(name, title, panel_keys(rows, pats)) for name, title, pats in PANELS]
    drawn = [(n, t, k) for n, t, k in drawn if k]
    written = []
    for name, title, keys in drawn:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw_panel(ax, rows, title, keys)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if drawn:
        cols = 3
        n_rows = -(-len(drawn) // cols)
        fig, axes = plt.subplots(n_rows, cols, figsize=(5 * cols, 3.5 * n_rows), squeeze=False)
        for ax, (_, title, keys) in zip(axes.flat, drawn):
            draw_panel(ax, rows, title, keys)
        for ax in list(axes.flat)[len(drawn):]:
            ax.axis("off")
        fig.tight_layout()
        path = os.path.join(out_dir, "overview.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m ragen_jax.train.plots RUN_DIR", file=sys.stderr)
        return 2
    try:
        paths = make_plots(argv[1])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
