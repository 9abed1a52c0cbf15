"""Trajectories bookkeeping: compaction, derived fields, reward placement, reasoning masks, text."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.frozen_lake import FrozenLake
from ragen_jax.rollout.host_envs import parse_response
from ragen_jax.rollout.host_stepped import reasoning_flags
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.rollout.fused import reasoning_mask
from ragen_jax.rollout.layout import compact_rows, pad_right, stop_sequences
from ragen_jax.rollout.trajectories import finalize

TOK = CharTokenizer()


def test_compact_rows_matches_numpy():
    rng = np.random.default_rng(0)
    valid = rng.random((5, 17)) < 0.6
    values = rng.integers(0, 100, (5, 17)).astype(np.int32)
    out, counts = compact_rows(jnp.asarray(valid), jnp.asarray(values))
    for b in range(5):
        kept = values[b][valid[b]]
        assert counts[b] == len(kept)
        np.testing.assert_array_equal(np.asarray(out[b, : len(kept)]), kept)
        assert (np.asarray(out[b, len(kept):]) == 0).all()


def test_pad_right_and_overflow_error():
    tokens, valid = pad_right([[5, 6], [], [7]], 3, 0, "block")
    np.testing.assert_array_equal(tokens, [[5, 6, 0], [0, 0, 0], [7, 0, 0]])
    np.testing.assert_array_equal(valid, [[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match="max_user_tokens"):
        pad_right([[1, 2, 3, 4]], 3, 0, "block")


def two_row_batch():
    """Two rows, L = 8, T = 2. Row 0: prompt(2) resp(2) prompt(1) resp(1), rewards 1.0 + 0.5 - 0.1;
    row 1: one turn, a format penalty of -0.1. Numpy arrays (finalize's host form)."""
    loss = np.array([[0, 0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]], bool)
    valid = np.array([[1] * 6 + [0, 0], [1] * 4 + [0] * 4], bool)
    turn_rewards = np.array([[1.0, 0.5], [0.0, 0.0]], np.float32)
    penalties = np.array([[0.0, -0.1], [-0.1, 0.0]], np.float32)
    active = np.array([[1, 1], [1, 0]], bool)
    return finalize(
        tokens=np.arange(16).reshape(2, 8), valid=valid, loss_mask=loss, logprobs=np.zeros((2, 8)),
        entropy=np.zeros((2, 8)), turn_ids=np.array([[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8]),
        reasoning_mask=np.zeros((2, 8), bool), prompt_spans=np.zeros((2, 2, 2)), turn_active=active,
        turn_rewards=turn_rewards, turn_penalties=penalties, turn_format_ok=active & (penalties == 0),
        turn_valid_actions=np.array([[2, 0], [0, 0]]), turn_executed=np.array([[1, 0], [0, 0]]),
        response_lengths=np.array([[2, 1], [3, 0]]), success=np.array([True, False]), group_ids=np.array([0, 0]),
        seeds=np.array([5, 5]), episode_ids=np.array([0, 1]), sample_turn=np.array([-1, -1]), xp=np,
    )


def test_finalize_reward_placement_and_summaries():
    t = two_row_batch()
    np.testing.assert_allclose(t.episode_reward, [1.4, -0.1], atol=1e-6)
    np.testing.assert_array_equal(t.last_token, [5, 3])
    expected = np.zeros((2, 8), np.float32)
    expected[0, 5], expected[1, 3] = 1.4, -0.1
    np.testing.assert_allclose(t.reward_tokens, expected, atol=1e-6)
    np.testing.assert_array_equal(t.lengths, [6, 4])
    np.testing.assert_array_equal(t.num_turns, [2, 1])
    np.testing.assert_array_equal(t.num_actions, [1, 0])
    np.testing.assert_array_equal(t.num_valid_actions, [2, 0])
    np.testing.assert_array_equal(t.turn_ids[0], [0, 0, 0, 0, 1, 1, -1, -1])  # -1 on padding


WIDTH = 40
_LAYER = FrozenLake().text_layer(TOK)
_device_reasoning = jax.jit(lambda tokens, length: reasoning_mask(_LAYER, tokens, length))


@pytest.mark.parametrize("text, reasoning", [
    ("abc</think><answer>Up</answer>", "abc"),
    ("</think>x", ""),
    ("no close at all", None),
    ("x<think>y</think>z</think>", "x<think>y"),
])
def test_reasoning_mask_device_and_host(text, reasoning):
    for spelled in (TOK.encode(text), [8 + b for b in text.encode()]):  # special tokens or raw bytes
        tokens = np.zeros((WIDTH,), np.int32)
        tokens[: len(spelled)] = spelled
        device = np.asarray(_device_reasoning(jnp.asarray(tokens), jnp.int32(len(spelled))))
        host = reasoning_flags(TOK, spelled)
        np.testing.assert_array_equal(device[: len(spelled)], host)
        assert not device[len(spelled):].any()
        if reasoning is None:
            assert not host.any()
        else:
            assert TOK.decode([t for t, m in zip(spelled, host) if m]) == reasoning


def test_stop_sequences_include_both_forms():
    forms = stop_sequences(TOK)
    assert (TOK.special_id("</answer>"),) in forms
    assert tuple(8 + b for b in b"</answer>") in forms


@pytest.mark.parametrize("text, matched, pieces", [
    ("x</think><answer>Up || left||  </answer>tail", True, ("Up", "left")),
    ("x</think> \n <answer>a||b||c</answer>", True, ("a", "b")),
    ("x</think>oops<answer>Up</answer>", False, ()),
    ("</think><answer><|im_end|>Up</answer>", True, ("Up",)),
    ("<answer>Up</answer>", False, ()),
])
def test_python_parse_follows_ragen(text, matched, pieces):
    parsed = parse_response(text, 2)
    assert parsed.matched == matched and parsed.pieces == pieces


@pytest.mark.parametrize("window", [12, 13])
def test_answer_window_mirror_matches_device_parse(window):
    """The host adapter mirrors the device parse's answer-window knob: "Up || Down || Left" (18 bytes)
    read through 12 bytes ("Up || Down |") has one closed piece (< K = 2: an invalid turn), through 13 bytes two."""
    from ragen_jax.rollout.host_envs import TextEnvHost

    layer = FrozenLake().text_layer(TOK, answer_window=window, bytes_per_token=None)
    text = "x</think><answer>Up || Down || Left</answer>"
    tokens = np.zeros((WIDTH + 8,), np.int32)
    spelled = TOK.encode(text)
    tokens[: len(spelled)] = spelled
    device = jax.jit(layer.parse)(jnp.asarray(tokens), jnp.int32(len(spelled)))
    host, n_valid = TextEnvHost(layer)._parsed(parse_response(text, 2, window))
    assert int(device.n_valid) == n_valid == (2 if window == 13 else 0)
    assert bool(device.format_ok) == bool(host.format_ok)
    np.testing.assert_array_equal(np.asarray(device.actions), np.asarray(host.actions))
