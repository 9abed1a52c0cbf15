"""Blockwise causal attention against the exact attention, forward and gradients; and its memory.

The reference is the masked softmax attention computed in float64 with numpy. The tolerances are
float32 rounding bounds (tests/_tolerance.py) carried through the formulas of the module docstring:
a score is a D-term dot, a probability's relative error is the score's absolute error plus the
T-term normaliser's and exp's rounding, and every output is a T-term sum over the probabilities.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models.attention import (causal_attention, masked_attention, prefix_attention,
                                        segment_block_bounds)
from ragen_jax.models.config import get_preset
from ragen_jax.models.transformer import Transformer
from tests._tolerance import UNIT_ROUNDOFF, gamma, logit_tolerance


def _inputs(b, k, g, t, d, seed, hole_rate=0.3):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, k, g, t, d)).astype(np.float32)
    keys = rng.normal(size=(b, k, t, d)).astype(np.float32)
    values = rng.normal(size=(b, k, t, d)).astype(np.float32)
    valid = rng.random((b, t)) > hole_rate
    valid[0, :3] = False  # left padding: queries that see no valid key
    valid[:, -1] = True
    d_out = rng.normal(size=(b, k, g, t, d)).astype(np.float32) * valid[:, None, None, :, None]
    return q, keys, values, valid, d_out


def _exact(q, k, v, valid, d_out, segments=None):
    """float64 forward and backward of causal masked attention (within each segment when given), and the
    bounds on a float32 evaluation."""
    q, k, v, d_out = (x.astype(np.float64) for x in (q, k, v, d_out))
    t, d = q.shape[3], q.shape[4]
    mask = np.tril(np.ones((t, t), bool))[None] & valid[:, None, :]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    scale = 1 / np.sqrt(d)
    s = np.einsum("bkgtd,bksd->bkgts", q, k) * scale
    s = np.where(mask[:, None, None], s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bkgts,bksd->bkgtd", p, v)
    dv = np.einsum("bkgts,bkgtd->bksd", p, d_out)
    dp = np.einsum("bkgtd,bksd->bkgts", d_out, v)
    delta = np.sum(d_out * out, -1)
    ds = p * (dp - delta[..., None]) * scale
    dq = np.einsum("bkgts,bksd->bkgtd", ds, k)
    dk = np.einsum("bkgts,bkgtd->bksd", ds, q)

    # |error of p| / p: the score's dot product (D terms) plus the normaliser (T terms) and exp.
    score_err = gamma(d) * np.einsum("bkgtd,bksd->bkgts", np.abs(q), np.abs(k)) * scale
    rel_p = 2 * score_err.max() + 2 * gamma(t) + 8 * UNIT_ROUNDOFF
    abs_v, abs_do = np.abs(v), np.abs(d_out)
    tol_out = (rel_p + gamma(t)) * np.einsum("bkgts,bksd->bkgtd", p, abs_v)
    tol_dv = (rel_p + gamma(t)) * np.einsum("bkgts,bkgtd->bksd", p, abs_do)
    # ds = p (dp - delta): the error of p times |dp - delta|, plus p times the errors of the D-term dot dp
    # and of delta (a D-term dot of d_out with out, whose own error is tol_out).
    dp_err = gamma(d) * np.einsum("bkgtd,bksd->bkgts", abs_do, abs_v)
    delta_err = gamma(d) * np.sum(abs_do * np.abs(out), -1) + np.sum(abs_do * tol_out, -1)
    ds_err = (rel_p * np.abs(dp - delta[..., None]) + dp_err + delta_err[..., None]) * p * scale
    tol_dq = np.einsum("bkgts,bksd->bkgtd", ds_err, np.abs(k)) + gamma(t) * np.einsum(
        "bkgts,bksd->bkgtd", np.abs(ds), np.abs(k))
    tol_dk = np.einsum("bkgts,bkgtd->bksd", ds_err, np.abs(q)) + gamma(t) * np.einsum(
        "bkgts,bkgtd->bksd", np.abs(ds), np.abs(q))
    return (out, dq, dk, dv), (tol_out, tol_dq, tol_dk, tol_dv)


@pytest.mark.parametrize("t, block", [(37, 8), (37, 16), (32, 8), (12, 64), (37, 1)])
def test_blockwise_attention_and_its_gradients_equal_the_exact_attention(t, block):
    q, k, v, valid, d_out = _inputs(b=2, k=2, g=2, t=t, d=16, seed=t + block)

    def loss(q, k, v):
        return jnp.sum(causal_attention(q, k, v, jnp.asarray(valid), block) * d_out)

    out = jax.jit(causal_attention, static_argnums=4)(q, k, v, jnp.asarray(valid), block)
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    (e_out, e_dq, e_dk, e_dv), (t_out, t_dq, t_dk, t_dv) = _exact(q, k, v, valid, d_out)
    seen = valid[:, None, None, :, None] & (np.cumsum(valid, 1) > 0)[:, None, None, :, None]
    # A query before the row's first valid token sees no key; its output is padding and not compared.
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - e_out) * seen, t_out + 1e-30)
    for got, want, tol in zip(grads, (e_dq, e_dk, e_dv), (t_dq, t_dk, t_dv)):
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), tol + 1e-30)


def _packed_segments(b, t, seed):
    """int32[B, T]: each row a few contiguous runs of ids 1, 2, ... of random lengths (boundaries differ
    between rows), then a run of 0 (padding) to the end of some rows."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=3, replace=False))
        end = t if row % 2 else cuts[-1]
        for i, (lo, hi) in enumerate(zip(np.r_[0, cuts[:-1]], np.r_[cuts[:-1], end])):
            segments[row, lo:hi] = i + 1
    return segments


