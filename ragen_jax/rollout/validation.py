"""Validation rollouts (RAGEN ``ragen/trainer/agent_trainer.py::_validate``): a fixed set of held-out seeds, greedy or temperature 0.5.

RAGEN validates on 512 groups x 1 sample, seeds 123, 124, ..., with sampling at temperature 0.5, every
``test_freq`` steps and before training. ``run_validation`` runs ``n_seeds`` seeds x ``group_size``
samples in chunks of ``seeds_per_batch`` seeds through one compiled rollout (the last chunk is padded
with extra seeds whose episodes are dropped), and reports ``validation_metrics``.

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


def validation_metrics(traj: Trajectories, group_size: int) -> dict[str, float]:
    """The metrics above from one (or concatenated) full-history Trajectories; rows grouped by
    ``group_size`` consecutive rows per seed."""
    t = traj.to_numpy()
    rows = t.success.shape[0]
    if rows % group_size:
        raise ValueError(f"{rows} rows are not a whole number of groups of {group_size}")
    success = t.success.astype(np.float64)
    played = t.turn_active.sum()
    return {
        "success": float(success.mean()),
        f"pass@{group_size}": float(success.reshape(-1, group_size).max(axis=1).mean()),
        "num_actions": float(t.num_actions.mean()),
        "valid_action_rate": float(t.turn_format_ok.sum() / max(played, 1)),
        "episode_reward": float(t.episode_reward.mean()),
        "num_turns": float(t.num_turns.mean()),
        "response_length": float(t.response_lengths.sum() / max(played, 1)),
        "num_episodes": float(rows),
    }


def concat(trajs: list[Trajectories]) -> Trajectories:
    """Row-wise concatenation of numpy Trajectories (same static shapes)."""
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *[t.to_numpy() for t in trajs])


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
    seeds = config.val_seed + np.arange(n_seeds, dtype=np.int32)
    n_chunks = -(-n_seeds // per_batch)
    padded = np.concatenate([seeds, seeds[-1] + 1 + np.arange(n_chunks * per_batch - n_seeds, dtype=np.int32)])
    parts = []
    for c in range(n_chunks):
        chunk_key = jax.random.fold_in(key, c)
        traj = rollout.run(params, chunk_key, padded[c * per_batch:(c + 1) * per_batch], temperature, greedy=greedy)
        parts.append(traj.to_numpy())
    trajs = concat(parts)
    trajs = jax.tree.map(lambda x: x[: n_seeds * group_size], trajs)
    return validation_metrics(trajs, group_size), trajs
