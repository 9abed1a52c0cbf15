"""Advantage estimators against plain-Python ports of verl / RAGEN loops and hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.rl import advantages as A


# ---------------------------------------------------------------- independent references (numpy / Python)
def ref_whiten(x, mask):
    m = mask.astype(np.float64)
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n * n / (n - 1)
    return np.where(mask, (x - mean) / np.sqrt(var + 1e-8), 0.0)


def ref_gae(rewards, values, mask, gamma, lam):
    """verl compute_gae_advantage_return, literally, per row in float64."""
    b, length = rewards.shape
    adv = np.zeros((b, length))
    for i in range(b):
        next_value, last = 0.0, 0.0
        for t in reversed(range(length)):
            delta = rewards[i, t] + gamma * next_value - values[i, t]
            new = delta + gamma * lam * last
            if mask[i, t]:
                next_value, last = values[i, t], new
            adv[i, t] = last
    returns = np.where(mask, adv + values, 0.0)
    return np.where(mask, adv, 0.0), returns


def ref_bilevel(rewards, values, mask, ends, gamma, lam, g_hi):
    """RAGEN compute_bi_level_gae_advantage_return, with explicit turn ends, in float64."""
    b, length = rewards.shape
    adv = np.zeros((b, length))
    returns = np.zeros((b, length))
    for i in range(b):
        upd = rewards[i].astype(np.float64).copy()
        eos = [t for t in range(length) if ends[i, t]]
        last = 0.0
        for k in range(len(eos) - 1, -1, -1):
            nv = values[i, eos[k + 1]] if k < len(eos) - 1 else 0.0
            last = upd[eos[k]] + g_hi * nv - values[i, eos[k]] + g_hi * lam * last
            adv[i, eos[k]] = last
        for t in eos:
            upd[t] = adv[i, t] + values[i, t]
        valid = [t for t in range(length) if mask[i, t]]
        last = 0.0
        for j in range(len(valid) - 1, -1, -1):
            t = valid[j]
            if t in eos:
                nv, last = 0.0, 0.0
            else:
                nv = values[i, valid[j + 1]]
            last = upd[t] + gamma * nv - values[i, t] + gamma * lam * last
            adv[i, t] = last
            returns[i, t] = last + values[i, t]
    return adv, returns


def random_batch(rng, b=4, length=12):
    mask = rng.random((b, length)) < 0.6
    mask[:, 0] = True
    rewards = np.where(rng.random((b, length)) < 0.3, rng.normal(size=(b, length)), 0.0)
    values = rng.normal(size=(b, length))
    return rewards.astype(np.float32), values.astype(np.float32), mask


# ---------------------------------------------------------------- GAE
def test_gae_matches_verl_loop():
    rng = np.random.default_rng(0)
    traces = {"n": 0}

    def fn(r, v, m, gamma, lam):
        traces["n"] += 1
        return A.gae_advantages(r, v, m, gamma, lam, whiten=False)

    fn = jax.jit(fn)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)]:
        r, v, m = random_batch(rng)
        adv, ret = fn(r, v, m, gamma, lam)
        want_adv, want_ret = ref_gae(r.astype(np.float64), v.astype(np.float64), m, gamma, lam)
        np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
        white, _ = A.gae_advantages(r, v, m, gamma, lam, whiten=True)
        np.testing.assert_allclose(white, ref_whiten(want_adv, m), rtol=1e-4, atol=1e-5)
    assert traces["n"] == 1  # gamma / lam are traced, not static


def test_gae_monte_carlo_case_by_hand():
    # gamma = lam = 1, episode reward R on the last assistant token: A_t = R - V_t, return_t = R,
    # observation tokens (mask 0) in between are skipped.
    mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], bool)
    values = np.array([[9.0, 0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 9.0]], np.float32)
    rewards = np.zeros((1, 8), np.float32)
    rewards[0, 6] = 0.7  # fractional reward stays fractional
    adv, ret = A.gae_advantages(rewards, values, mask, whiten=False)
    np.testing.assert_allclose(adv[0], [0, 0.6, 0.5, 0, 0, 0.4, 0.3, 0], atol=1e-6)
    np.testing.assert_allclose(ret[0], [0, 0.7, 0.7, 0, 0, 0.7, 0.7, 0], atol=1e-6)
    assert adv.dtype == jnp.float32 and ret.dtype == jnp.float32


def test_gae_int_and_bf16_inputs_become_float32():
    mask = np.ones((1, 3), bool)
    adv, ret = A.gae_advantages(np.array([[0, 0, 1]], np.int32), jnp.zeros((1, 3), jnp.bfloat16), mask, whiten=False)
    assert adv.dtype == jnp.float32 and ret.dtype == jnp.float32
    np.testing.assert_allclose(adv[0], [1, 1, 1])


def test_whitening_edge_cases():
    x = np.array([[1.0, 2.0, 3.0, 100.0]], np.float32)
    m = np.array([[1, 1, 1, 0]], bool)
    np.testing.assert_allclose(A.masked_whiten(x, m), ref_whiten(x, m), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(A.masked_whiten(x, np.array([[0, 1, 0, 0]], bool)), np.zeros((1, 4)))
    np.testing.assert_array_equal(A.masked_whiten(x, np.zeros((1, 4), bool)), np.zeros((1, 4)))
    assert float(A.masked_var(x, m)) == pytest.approx(1.0)
    assert float(A.masked_var(x, m, unbiased=False)) == pytest.approx(2 / 3)


# ---------------------------------------------------------------- bi-level GAE
def test_bilevel_gae_hand_example():
    # two turns ending at t=1 and t=4; reward 2 at the end of turn 2; V = .5 ... .9
    r = np.array([[0, 0, 0, 0, 2.0]], np.float32)
    v = np.array([[0.5, 0.6, 0.7, 0.8, 0.9]], np.float32)
    m = np.array([[1, 1, 0, 1, 1]], bool)
    ends = np.array([[0, 1, 0, 0, 1]], bool)
    adv, ret = A.bilevel_gae_advantages(r, v, m, ends, 1.0, 1.0, 0.95, whiten=False)
    # high level: A_2 = 2 - .9 = 1.1 (R_2 = 2); A_1 = .95*.9 - .6 + .95*1.1 = 1.3 (R_1 = 1.9)
    np.testing.assert_allclose(adv[0], [1.4, 1.3, 0.0, 1.2, 1.1], atol=1e-6)
    np.testing.assert_allclose(ret[0], [1.9, 1.9, 0.0, 2.0, 2.0], atol=1e-6)


def test_bilevel_gae_matches_ragen_loop():
    rng = np.random.default_rng(1)
    b, length = 3, 14
    m = rng.random((b, length)) < 0.7
    ends = np.zeros((b, length), bool)
    for i in range(b):
        valid = np.flatnonzero(m[i])
        ends[i, rng.choice(valid, size=3, replace=False)] = True
        ends[i, valid[-1]] = True  # the last loss token ends a turn, as in RAGEN
    r = np.where(ends, rng.normal(size=(b, length)), 0.0).astype(np.float32)
    v = rng.normal(size=(b, length)).astype(np.float32)
    for gamma, lam, g_hi in [(1.0, 1.0, 0.95), (0.9, 0.8, 0.5)]:
        adv, ret = jax.jit(A.bilevel_gae_advantages, static_argnums=7)(r, v, m, ends, gamma, lam, g_hi, False)
        want_adv, want_ret = ref_bilevel(r, v.astype(np.float64), m, ends, gamma, lam, g_hi)
        np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
        white, _ = A.bilevel_gae_advantages(r, v, m, ends, gamma, lam, g_hi, whiten=True)
        np.testing.assert_allclose(white, ref_whiten(want_adv, m), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- GRPO / Dr.GRPO / RLOO
def test_grpo_hand_values_and_numpy():
    s = np.array([[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]], np.float32)
    a = np.asarray(A.grpo_advantages(s))
    std = math.sqrt(1 / 3)
    np.testing.assert_allclose(a[0], np.array([0.5, -0.5, 0.5, -0.5]) / (std + 1e-6), rtol=1e-6)
    np.testing.assert_array_equal(a[1], 0.0)  # zero-variance group: no signal, no NaN
    np.testing.assert_allclose(A.grpo_advantages(s, norm_by_std=False)[0], [0.5, -0.5, 0.5, -0.5])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 7)) * 2
    want = (x - x.mean(1, keepdims=True)) / (x.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(A.grpo_advantages(x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(A.grpo_group_std(x), x.std(1, ddof=1), rtol=1e-5)


def test_grpo_edge_shapes_and_dtypes():
    one = np.array([[0.7], [2.0]], np.float64)  # S = 1: verl uses mean 0, std 1
    np.testing.assert_allclose(A.grpo_advantages(one), one / (1 + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(A.grpo_advantages(one, norm_by_std=False), one, rtol=1e-6)
    np.testing.assert_array_equal(A.grpo_group_std(one), [1.0, 1.0])
    g1 = np.array([[3.0, 1.0]])  # G = 1
    np.testing.assert_allclose(A.grpo_advantages(g1), [[1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)]], rtol=1e-6)
    assert A.grpo_advantages(np.array([[1, 0]], np.int32)).dtype == jnp.float32
    assert A.grpo_advantages(jnp.array([[1, 0]], jnp.bfloat16)).dtype == jnp.float32
    with pytest.raises(ValueError, match=r"f32\[G, S\]"):
        A.grpo_advantages(np.ones(3))


def test_grpo_nan_stays_in_its_group():
    s = np.array([[1.0, np.nan], [1.0, 0.0]], np.float32)
    a = np.asarray(A.grpo_advantages(s))
    assert np.isnan(a[0]).all() and np.isfinite(a[1]).all()


def test_rloo():
    s = np.array([[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]], np.float32)
    # A_i = s_i - mean of the others
    np.testing.assert_allclose(A.rloo_advantages(s), [[1.0, -0.5, -0.5], [-3.0, 0.0, 3.0]], atol=1e-6)
    np.testing.assert_allclose(A.rloo_advantages(np.array([[0.7]])), [[0.7]], rtol=1e-6)


def test_broadcast_and_stats():
    mask = np.array([[1, 1, 0], [0, 1, 1]], bool)
    tok = A.broadcast_to_tokens(np.array([2.0, -1.0]), mask)
    np.testing.assert_array_equal(tok, [[2, 2, 0], [0, -1, -1]])
    st = A.advantage_stats(tok, mask)
    assert float(st["advantage_mean"]) == pytest.approx(0.5)
    assert float(st["advantage_std"]) == pytest.approx(1.5)
    assert float(st["advantage_min"]) == -1.0 and float(st["advantage_max"]) == 2.0
    assert float(st["advantage_nonzero_frac"]) == 1.0
    empty = A.advantage_stats(tok, np.zeros_like(mask))
    assert all(float(v) == 0.0 for v in empty.values())
