"""Prefix-reusing cross-scoring against an independent full-sequence reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.diagnostics import cross_scoring
from ragen_jax.diagnostics.cross_scoring import cross_score, naive_cross_score, score_pairs
from ragen_jax.diagnostics.mi import init_mi_ema_state, mi_metrics
from ragen_jax.diagnostics.mi_sampling import sample_trajectory_pairs
from ragen_jax.models.config import get_preset
from ragen_jax.models.transformer import Transformer
from tests._subprocess import device_env

SMALL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model():
    return Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def grid():
    """3 prompts (left padding, a hole) x 5 reasonings (right padding, a hole, a one-token row)."""
    rng = np.random.default_rng(0)
    num_cols, num_rows, prompt_len, reasoning_len = 3, 5, 7, 4
    x = rng.integers(1, 264, (num_cols, prompt_len)).astype(np.int32)
    x_valid = np.ones((num_cols, prompt_len), bool)
    x_valid[0, :3] = False
    x_valid[1, 2] = False
    z = rng.integers(1, 264, (num_rows, reasoning_len)).astype(np.int32)
    z_valid = np.ones((num_rows, reasoning_len), bool)
    z_valid[1, 2:] = False
    z_valid[2, 1] = False
    z_valid[3, 1:] = False
    return x, x_valid, z, z_valid


def reference_scores(model, x, x_valid, z, z_valid, temperature):
    """log p(z_m | x_j) by one plain causal forward over each unpadded [x_j ; z_m], float64 softmax."""
    seqs, spans = [], []
    for m in range(z.shape[0]):
        for j in range(x.shape[0]):
            prompt = [int(t) for t, v in zip(x[j], x_valid[j]) if v]
            reasoning = [int(t) for t, v in zip(z[m], z_valid[m]) if v]
            seqs.append(prompt + reasoning)
            spans.append((len(prompt), len(reasoning)))
    width = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    valid = np.zeros((len(seqs), width), bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
        valid[i, : len(s)] = True  # right padding only: real tokens are contiguous from 0
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(valid))
    logits = np.asarray(logits, np.float64) / temperature
    logits -= logits.max(axis=-1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    sums = np.zeros(len(seqs))
    for i, (s, (start, count)) in enumerate(zip(seqs, spans)):
        sums[i] = sum(log_softmax[i, p - 1, s[p]] for p in range(start, start + count))
    sums = sums.reshape(z.shape[0], x.shape[0])
    counts = np.maximum(z_valid.sum(axis=1), 1)[:, None]
    return sums, sums / counts


def test_prefix_reuse_equals_full_sequence_scoring(model, grid):
    x, x_valid, z, z_valid = grid
    want_sum, want_mean = reference_scores(model, x, x_valid, z, z_valid, temperature=0.7)
    got_sum, got_mean = cross_score(model, x, x_valid, z, z_valid, 0.7)
    naive_sum, naive_mean = naive_cross_score(model, x, x_valid, z, z_valid, 0.7)
    assert got_sum.shape == (5, 3) and got_sum.dtype == jnp.float32
    np.testing.assert_allclose(got_mean, want_mean, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_sum, want_sum, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_sum, naive_sum, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_mean, naive_mean, atol=1e-5, rtol=0)


def test_columns_per_step_does_not_change_results(model, grid):
    x, x_valid, z, z_valid = grid
    one = cross_score(model, x, x_valid, z, z_valid)
    two = cross_score(model, x, x_valid, z, z_valid, columns_per_step=2)  # 3 columns: 2 + remainder
    np.testing.assert_allclose(two[0], one[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(two[1], one[1], atol=1e-5, rtol=0)


def test_traced_once_per_shape_across_parameter_updates_and_temperatures(model, grid):
    x, x_valid, z, z_valid = grid
    local = Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(1))
    cross_score(local, x, x_valid, z, z_valid, 1.0)
    before = cross_scoring.TRACE_COUNTS["cross_score"]
    first = cross_score(local, x, x_valid, z, z_valid, 1.0)
    # An optimizer-style in-place update of the weights, and another temperature: no retrace.
    state = nnx.state(local, nnx.Param)
    nnx.update(local, jax.tree_util.tree_map(lambda p: p * 1.01, state))
    second = cross_score(local, x, x_valid, z, z_valid, 0.5)
    assert cross_scoring.TRACE_COUNTS["cross_score"] == before
    assert not np.allclose(first[0], second[0])
    # A new shape traces once more, and only once.
    cross_score(local, x, x_valid, z[:4], z_valid[:4])
    cross_score(local, x, x_valid, z[:4], z_valid[:4], 0.9)
    assert cross_scoring.TRACE_COUNTS["cross_score"] == before + 1


def test_bad_inputs_raise_clear_errors(model, grid):
    x, x_valid, z, z_valid = grid
    with pytest.raises(ValueError, match=r"\[M, Lz\]"):
        cross_score(model, x, x_valid, z, z_valid[:, :2])
    with pytest.raises(ValueError, match="columns_per_step"):
        cross_score(model, x, x_valid, z, z_valid, columns_per_step=0)


def test_sampled_pairs_scored_and_reduced_end_to_end(model):
    # Two trajectories of two turns; the trajectory strategy draws 4 pairs = 4 columns.
    tokens = np.array(
        [[5, 6, 7, 11, 12, 8, 9, 7, 13, 8, 0, 0], [5, 6, 7, 21, 8, 9, 7, 22, 23, 8, 0, 0]], np.int32
    )
    valid = tokens > 0
    reasoning = np.isin(tokens, [11, 12, 13, 21, 22, 23])
    turn_ids = np.array(
        [[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1]], np.int32
    )
    sample = jax.jit(
        sample_trajectory_pairs, static_argnames=("num_samples", "max_turns", "prompt_len", "reasoning_len")
    )
    pairs = sample(
        jax.random.key(0), tokens, valid, reasoning, turn_ids,
        num_samples=4, max_turns=2, prompt_len=10, reasoning_len=3,
    )
    ema = init_mi_ema_state()["trajectory"]
    metrics, new_ema = score_pairs(model, pairs, ema, 0.9)
    want_sum, want_mean = reference_scores(
        model, np.asarray(pairs.x_tokens), np.asarray(pairs.x_valid),
        np.asarray(pairs.z_tokens), np.asarray(pairs.z_valid), temperature=0.9,
    )
    want = mi_metrics(
        want_sum.astype(np.float32), want_mean.astype(np.float32), pairs.true_col,
        pairs.col_signature, row_valid=pairs.row_valid, col_valid=pairs.col_valid,
    )
    for key in ("mi_estimate", "mi_seq_estimate", "conditional_entropy_seq_est", "marginal_std",
                "retrieval_accuracy", "retrieval_chance_level"):
        assert float(metrics[key]) == pytest.approx(float(want[key]), abs=1e-5), key
    # First update: the EMA is the current std, so the EMA z-score equals the plain one.
    assert float(new_ema.token) == pytest.approx(float(metrics["marginal_std"]), abs=1e-7)
    assert float(metrics["mi_zscore_ema"]) == pytest.approx(float(metrics["mi_zscore"]), rel=1e-5)
    assert float(metrics["num_truncated"]) == 0 and float(metrics["num_columns"]) == 4
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["mi_estimate"]) <= float(metrics["mi_upper_bound"]) + 1e-6


SHARDED_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from flax import nnx
    from jax.sharding import Mesh
    from ragen_jax.diagnostics.cross_scoring import cross_score
    from ragen_jax.models.config import get_preset
    from ragen_jax.models.transformer import Transformer
    assert jax.device_count() == 4, jax.devices()
    model = Transformer(get_preset("tiny", **{small}), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = rng.integers(1, 264, (3, 6)); x_valid = np.ones((3, 6), bool); x_valid[0, :2] = False
    z = rng.integers(1, 264, (6, 4)); z_valid = np.ones((6, 4), bool); z_valid[2, 3:] = False
    single = cross_score(model, x, x_valid, z, z_valid, 0.8)
    devices = np.array(jax.devices())
    for mesh in (Mesh(devices, ("data",)), Mesh(devices.reshape(2, 2), ("data", "fsdp"))):
        for step in (1, 2):  # 6 rows: padded to 8; one or two columns per step of the column loop
            sharded = cross_score(model, x, x_valid, z, z_valid, 0.8, mesh=mesh, columns_per_step=step)
            for a, b in zip(sharded, single):
                assert a.shape == b.shape, (a.shape, b.shape)
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    # With a whole number of rows per device the result stays split over 'data' (no gather).
    eight = cross_score(model, x, x_valid, np.concatenate([z, z[:2]]), np.concatenate([z_valid, z_valid[:2]]),
                        0.8, mesh=Mesh(devices, ("data",)))
    assert not eight[0].sharding.is_fully_replicated, eight[0].sharding
    assert len(eight[0].sharding.device_set) == 4
    np.testing.assert_allclose(np.asarray(eight[0])[:6], np.asarray(single[0]), atol=1e-5, rtol=0)
    print("SHARDED_OK")
    """
)


@pytest.mark.slow  # a fresh process with 4 host devices: about 25 s of CPU for its compiles
def test_sharded_over_data_axis_equals_single_device():
    result = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT.format(small=SMALL)],
        env=device_env(4), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0 and "SHARDED_OK" in result.stdout, result.stderr[-3000:]
