"""SNR-Aware Filtering against hand-computed cases and a plain-Python port of RAGEN's selection loop."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.rl import filtering as F
from ragen_jax.rl.advantages import grpo_advantages


# ---------------------------------------------------------------- independent reference (plain Python)
def ref_select(scores, strategy, value, mode="linear", include_zero=True, eps=0.01, largest=True):
    """RAGEN ``_select_top_groups`` re-derived in plain Python (stable tie order: lower index first)."""
    g = len(scores)
    idx = list(range(g))
    sc = [float(s) for s in scores]
    if not include_zero:
        idx = [i for i in idx if abs(sc[i]) > 1e-10]
        if not idx:
            return set()
    cand = [sc[i] for i in idx]
    if strategy == "top_p":
        if value >= 1.0:
            return set(idx)
        if mode == "softmax":
            logits = cand if largest else [-c for c in cand]
            mx = max(logits)
            ex = [math.exp(l - mx) for l in logits]
            probs = [e / sum(ex) for e in ex]
            order = sorted(range(len(idx)), key=lambda j: -probs[j])
            cum, k = 0.0, None
            for pos, j in enumerate(order):
                cum += probs[j]
                if cum >= value:
                    k = pos + 1
                    break
            k = len(idx) if k is None else min(k, len(idx))
            return {idx[j] for j in order[:k]}
        order = sorted(range(len(idx)), key=lambda j: -cand[j] if largest else cand[j])
        threshold = value * sum(cand) - eps
        cum, n = 0.0, 0
        for j in order:
            if cum >= threshold or cand[j] <= 0:
                break
            cum += cand[j]
            n += 1
        return {idx[j] for j in order[:n]} if cum >= threshold else set()
    if strategy in ("top_k", "top_k_abs"):
        k = int(value * g) if strategy == "top_k" else int(value)
        k = max(min(k, len(idx)), 1)
        order = sorted(range(len(idx)), key=lambda j: -cand[j] if largest else cand[j])
        return {idx[j] for j in order[:k]}
    # RAGEN does min_p in float32 tensors (python scalars are cast to float32), so mirror that.
    f32 = np.float32
    if largest:
        thr = f32(max(cand)) * f32(value) - f32(1e-10)
        return {i for i, c in zip(idx, cand) if f32(c) >= thr}
    thr = f32(min(cand)) / (f32(value) + f32(1e-10)) + f32(1e-10)
    return {i for i, c in zip(idx, cand) if f32(c) <= thr}


def kept(mask):
    return set(np.flatnonzero(np.asarray(mask)).tolist())


# ---------------------------------------------------------------- group_scores
def test_group_scores_hand_values():
    r = np.array([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]], np.float32)
    # unbiased std of [1,0,1,0]: mean .5, sum sq dev 1, /3 -> sqrt(1/3)
    np.testing.assert_allclose(F.group_scores(r), [math.sqrt(1 / 3), 0.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose(F.group_scores(r, "reward_variance"), F.group_scores(r, "reward_std"))
    np.testing.assert_allclose(F.group_scores(r, "reward_var"), [0.25, 0.0, 27 / 16], rtol=1e-6)
    np.testing.assert_allclose(F.group_scores(r, "reward_var", ddof=1), [1 / 3, 0.0, 2.25], rtol=1e-6)
    np.testing.assert_allclose(F.group_scores(r, "reward_mean"), [0.5, 2.0, 0.75])
    np.testing.assert_allclose(F.group_scores(r, "reward"), [0.5, 2.0, 0.75])
    np.testing.assert_allclose(F.group_scores(r, "reward_sum"), [2.0, 8.0, 3.0])


def test_group_scores_match_numpy_and_stay_float32():
    rng = np.random.default_rng(0)
    r64 = rng.normal(size=(7, 5)) * 3.0  # float64 fractional rewards
    for metric, ref in [
        ("reward_std", np.std(r64, axis=1, ddof=1)),
        ("reward_var", np.var(r64, axis=1)),
        ("reward_mean", r64.mean(1)),
        ("reward_sum", r64.sum(1)),
    ]:
        out = F.group_scores(r64, metric)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # integer rewards and fractional ones are not truncated
    assert F.group_scores(np.array([[1, 0]], np.int32)).dtype == jnp.float32
    np.testing.assert_allclose(F.group_scores(np.array([[0.7, 1.5]]), "reward_sum"), [2.2], rtol=1e-6)


def test_group_scores_single_sample_and_nonfinite():
    np.testing.assert_array_equal(F.group_scores(np.ones((3, 1))), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(F.group_scores(np.ones((3, 1)), "reward_var"), [0.0, 0.0, 0.0])
    r = np.array([[1.0, np.nan], [1.0, 0.0]], np.float32)
    out = np.asarray(F.group_scores(r))
    assert np.isnan(out[0]) and out[1] == pytest.approx(math.sqrt(0.5))
    assert np.isnan(np.asarray(F.group_scores(np.array([[np.inf]]))))[0]
    assert not bool(F.all_finite(r)) and bool(jax.jit(F.all_finite)(np.ones(3)))


def test_group_scores_errors():
    with pytest.raises(ValueError, match="reward_std"):
        F.group_scores(np.ones((2, 2)), "variance")
    with pytest.raises(ValueError, match=r"f32\[G, S\]"):
        F.group_scores(np.ones(4))


# ---------------------------------------------------------------- select_groups against the reference
CONFIGS = (
    [("top_p", v, m) for v in (0.3, 0.6, 0.9, 0.98, 1.0) for m in ("linear", "softmax")]
    + [("top_k", v, "linear") for v in (0.1, 0.25, 0.5, 1.0)]
    + [("top_k_abs", v, "linear") for v in (1, 3, 20)]
    + [("min_p", v, "linear") for v in (0.2, 0.5, 0.9)]
)


def test_select_groups_matches_reference():
    settings = [
        (strategy, value, mode, include_zero, largest)
        for (strategy, value, mode), include_zero, largest in itertools.product(CONFIGS, (True, False), (True, False))
    ]
    traces = {"n": 0}

    @jax.jit
    def every_setting(scores):  # one compile covering all static settings, vmapped over cases
        traces["n"] += 1
        return jnp.stack([F.select_groups(scores, st, v, m, iz, 0.01, lg) for st, v, m, iz, lg in settings])

    rng = np.random.default_rng(1)
    levels = np.array([0.0, 0.25, 0.5, 1.0, 2.0, 6.0], np.float32)  # ties and zeros on purpose
    cases = [levels[rng.integers(0, len(levels), size=8)] for _ in range(12)]
    cases += [rng.gamma(1.0, 1.0, size=8).astype(np.float32) for _ in range(6)]
    cases += [np.zeros(8, np.float32), np.full(8, 0.5, np.float32)]
    cases = np.stack(cases)
    got_all = np.asarray(jax.vmap(every_setting)(cases))
    got_again = np.asarray(jax.vmap(every_setting)(cases[::-1].copy()))
    assert traces["n"] == 1  # new score values never retrace
    np.testing.assert_array_equal(got_again[::-1], got_all)
    for c, scores in enumerate(cases):
        for k, (strategy, value, mode, include_zero, largest) in enumerate(settings):
            want = ref_select(scores, strategy, value, mode, include_zero, 0.01, largest)
            assert kept(got_all[c, k]) == want, (scores, strategy, value, mode, include_zero, largest)


def test_linear_top_p_hand_cases():
    s = jnp.array([0.5, 0.0, 0.2, 0.5, 0.1])
    # tau = 0.9 * 1.3 - 0.01 = 1.16; sorted 0.5, 0.5, 0.2 reaches 1.2 >= 1.16
    assert kept(F.select_groups(s, "top_p", 0.9)) == {0, 2, 3}
    # all zero: tau = -0.01, the empty prefix already reaches it -> empty batch
    assert kept(F.select_groups(jnp.zeros(8), "top_p", 0.9)) == set()
    # zero-score groups are never kept in linear mode below p = 1
    assert kept(F.select_groups(jnp.array([1.0, 0.0, 0.0]), "top_p", 0.99)) == {0}
    # smallest: ascending walk stops at the first score <= 0 before reaching tau -> keep nothing
    assert kept(F.select_groups(jnp.array([0.0, 0.5, 1.0]), "top_p", 0.9, largest=False)) == set()
    # ties: equal scores are taken lower index first
    assert kept(F.select_groups(jnp.array([1.0, 1.0, 1.0, 1.0]), "top_p", 0.5)) == {0, 1}


def test_softmax_top_p_and_no_filter_cases():
    # all-zero std with binary rewards: uniform probs, 7/8 < 0.9 -> keep all 8
    assert kept(F.select_groups(jnp.zeros(8), "top_p", 0.9, "softmax")) == set(range(8))
    # a peaky score keeps just the top group
    assert kept(F.select_groups(jnp.array([0.0, 6.0, 0.1]), "top_p", 0.9, "softmax")) == {1}
    # value >= 1: all with include_zero, zero groups dropped without
    s = jnp.array([0.0, 0.3, 0.0, 0.2])
    assert kept(F.select_groups(s, "top_p", 1.0)) == {0, 1, 2, 3}
    assert kept(F.select_groups(s, "top_p", 1.0, include_zero=False)) == {1, 3}
    assert F.is_no_filter("top_p", 1.0, True) and not F.is_no_filter("top_p", 1.0, False)
    # include_zero=False with only zeros keeps nothing for every strategy
    for strategy in F.STRATEGIES:
        assert kept(F.select_groups(jnp.zeros(4), strategy, 0.5, "softmax", include_zero=False)) == set()


def test_top_k_and_min_p_hand_cases():
    s = jnp.array([0.1, 0.9, 0.3, 0.8, 0.0, 0.2, 0.7, 0.4])
    assert kept(F.select_groups(s, "top_k", 0.25)) == {1, 3}  # int(0.25 * 8) = 2
    assert kept(F.select_groups(s, "top_k", 0.01)) == {1}  # at least one
    assert kept(F.select_groups(s, "top_k_abs", 3, largest=False)) == {4, 0, 5}
    assert kept(F.select_groups(s, "min_p", 0.5)) == {1, 3, 6}  # >= 0.45
    assert kept(F.select_groups(s, "min_p", 0.5, include_zero=False, largest=False)) == {0, 5}  # <= 0.2


def test_single_group():
    one = jnp.array([0.4])
    for strategy, mode in [("top_p", "linear"), ("top_p", "softmax"), ("top_k", "linear"), ("min_p", "linear")]:
        assert kept(F.select_groups(one, strategy, 0.5, mode)) == {0}
    assert kept(F.select_groups(jnp.array([0.0]), "top_p", 0.9)) == set()
    assert kept(F.select_groups(jnp.array([0.0]), "top_p", 0.9, "softmax")) == {0}


def test_select_groups_errors():
    with pytest.raises(ValueError, match="top_k_abs"):
        F.select_groups(jnp.ones(3), "nucleus")
    with pytest.raises(ValueError, match="softmax"):
        F.select_groups(jnp.ones(3), "top_p", 0.9, "exp")


# ---------------------------------------------------------------- VAGEN variance mass, reweighting, scaling
def ref_variance_mass(v, p):
    total = float(sum(v))
    g = len(v)
    if total <= 0:
        return set(range(g)), 1.0
    order = sorted(range(g), key=lambda i: -v[i])
    chosen, cum = [], 0.0
    for i in order:
        if cum >= p * total:
            break
        chosen.append(i)
        cum += v[i]
    chosen = chosen or [order[0]]
    return set(chosen), math.sqrt(len(chosen) / g)


def test_variance_mass_matches_reference():
    rng = np.random.default_rng(2)
    fn = jax.jit(F.select_groups_variance_mass, static_argnums=1)
    for _ in range(10):
        rewards = rng.integers(0, 3, size=(8, 4)).astype(np.float32)
        v = np.asarray(F.group_scores(rewards, "reward_var"))
        for p in (0.3, 0.9):
            keep, scale = fn(v, p)
            want_keep, want_scale = ref_variance_mass(v.tolist(), p)
            assert kept(keep) == want_keep
            assert float(scale) == pytest.approx(want_scale, rel=1e-6)
    keep, scale = F.select_groups_variance_mass(jnp.zeros(5))  # no mass: keep everything, no scale
    assert kept(keep) == set(range(5)) and float(scale) == 1.0
    keep, scale = F.select_groups_variance_mass(jnp.array([4.0, 1.0, 0.0, 0.0]), 0.9)
    assert kept(keep) == {0, 1} and float(scale) == pytest.approx(math.sqrt(0.5))


def test_soft_reweight_and_loss_scale():
    std = jnp.array([0.5, 2.0, 1.0, 4.0])
    np.testing.assert_allclose(F.soft_reweight_weights(std), np.array([0.5, 2, 1, 4]) / (4 + 1e-6), rtol=1e-6)
    keep = jnp.array([True, True, True, False])
    np.testing.assert_allclose(
        F.soft_reweight_weights(std, keep), [0.25 / (1 + 5e-7), 1 / (1 + 5e-7), 0.5 / (1 + 5e-7), 0.0], rtol=1e-6
    )
    assert float(F.filter_loss_scale(0.25, "none")) == 1.0
    assert float(F.filter_loss_scale(0.25, "linear")) == 0.25
    assert float(F.filter_loss_scale(0.25, "sqrt")) == 0.5
    with pytest.raises(ValueError, match="sqrt"):
        F.filter_loss_scale(0.5, "quadratic")


def test_filter_metrics_hand_values():
    r = jnp.array([[1.0, 0.0], [1.0, 1.0], [3.0, 1.0]])
    scores = F.group_scores(r)  # sqrt(.5), 0, sqrt(2)
    keep = jnp.array([True, False, True])
    m = F.filter_metrics(r, scores, keep)
    assert float(m["in_group_reward_std"]) == pytest.approx((math.sqrt(0.5) + math.sqrt(2)) / 3, rel=1e-6)
    assert float(m["chosen_in_group_reward_std"]) == pytest.approx((math.sqrt(0.5) + math.sqrt(2)) / 2, rel=1e-6)
    assert float(m["in_group_reward_max"]) == pytest.approx(5 / 3)
    assert float(m["chosen_in_group_reward_mean"]) == pytest.approx(1.25)
    assert float(m["chosen_in_group_reward_sum"]) == pytest.approx(2.5)
    assert float(m["filter_kept_count"]) == 2 and float(m["filter_kept_ratio"]) == pytest.approx(2 / 3)
    assert float(m["filter_zero_count"]) == 1
    empty = F.filter_metrics(r, scores, jnp.zeros(3, bool))
    assert float(empty["chosen_in_group_reward_std"]) == 0.0


def test_check_finite_rewards_names_count_and_positions():
    F.check_finite_rewards(np.ones((2, 3)))
    r = np.ones((3, 4), np.float32)
    r[1, 2] = np.nan
    r[2, 0] = np.inf
    with pytest.raises(ValueError, match=r"2 non-finite rewards of 12 at positions \[\(1, 2\), \(2, 0\)\]"):
        F.check_finite_rewards(r)


def test_filter_then_grpo_leaves_kept_groups_unchanged():
    rng = np.random.default_rng(3)
    rewards = rng.integers(0, 2, size=(8, 6)).astype(np.float32) + rng.normal(size=(8, 6)).astype(np.float32) * 0.1
    rewards[2] = 1.0  # a zero-variance group
    keep = np.asarray(F.select_groups(F.group_scores(rewards), "top_p", 0.7))
    assert 0 < keep.sum() < 8
    full = np.asarray(grpo_advantages(rewards))
    kept_only = np.asarray(grpo_advantages(rewards[keep]))
    np.testing.assert_array_equal(full[keep], kept_only)
