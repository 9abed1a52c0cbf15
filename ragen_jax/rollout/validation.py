"""Validation rollouts (RAGEN ``ragen/trainer/agent_trainer.py::_validate``): a fixed set of held-out seeds, greedy or temperature 0.5.

RAGEN validates on 512 groups x 1 sample, seeds 123, 124, ..., with sampling at temperature 0.5, every
``test_freq`` steps and before training. ``run_validation`` runs ``n_seeds`` seeds x ``group_size``
samples in chunks of ``seeds_per_batch`` seeds through one compiled rollout (``validation_rollouts``, which
the training loop's validation uses too; the last chunk is padded with extra seeds whose episodes are
dropped), and reports ``validation_metrics``. ``episode_metrics`` is the one definition of the
per-episode means, reported by training rollouts as ``train/*`` and by validation as ``val/*``.

Metrics (over episodes unless stated):
  success             = mean(success)                               (RAGEN val-env/<tag>/success)
  pass@k              = mean over seeds of any(success among its k samples), k = group_size
  num_actions         = mean actions executed per episode
  valid_action_rate   = sum(format_ok turns) / sum(played turns)   (RAGEN action_is_valid, per turn)
  episode_reward      = mean(sum of turn rewards + format penalties)
  num_turns, response_length = mean played turns / mean generated tokens per turn played
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.trajectories import Trajectories


def episode_metrics(traj: Trajectories) -> dict[str, float]:
    """The per-episode means a rollout reports, in training (``train/*``) and validation (``val/*``) alike:
    success, episode_reward, num_actions, num_turns over episodes; valid_action_rate = format_ok turns /
    played turns; response_length = generated tokens per played turn."""
    t = traj.to_numpy()
    played = max(int(t.turn_active.sum()), 1)
    return {
        "success": float(t.success.mean()),
        "episode_reward": float(t.episode_reward.mean()),
        "num_actions": float(t.num_actions.mean()),
        "valid_action_rate": float((t.turn_format_ok & t.turn_active).sum() / played),
        "num_turns": float(t.num_turns.mean()),
        "response_length": float(t.response_lengths.sum() / played),
    }


def validation_metrics(traj: Trajectories, group_size: int) -> dict[str, float]:
    """The metrics above from one (or concatenated) full-history Trajectories; rows grouped by
    ``group_size`` consecutive rows per seed."""
    t = traj.to_numpy()
    rows = t.success.shape[0]
    if rows % group_size:
        raise ValueError(f"{rows} rows are not a whole number of groups of {group_size}")
    success = t.success.astype(np.float64)
    return {
        **episode_metrics(t),
        f"pass@{group_size}": float(success.reshape(-1, group_size).max(axis=1).mean()),
        "num_episodes": float(rows),
    }


def concat(trajs: list[Trajectories]) -> Trajectories:
    """Row-wise concatenation of numpy Trajectories (same static shapes)."""
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *[t.to_numpy() for t in trajs])


def validation_rollouts(rollout: Any, params: Any, key: jax.Array, n_seeds: int, temperature: float,
                        greedy: bool) -> Trajectories:
    """The (numpy) episodes of seeds ``val_seed + i``, i < n_seeds, x ``group_size`` samples each, through one
    compiled rollout of ``n_groups`` seeds per call (``rollout.config``): chunk c runs with key
    ``fold_in(key, c)``; the last chunk is padded with the seeds after them, whose episodes are dropped."""
    cfg = rollout.config
    per_batch = cfg.n_groups
    seeds = cfg.val_seed + np.arange(-(-n_seeds // per_batch) * per_batch, dtype=np.int32)
    parts = [
        rollout.run(params, jax.random.fold_in(key, c), chunk, temperature, greedy=greedy).to_numpy()
        for c, chunk in enumerate(np.split(seeds, len(seeds) // per_batch))
    ]
    return jax.tree.map(lambda x: x[: n_seeds * cfg.group_size], concat(parts))


def run_validation(
    model: Any,
    tokenizer: Any,
    env: Any,
    config: Any,
    params: Any,
    key: jax.Array,
    *,
    n_seeds: int = 512,
    group_size: int = 1,
    seeds_per_batch: int = 64,
    greedy: bool | None = None,
    temperature: float | None = None,
    env_params: Any = None,
) -> tuple[dict[str, float], Trajectories]:
    """Validate ``params`` on seeds ``config.val_seed + i`` for i < n_seeds (RAGEN: 512 x 1 from 123).

    greedy / temperature default to ``config.val_greedy`` / ``config.val_temperature``. Returns the
    metrics and the (numpy) trajectories of the n_seeds x group_size episodes.
    """
    if n_seeds < 1 or group_size < 1:
        raise ValueError(f"n_seeds and group_size must be >= 1, got {n_seeds}, {group_size}")
    greedy = config.val_greedy if greedy is None else greedy
    temperature = config.val_temperature if temperature is None else temperature
    per_batch = min(seeds_per_batch, n_seeds)
    val_config = dataclasses.replace(config, n_groups=per_batch, group_size=group_size)
    rollout = Rollout(model, tokenizer, env, val_config, env_params=env_params)
    trajs = validation_rollouts(rollout, params, key, n_seeds, temperature, greedy)
    return validation_metrics(trajs, group_size), trajs
