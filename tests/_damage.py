"""Damaging a checkpoint on purpose, as a half-written disk or a bad copy would."""

from __future__ import annotations

import glob
import os


def truncate_checkpoint(run_dir, step: int) -> None:
    """Truncate every array data file of ``run_dir``'s checkpoint ``step`` to half its size."""
    files = [f for f in glob.glob(os.path.join(str(run_dir), "checkpoints", str(step), "state", "**", "d", "*"),
                                  recursive=True) if os.path.isfile(f)]
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
