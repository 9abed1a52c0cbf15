"""Checkpoints: everything needed to resume a run exactly, through orbax's CheckpointManager.

A checkpoint holds two items:
    state: any pytree of arrays (actor and critic parameters, optimizer states, RNG key, MI EMA state,
           ...), saved with orbax's StandardSave so it restores with the shardings of a template;
    meta:  a JSON dict (step, env seed counter, early-stop counters, config snapshot, ...).

Orbax writes each step into a temporary directory and renames it only when complete, so a
checkpoint interrupted half-way is never listed and never restored. ``save`` refuses a state with a
NaN or infinity (a run whose numbers went bad must not overwrite good checkpoints with bad ones).

``PreemptionGuard`` turns SIGTERM (TPU preemption, ``kill``) into a flag the training loop polls after
each step: it saves a checkpoint and exits 0.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp

from ragen_jax.parallel.distributed import nonfinite_leaves


class NonFiniteCheckpointError(ValueError):
    pass


class Checkpointer:
    """Save every ``every`` steps (and on demand), keep the last ``keep``, restore the latest."""

    def __init__(self, directory: str, *, keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict, *, force: bool = True) -> None:
        bad = nonfinite_leaves(state)
        if bad:
            raise NonFiniteCheckpointError(
                f"refusing to checkpoint step {step}: non-finite values in {', '.join(bad[:5])}"
                + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            )
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )
        self._manager.wait_until_finished()

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
