"""Validation metrics (hand-computed) and a small validation run over fixed held-out seeds."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from envs.frozen_lake import FrozenLake
from ragen_jax.models.config import get_preset
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.models.transformer import Transformer
from ragen_jax.rollout.layout import RolloutConfig
from ragen_jax.rollout.trajectories import finalize
from ragen_jax.rollout.validation import run_validation, validation_metrics


def hand_batch():
    """4 episodes (2 seeds x 2 samples), T = 2, L = 4."""
    success = np.array([True, False, False, False])
    active = np.array([[1, 1], [1, 0], [1, 1], [1, 1]], bool)
    ok = np.array([[1, 0], [1, 0], [0, 0], [1, 1]], bool)
    rewards = np.array([[0, 1], [0, 0], [0, 0], [0, 0]], np.float32)
    penalties = np.where(active & ~ok, -0.1, 0.0).astype(np.float32)
    executed = np.array([[1, 2], [1, 0], [0, 0], [2, 2]])
    lengths = np.array([[3, 4], [5, 0], [2, 2], [1, 1]])
    loss = np.ones((4, 4), bool)
    return finalize(
        tokens=np.ones((4, 4)), valid=loss, loss_mask=loss, logprobs=np.zeros((4, 4)), entropy=np.zeros((4, 4)),
        turn_ids=np.zeros((4, 4)), reasoning_mask=np.zeros((4, 4), bool), prompt_spans=np.zeros((4, 2, 2)),
        turn_active=active, turn_rewards=rewards, turn_penalties=penalties, turn_format_ok=ok & active,
        turn_valid_actions=executed, turn_executed=executed, response_lengths=lengths, success=success,
        group_ids=np.array([0, 0, 1, 1]), seeds=np.array([123, 123, 124, 124]), episode_ids=np.arange(4),
        sample_turn=np.full(4, -1), xp=np,
    )


def test_metrics_by_hand():
    m = validation_metrics(hand_batch(), group_size=2)
    assert m["success"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx(0.5)  # seed 123 has a success, seed 124 none
    assert m["num_actions"] == pytest.approx((3 + 1 + 0 + 4) / 4)
    assert m["valid_action_rate"] == pytest.approx(4 / 7)  # 4 format-ok turns of 7 played
    assert m["episode_reward"] == pytest.approx((0.9 + 0.0 - 0.2 + 0.0) / 4)
    assert m["num_turns"] == pytest.approx(7 / 4)
    assert m["response_length"] == pytest.approx(18 / 7)
    with pytest.raises(ValueError, match="groups"):
        validation_metrics(hand_batch(), group_size=3)


def test_validation_run_uses_fixed_seeds_in_chunks():
    cfg = get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    config = RolloutConfig(max_turns=1, max_new_tokens=8, prompt_style="compact", val_greedy=True)
    _, params = nnx.split(model)
    metrics, traj = run_validation(model, CharTokenizer(), FrozenLake(), config, params, jax.random.key(0),
                                   n_seeds=5, group_size=1, seeds_per_batch=2)
    # 5 seeds in 3 chunks of 2 (the last padded, its extra episode dropped), seeds from 123.
    np.testing.assert_array_equal(traj.seeds, 123 + np.arange(5))
    assert metrics["num_episodes"] == 5
    # A random model never answers in format: no success, every turn invalid and penalised.
    assert metrics["success"] == 0 and metrics["pass@1"] == 0 and metrics["valid_action_rate"] == 0
    assert metrics["episode_reward"] == pytest.approx(-0.1)
