"""RAGEN-2's early-stopping rules (``ragen/trainer/agent_trainer.py::fit``), as a small JSON-serialisable state.

- Reward-variance collapse: V_base = mean in-group reward std over the first ``baseline_steps``
  successful steps; afterwards, stop when the last ``window`` consecutive successful steps all have
  RV < ``ratio`` * V_base.                                        reason: reward_variance_collapse
- Validation failure: validation success < ``low_val_success`` for ``low_val_patience`` consecutive
  validations.                                                     reason: low_validation_success
- Empty filter: ``empty_stop_steps`` consecutive steps whose filtered batch was empty.
                                                                   reason: empty_filtered_steps
- Non-finite: ``max_nonfinite`` consecutive steps whose update skipped a non-finite loss/gradient.
                                                                   reason: nonfinite_updates
A "successful step" is one whose update ran (not empty, not skipped as non-finite).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class EarlyStop:
    baseline_steps: int = 10
    window: int = 10
    ratio: float = 0.1
    low_val_success: float = 0.01
    low_val_patience: int = 5
    empty_stop_steps: int = 5
    max_nonfinite: int = 3
    rv_history: list = dataclasses.field(default_factory=list)
    low_val_count: int = 0
    empty_count: int = 0
    nonfinite_count: int = 0
    reason: str = ""

    @classmethod
    def from_config(cls, config) -> "EarlyStop":
        t = config.trainer
        return cls(
            baseline_steps=t.rv_collapse_baseline_steps, window=t.rv_collapse_window, ratio=t.rv_collapse_ratio,
            low_val_success=t.low_val_success, low_val_patience=t.low_val_patience,
            empty_stop_steps=config.filter.empty_stop_steps, max_nonfinite=t.max_nonfinite_in_a_row,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "EarlyStop":
        return cls(**data)

    @property
    def baseline(self) -> float | None:
        if len(self.rv_history) < self.baseline_steps:
            return None
        return sum(self.rv_history[: self.baseline_steps]) / self.baseline_steps

    def after_step(self, reward_std: float, empty: bool, nonfinite: bool) -> str:
        """Record one training step; returns the stop reason ('' to go on)."""
        self.empty_count = self.empty_count + 1 if empty else 0
        self.nonfinite_count = self.nonfinite_count + 1 if nonfinite else 0
        if self.empty_count >= self.empty_stop_steps:
            self.reason = "empty_filtered_steps"
        elif self.nonfinite_count >= self.max_nonfinite:
            self.reason = "nonfinite_updates"
        elif not empty and not nonfinite and math.isfinite(reward_std):
            self.rv_history.append(float(reward_std))
            base = self.baseline
            recent = self.rv_history[self.baseline_steps:][-self.window:]
            if base is not None and len(recent) == self.window and all(rv < self.ratio * base for rv in recent):
                self.reason = "reward_variance_collapse"
        return self.reason

    def after_validation(self, success: float) -> str:
        self.low_val_count = self.low_val_count + 1 if success < self.low_val_success else 0
        if self.low_val_count >= self.low_val_patience:
            self.reason = "low_validation_success"
        return self.reason

    def explain(self) -> str:
        return {
            "empty_filtered_steps": f"{self.empty_count} consecutive steps had no group left after filtering",
            "nonfinite_updates": f"{self.nonfinite_count} consecutive updates had a non-finite loss or gradient "
                                 "(lower the learning rate, check rewards)",
            "reward_variance_collapse": f"in-group reward std stayed below {self.ratio} x its baseline "
                                        f"{self.baseline:.4g} for {self.window} steps" if self.baseline else "",
            "low_validation_success": f"validation success < {self.low_val_success} for {self.low_val_count} "
                                      "consecutive validations",
        }.get(self.reason, "")
