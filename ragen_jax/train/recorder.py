"""``StepRecorder``: what the training loop does with each step's metrics once the step is done.

It writes them (``metrics.jsonl``, TensorBoard, the progress line), prints RAGEN-2's warning signs the
first time they appear (``train/report.py``), writes sample conversations and calls the user's
``on_step``; all of it on the main process only.
"""

from __future__ import annotations

import sys
from typing import Callable

from ragen_jax.train.metrics import MetricsWriter, Progress, read_metrics
from ragen_jax.train.report import warning_signs

PROGRESS_KEYS = ("train/success", "val/success", "rollout/in_group_reward_std", "filter/kept_ratio",
                 "collapse_trajectory_sample/mi_estimate")


class StepRecorder:
    """Writes each step's metrics (``metrics.jsonl``, TensorBoard, the progress line), prints RAGEN-2's
    warning signs the first time they appear (train/report.py) and calls ``on_step``; main process only."""

    def __init__(self, run_dir: str, config, start: int, is_main: bool,
                 on_step: Callable[[int, dict], None] | None):
        self.config, self.is_main, self.on_step = config, is_main, on_step
        self.writer = MetricsWriter(run_dir, enabled=is_main, first_step=start if start > 1 else 0)
        self.progress = Progress(config.trainer.total_steps, start - 1, enabled=is_main and config.trainer.progress,
                                 keys=PROGRESS_KEYS)
        self.rows = read_metrics(run_dir) if is_main else []  # the run so far, for the warning signs
        self.warned: set[str] = set()

    def record(self, step: int, metrics: dict) -> dict:
        written = self.writer.write(step, metrics)
        self.progress.update(step, written)
        if self.is_main:
            self.rows.append({"step": step, **written})
            for line in warning_signs(self.rows):
                sign = line.split(":")[1]
                if sign not in self.warned and self.config.trainer.progress:
                    print(line, file=sys.stderr, flush=True)
                self.warned.add(sign)
            if self.on_step is not None:
                self.on_step(step, written)
        return written

    def samples(self, step: int, traj, tokenizer) -> None:
        """The first two conversations of the batch in ``samples.txt`` at step 1 and every sample_every."""
        every = self.config.trainer.sample_every
        if every > 0 and (step == 1 or step % every == 0):
            for i in range(min(2, traj.num_rows)):
                self.writer.write_text(step, f"train sample {i} (reward {float(traj.episode_reward[i]):.3g})",
                                       traj.to_text(i, tokenizer))

    def say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)

    def close(self) -> None:
        self.writer.close()
