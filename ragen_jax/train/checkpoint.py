"""Checkpoints: everything needed to resume a run exactly, through orbax's CheckpointManager.

A checkpoint holds two items:
    state: any pytree of arrays (actor and critic parameters, optimizer states, RNG key, MI EMA state,
           ...), saved with orbax's StandardSave so it restores with the shardings of a template;
    meta:  a JSON dict (step, env seed counter, early-stop counters, config snapshot, ...).

Orbax writes each step into a temporary directory and renames it only when complete, so a
checkpoint interrupted half-way is never listed and never restored. ``save`` refuses a state with a
NaN or infinity (a run whose numbers went bad must not overwrite good checkpoints with bad ones).

Rotation keeps the newest ``keep`` steps plus one *protected* step (``protect``): the trainer protects
its last known-good checkpoint, so a streak of bad-but-finite checkpoints can never rotate the last
good one out. Old steps are deleted only after a new one is complete, so a failed save (a full disk, a
kill) never costs an existing checkpoint.

``restore_newest`` tries the steps newest first: a checkpoint that fails to restore (a damaged file) is
reported in one line and the one before it is used; ``quarantine`` then moves the damaged ones out of
the checkpoint directory (into ``<directory>_damaged/``) so that the run can save those steps again.

``PreemptionGuard`` turns SIGTERM (TPU preemption, ``kill``) into a flag the training loop polls after
each step: it saves a checkpoint and exits 0.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from ragen_jax.parallel.distributed import nonfinite_leaves


class NonFiniteCheckpointError(ValueError):
    pass


class CheckpointRestoreError(ValueError):
    """No checkpoint of a directory restores; the message is one line naming the steps tried."""


def one_line(e: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message`` (orbax / tensorstore errors run to hundreds of lines)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Checkpointer:
    """Save on demand, keep the newest ``keep`` (plus the protected step), restore the newest that works."""

    def __init__(self, directory: str, *, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.protected: int | None = None
        # Rotation is ours (``_rotate``), not orbax's max_to_keep, so that the protected step survives.
        # cleanup_tmp_directories: a save killed half-way leaves orbax's temporary directory behind.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True, cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def protect(self, step: int | None) -> None:
        """Never rotate ``step`` out (the trainer's last known-good checkpoint); None protects nothing."""
        self.protected = step

    def save(self, step: int, state: Any, meta: dict, *, force: bool = True) -> None:
        bad = nonfinite_leaves(state)
        if bad:
            raise NonFiniteCheckpointError(
                f"refusing to checkpoint step {step}: non-finite values in {', '.join(bad[:5])}"
                + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            )
        self._check_free_space(step)
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )
        self._manager.wait_until_finished()
        self._rotate()

    def _check_free_space(self, step: int) -> None:
        """Refuse a save the disk cannot hold before orbax starts writing it. The newest checkpoint's size
        is the estimate (the first save has none and just tries). A write that fails half-way still
        leaves every earlier checkpoint intact, but orbax then closes its event loop under tensorstore
        writes still in flight, which print tracebacks from their threads that no logging filter sees."""
        steps = self.all_steps()
        if not steps:
            return
        newest = os.path.join(self.directory, str(steps[-1]))
        needed = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(newest) for f in files)
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise OSError(errno.ENOSPC, f"No space left on device: the checkpoint of step {step} needs about "
                                        f"{needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free", self.directory)

    def _rotate(self) -> None:
        steps = self.all_steps()
        for step in steps[: max(len(steps) - self.keep, 0)]:
            if step != self.protected:
                self._manager.delete(step)

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """(state shaped and sharded like ``template``, meta, step); ``step`` defaults to the latest."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
        )
        return restored["state"], dict(restored["meta"]), step

    def read_meta(self, step: int) -> dict:
        """The JSON meta of ``step`` alone (no array is read)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def newest_meta(self) -> tuple[dict, int] | None:
        """(meta, step) of the newest checkpoint whose meta reads, or None."""
        for step in reversed(self.all_steps()):
            try:
                return self.read_meta(step), step
            except Exception:  # a damaged step: restore_newest reports it
                continue
        return None

    def restore_newest(self, template: Any, *, log=None) -> tuple[Any, dict, int, list[int]]:
        """(state, meta, step, damaged steps) of the newest checkpoint that restores with finite values.

        Each one that fails is reported in one line through ``log`` (default: stderr) and the one before
        it is tried. Raises FileNotFoundError when there is no checkpoint and CheckpointRestoreError
        (one line) when none restores. Reads only: ``quarantine`` moves the damaged ones away.
        """
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        damaged: list[int] = []
        for step in reversed(steps):
            try:
                state, meta, _ = self.restore(template, step)
                bad = nonfinite_leaves(state)
                if bad:
                    raise NonFiniteCheckpointError(f"non-finite values in {bad[0]}")
            except Exception as e:  # orbax / tensorstore raise many types for a damaged file
                damaged.append(step)
                older = [s for s in steps if s < step]
                then = f"trying step {older[-1]}" if older else "no older checkpoint"
                log(f"warning: checkpoint step {step} in {self.directory} does not restore ({one_line(e)}); {then}")
                continue
            return state, meta, step, damaged
        raise CheckpointRestoreError(
            f"none of the checkpoints in {self.directory} restores (steps {', '.join(map(str, steps))}); "
            "move the directory away to start the run afresh"
        )

    def quarantine(self, steps: list[int]) -> str | None:
        """Move damaged ``steps`` to ``<directory>_damaged/<step>-<unix time>`` (kept for inspection, out of
        the way of new saves); returns that directory, or None when there was nothing to move."""
        if not steps:
            return None
        target = self.directory.rstrip(os.sep) + "_damaged"
        os.makedirs(target, exist_ok=True)
        for step in steps:
            source = os.path.join(self.directory, str(step))
            if os.path.exists(source):
                shutil.move(source, os.path.join(target, f"{step}-{int(time.time())}"))
        self._manager.reload()
        return target

    def close(self) -> None:
        self._manager.close()


class PreemptionGuard:
    """Sets ``requested`` on SIGTERM instead of dying; restores the previous handler on ``close``."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.requested = False
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
