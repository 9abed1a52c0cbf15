"""The episode reward the update learns from (``algorithm.train_reward``).

``"env"`` (the default): the environment's reward, as the rollout computed it.

``"coin"``: a fair coin per episode, 0 or 1, drawn from the step's key and independent of the prompt,
the response and the environment. It is the control for RAGEN-2's template collapse (paper, Sec. 3 and
fig. 7): the task gradient then carries no information about the input, and only the input-agnostic
terms of the loss (the entropy bonus, a KL anchor) push the policy in a consistent direction, which is
the low-SNR regime in which the paper says the reasoning stops depending on the input. What reports
the task stays the environment's (``train/success``, ``train/episode_reward``, validation); the filter,
its group statistics (``rollout/in_group_reward_*``, ``filter/*``) and the advantages see the coin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ragen_jax.rollout.trajectories import Trajectories

TRAIN_REWARDS = ("env", "coin")


def coin_rewards(traj: Trajectories, key: jax.Array) -> Trajectories:
    """``traj`` with each row's episode reward replaced by an independent Bernoulli(0.5) draw (f32 0 / 1)."""
    coin = jax.random.bernoulli(key, 0.5, (traj.num_rows,)).astype(jnp.float32)
    return traj.with_episode_reward(coin)


def train_reward(traj: Trajectories, update_key: jax.Array, source: str) -> Trajectories:
    """The batch the update learns from: ``traj`` itself for ``"env"``, its coin version for ``"coin"``.

    update_key: the step's update key. The coin's key is folded from it here, so the update's own draws
    are those of a run with the env's reward, and a run with the env's reward does no extra work."""
    if source == "env":
        return traj
    if source == "coin":
        return coin_rewards(traj, jax.random.fold_in(update_key, 1))
    raise ValueError(f"algorithm.train_reward must be one of {TRAIN_REWARDS}, got {source!r}")