@pytest.mark.parametrize("t, block", [(61, 8), (64, 16), (50, 64)])
def test_packed_blockwise_attention_and_its_gradients_equal_the_exact_attention(t, block):
    """Sequences packed side by side: each query sees only its own run, and the blocks the loops skip
    (no row's runs share them) change nothing."""
    q, k, v, valid, d_out = _inputs(b=3, k=2, g=2, t=t, d=16, seed=t + block, hole_rate=0.1)
    segments = _packed_segments(3, t, seed=t)
    valid = valid & (segments > 0)
    starts = np.concatenate([np.ones((3, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    valid[starts & (segments > 0)] = True  # every run's first query sees a key
    d_out = d_out * valid[:, None, None, :, None]

    def loss(q, k, v):
        return jnp.sum(causal_attention(q, k, v, jnp.asarray(valid), block, jnp.asarray(segments)) * d_out)

    out = jax.jit(causal_attention, static_argnums=4)(q, k, v, jnp.asarray(valid), block, jnp.asarray(segments))
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    (e_out, e_dq, e_dk, e_dv), (t_out, t_dq, t_dk, t_dv) = _exact(q, k, v, valid, d_out, segments)
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - e_out) * valid[:, None, None, :, None],
                                 t_out + 1e-30)
    for got, want, tol in zip(grads, (e_dq, e_dk, e_dv), (t_dq, t_dk, t_dv)):
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), tol + 1e-30)


def test_the_block_loops_skip_only_blocks_no_row_shares():
    # block 4; row 0: runs [0, 6) [6, 13) [13, 16); row 1: runs [0, 9) [9, 16)
    segments = np.array([[1] * 6 + [2] * 7 + [3] * 3, [1] * 9 + [2] * 7], np.int32)
    first_key_block, end_query_block = segment_block_bounds(jnp.asarray(segments), 4)
    # query blocks start at positions 0, 4, 8, 12: their runs start at min(0, 0), min(0, 0), min(6, 0), min(6, 9)
    np.testing.assert_array_equal(first_key_block, [0, 0, 0, 1])
    # key blocks end at positions 3, 7, 11, 15: their runs end at max(5, 8), max(12, 8), max(12, 15), max(15, 15)
    np.testing.assert_array_equal(end_query_block, [3, 4, 4, 4])


@pytest.mark.parametrize("width, end, t, block", [(40, 17, 1, 8), (40, 17, 5, 16), (37, 30, 7, 16), (37, 0, 4, 64),
                                                  (64, 60, 1, 8), (64, 5, 1, 8)])
