"""algorithm.train_reward: the coin replaces what the update learns from and nothing the task reports."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ragen_jax.rl.train_reward import coin_rewards, train_reward
from tests.test_trajectories import two_row_batch


def test_the_coin_replaces_the_episode_reward_where_finalize_puts_it():
    traj = two_row_batch()
    coin = coin_rewards(traj, jax.random.key(3))
    rewards = np.asarray(coin.episode_reward)
    assert set(rewards.tolist()) <= {0.0, 1.0}
    expected = np.zeros((2, 8), np.float32)
    expected[0, 5], expected[1, 3] = rewards  # each row's last generated token (finalize's rule)
    np.testing.assert_array_equal(np.asarray(coin.reward_tokens), expected)
    # What reports the task is the env's.
    for name in ("success", "turn_rewards", "turn_penalties", "tokens", "loss_mask", "last_token"):
        np.testing.assert_array_equal(np.asarray(getattr(coin, name)), np.asarray(getattr(traj, name)))


def test_the_coin_is_fair_independent_of_the_batch_and_fixed_by_the_key():
    traj = two_row_batch()
    draws = np.array([np.asarray(coin_rewards(traj, jax.random.key(k)).episode_reward) for k in range(400)])
    # 800 fair draws: the mean is 0.5 within 4 standard errors (0.5 / sqrt(800) = 0.018).
    assert abs(draws.mean() - 0.5) < 4 * 0.5 / np.sqrt(draws.size)
    # The two rows differ in reward (1.4 vs -0.1) yet draw the same distribution: 1 in about half the keys each.
    assert abs(draws[:, 0].mean() - draws[:, 1].mean()) < 4 * np.sqrt(2 * 0.25 / 400)
    np.testing.assert_array_equal(np.asarray(coin_rewards(traj, jax.random.key(7)).episode_reward),
                                  np.asarray(coin_rewards(traj, jax.random.key(7)).episode_reward))


def test_env_keeps_the_batch_and_an_unknown_source_is_one_line():
    traj = two_row_batch()
    assert train_reward(traj, jax.random.key(0), "env") is traj
    with pytest.raises(ValueError, match="train_reward must be one of"):
        train_reward(traj, jax.random.key(0), "random")
