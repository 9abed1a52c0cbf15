"""Run logging: one JSON line per step, TensorBoard event files, sample texts and a progress bar.

Only process 0 writes (``MetricsWriter(..., enabled=jax.process_index() == 0)``); every other process
gets a writer whose methods do nothing, so call sites need no ``if``.

Files in the run directory:
    metrics.jsonl        {"step": s, "time": unix seconds, <metric>: float, ...} per line
    tb/                  TensorBoard events (scalars under the same names)
    samples.txt          sample conversations, each headed by its step

A resumed run first cuts both files back to the restored checkpoint's step (``truncate_run_logs``), so
that they hold one row (one set of samples) per step however often the run was interrupted.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import time
from typing import Mapping

import numpy as np


def _import_summary_writer():
    """tensorboardX's ``SummaryWriter`` (TensorBoard events without TensorFlow), or None when it is not
    installed. Its writer module imports PyTorch whenever PyTorch is installed, only to accept torch
    tensors; that import costs a training process about 0.4 GB of resident memory, and the writer here
    logs floats and strings, so the import is made with ``torch`` marked absent (unless the process
    already imported it)."""
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # makes ``import torch`` raise ImportError
    try:
        from tensorboardX import SummaryWriter as writer
    except ImportError:  # pragma: no cover - tensorboardX is in requirements.txt
        writer = None
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return writer


SummaryWriter = _import_summary_writer()


def to_scalars(metrics: Mapping) -> dict[str, float]:
    """Flatten device/numpy scalars to Python floats (non-finite values become None in JSON)."""
    out = {}
    for key, value in metrics.items():
        arr = np.asarray(value)
        if arr.size != 1:
            continue
        out[key] = float(arr.reshape(()))
    return out


def read_metrics(run_dir: str) -> list[dict]:
    """All rows of ``metrics.jsonl`` (later rows for the same step replace earlier ones, e.g. after a resume)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows: dict[int, dict] = {}
    if not os.path.exists(path):
        return []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


SAMPLE_HEADER = re.compile(r"^===== step (-?\d+): ")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` by ``text`` all at once: a temporary sibling, fsync, ``os.replace``. A kill or a full
    disk leaves either the old file or the new one, never a half-written one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        # mkstemp makes the file 0600; the replaced file keeps the mode any new file of the user's gets.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def keep_metric_lines(lines: list[str], through_step: int) -> list[str]:
    """The rows of ``metrics.jsonl`` with step <= ``through_step``, one per step in step order (the last
    one of a step wins, as in ``read_metrics``); lines that do not parse (the half-written last line of a
    killed run) are dropped."""
    rows: dict[int, str] = {}
    for line in lines:
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if step <= through_step:
            rows[step] = line.rstrip("\n") + "\n"
    return [rows[s] for s in sorted(rows)]


def keep_sample_lines(lines: list[str], through_step: int) -> list[str]:
    """The lines of ``samples.txt`` under a ``===== step s: ...`` header with s <= ``through_step``."""
    kept, keep = [], True
    for line in lines:
        match = SAMPLE_HEADER.match(line)
        if match:
            keep = int(match.group(1)) <= through_step
        if keep:
            kept.append(line)
    return kept


def truncate_run_logs(run_dir: str, through_step: int) -> None:
    """Cut ``metrics.jsonl`` and ``samples.txt`` back to the steps <= ``through_step`` (the step a resumed
    run restarts after; -1 for a run that restarts from scratch), atomically."""
    for name, keep in (("metrics.jsonl", keep_metric_lines), ("samples.txt", keep_sample_lines)):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as f:
            lines = f.readlines()
        kept = keep(lines, through_step)
        if kept != lines:
            write_atomic(path, "".join(kept))


class MetricsWriter:
    """Appends each step's scalars to ``metrics.jsonl`` and TensorBoard, samples to ``samples.txt``.

    ``first_step``: the step this writer writes first. TensorBoard discards the values of steps >=
    ``first_step`` that earlier event files hold (a resumed run repeats the steps after its checkpoint;
    without the purge TensorBoard would draw both versions), as ``truncate_run_logs`` does for the text files.
    """

    def __init__(self, run_dir: str, *, enabled: bool = True, tensorboard: bool = True, first_step: int | None = None):
        self.run_dir = run_dir
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard and SummaryWriter is not None:
            self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=first_step)

    def write(self, step: int, metrics: Mapping) -> dict[str, float]:
        scalars = to_scalars(metrics)
        if not self.enabled:
            return scalars
        row = {"step": int(step), "time": time.time()}
        row.update({k: (v if math.isfinite(v) else None) for k, v in scalars.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in scalars.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, int(step))
        return scalars

    def write_text(self, step: int, title: str, text: str) -> None:
        if not self.enabled:
            return
        with open(os.path.join(self.run_dir, "samples.txt"), "a") as f:
            f.write(f"===== step {step}: {title} =====\n{text}\n\n")
        if self._tb is not None:
            self._tb.add_text(title, text.replace("\n", "  \n"), int(step))

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A one-line progress display: step, rate, ETA and a few key numbers (no-op when disabled)."""

    def __init__(self, total: int, start: int = 0, *, enabled: bool = True, keys: tuple[str, ...] = ()):
        self.total, self.start, self.enabled, self.keys = total, start, enabled, keys
        self._t0 = time.time()

    def update(self, step: int, scalars: Mapping[str, float]) -> str:
        done = step - self.start
        elapsed = time.time() - self._t0
        rate = elapsed / max(done, 1)
        eta = rate * (self.total - step)
        parts = [f"step {step}/{self.total}", f"{rate:.1f}s/step", f"eta {eta / 60:.1f}min"]
        for key in self.keys:
            if key in scalars:
                parts.append(f"{key.split('/')[-1]}={scalars[key]:.3g}")
        line = " | ".join(parts)
        if self.enabled:
            print(line, flush=True)
        return line