def test_prefix_attention_equals_the_exact_attention_over_the_filled_slots(width, end, t, block):
    """T queries at slots end..end+T-1 of a W-slot buffer whose slots past end + T hold garbage: the
    blockwise walk up to end + T equals exact attention over the valid slots at or before each query."""
    rng = np.random.default_rng(width + end + t + block)
    b, kv, g, d = 3, 2, 2, 8
    q = rng.normal(size=(b, kv, g, t, d)).astype(np.float32)
    k = rng.normal(size=(b, kv, width, d)).astype(np.float32)
    v = rng.normal(size=(b, kv, width, d)).astype(np.float32)
    slot_valid = rng.random((b, width)) > 0.3
    slot_valid[:, end:end + t] = True  # each query's own slot
    slot_valid[0, end + t:] = True  # garbage past the filled length must stay unseen
    query_slot = end + np.arange(t)
    got = prefix_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slot_valid),
                           jnp.asarray(query_slot), jnp.asarray(end + t, jnp.int32), block)
    seen = (np.arange(width)[None, :] <= query_slot[:, None])[None] & slot_valid[:, None, :]  # [B, T, W]
    s = np.einsum("bkgtd,bksd->bkgts", q.astype(np.float64), k) / np.sqrt(d)
    s = np.where(seen[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bkgts,bksd->bkgtd", p, v)
    score_err = gamma(d) * np.einsum("bkgtd,bksd->bkgts", np.abs(q), np.abs(k)).max() / np.sqrt(d)
    tol = (2 * score_err + 3 * gamma(width) + 8 * UNIT_ROUNDOFF) * np.einsum("bkgts,bksd->bkgtd", p, np.abs(v))
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), tol + 1e-30)


def test_padding_keys_get_exactly_zero_gradient():
    q, k, v, valid, d_out = _inputs(b=2, k=1, g=3, t=29, d=8, seed=3)
    grads = jax.grad(lambda k, v: jnp.sum(causal_attention(q, k, v, jnp.asarray(valid), 8) * d_out), (0, 1))(k, v)
    for g in grads:
        np.testing.assert_array_equal(np.asarray(g)[~valid[:, None, :, None].repeat(g.shape[1], 1).squeeze(-1)], 0.0)


def test_masked_attention_is_the_same_formula():
    q, k, v, valid, _ = _inputs(b=1, k=2, g=2, t=20, d=8, seed=5)
    mask = np.tril(np.ones((20, 20), bool))[None] & valid[:, None, :]
    got = np.asarray(masked_attention(q, k, v, jnp.asarray(mask)), np.float64)
    (want, *_), (tol, *_) = _exact(q, k, v, valid, np.zeros_like(q))
    seen = (np.cumsum(valid, 1) > 0)[:, None, None, :, None] & valid[:, None, None, :, None]
    np.testing.assert_array_less(np.abs(got - want) * seen, tol + 1e-30)


def test_the_backward_pass_keeps_no_score_matrix():
    """Compiled gradient of a 1,024-token sequence: the blockwise program's temp memory is a small
    fraction of one f32[B, H, T, T] score tensor, while the masked program needs several of them."""
    b, kv, g, t, d = 1, 2, 2, 1024, 32
    q = jax.ShapeDtypeStruct((b, kv, g, t, d), jnp.float32)
    kvs = jax.ShapeDtypeStruct((b, kv, t, d), jnp.float32)
    valid = jax.ShapeDtypeStruct((b, t), jnp.bool_)
    mask = jnp.tril(jnp.ones((t, t), bool))[None]

    def temp_bytes(attend):
        grad = jax.grad(lambda q, k, v, valid: jnp.sum(attend(q, k, v, valid)), (0, 1, 2))
        return jax.jit(grad).lower(q, kvs, kvs, valid).compile().memory_analysis().temp_size_in_bytes

    scores_bytes = b * kv * g * t * t * 4
    blockwise = temp_bytes(lambda q, k, v, valid: causal_attention(q, k, v, valid, 128))
    masked = temp_bytes(lambda q, k, v, valid: masked_attention(q, k, v, mask & valid[:, None, :]))
    assert masked >= 2 * scores_bytes
    assert blockwise < scores_bytes / 4


def test_the_model_gives_the_same_logits_with_and_without_blocks():
    cfg = dataclasses.replace(get_preset("tiny"), num_layers=2, attention_block=8)
    blocked = Transformer(cfg, rngs=nnx.Rngs(0))
    unblocked = Transformer(dataclasses.replace(cfg, attention_block=0), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 45)), jnp.int32)
    valid = rng.random((3, 45)) > 0.2
    valid[:, 0] = True
    got, _ = blocked(tokens, jnp.asarray(valid))
    want, _ = unblocked(tokens, jnp.asarray(valid))
    want = np.asarray(want)
    longest = max(cfg.intermediate_size, cfg.hidden_size, tokens.shape[1])
    tol = logit_tolerance(want, longest, depth=2 * cfg.num_layers + 1)
    err = np.max(np.abs(np.asarray(got) - want), axis=-1)
    assert np.all(err[valid] <= tol[valid]), float(np.max(err[valid] - tol[valid]))


def test_a_negative_block_is_refused():
    with pytest.raises(ValueError, match="attention_block"):
        dataclasses.replace(get_preset("tiny"), attention_block=-1)
