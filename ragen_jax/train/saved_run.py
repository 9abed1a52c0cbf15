"""Reading a run back: its newest checkpoint as a built run (``load_run``) and its validation
metrics (``evaluate``); ``ragen_jax.api.load_policy`` / ``evaluate`` and the notebooks go through here."""

from __future__ import annotations

import os

from flax import nnx

from ragen_jax.rl.state import TrainState
from ragen_jax.sft.warm_start import load_warm_start
from ragen_jax.train.checkpoint import Checkpointer
from ragen_jax.train.loop import Run, build_run, validate


def load_run(config, run_dir: str) -> tuple[Run, TrainState, int]:
    """(run, state, step): the run built from ``config`` with the newest checkpoint of ``run_dir`` that
    restores (step 0 and the initial state when there is none). A run with checkpoints does not load
    or build the warm start: the checkpoint replaces every parameter, and ``sft.cache_dir`` (relative to
    the working directory) may not point at the run's cache from where the run is read."""
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=config.trainer.keep_checkpoints)
    step = 0
    try:
        has_checkpoint = bool(ckpt.all_steps())
        run, state = build_run(config, warm_start=_as_built if has_checkpoint else load_warm_start)
        if has_checkpoint:
            tree, _, step, _ = ckpt.restore_newest(state.tree())
            state = TrainState.from_tree(tree)
    finally:
        ckpt.close()
    return run, state, step


def _as_built(config, actor: nnx.Module) -> nnx.State:
    """A warm start that keeps the actor's built parameters (a checkpoint restores over them)."""
    return nnx.state(actor)


def evaluate(config, run_dir: str) -> dict[str, float]:
    """Validation rollouts of the latest checkpoint in ``run_dir`` (or of the initial policy when none)."""
    run, state, step = load_run(config, run_dir)
    try:
        metrics = validate(run, state.actor, step)
    finally:
        run.close()
    metrics["checkpoint_step"] = float(step)
    return metrics


__all__ = ["evaluate", "load_run"]
