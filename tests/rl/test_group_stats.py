"""Group mean / spread: exact for equal values, within an analysed float32 bound of float64 otherwise.

Every estimator that centres a group goes through ``ragen_jax.rl.group_stats``; these tests drive the
public estimators (GRPO, Dr.GRPO, RLOO, the filter's spread, whitening) rather than the helper alone,
so an estimator that stops using it is caught.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.rl import advantages as A
from ragen_jax.rl import filtering as F
from ragen_jax.rl.group_stats import group_moments, group_var

U = 2.0**-24  # float32 unit roundoff
EPS = 1e-6  # grpo_advantages' default eps
SIZES = range(2, 65)
CONSTANTS = np.array([0.7, -1.1, -0.3, 10.0, 1e-3, 0.0, -1e6], np.float32)


@jax.jit
def _estimators(r):
    """Everything that centres a group of r: f32[G, S], in one program per group size."""
    return {
        "grpo": A.grpo_advantages(r),
        "drgrpo": A.grpo_advantages(r, norm_by_std=False),
        "rloo": A.rloo_advantages(r),
        "grpo_std": A.grpo_group_std(r),
        "filter_std": F.group_scores(r, "reward_std"),
        "filter_var": F.group_scores(r, "reward_var"),
        "filter_mean": F.group_scores(r, "reward_mean"),
        # batch whitening (GAE advantages) over each row on its own
        "whiten": jax.vmap(lambda row: A.masked_whiten(row, jnp.ones(row.shape, bool)))(r),
    }


@pytest.mark.parametrize("n", SIZES)
def test_constant_group_is_exact_for_every_size(n):
    """Equal rewards carry no signal: every advantage and spread is exactly 0, the mean exactly the value.

    Before the shared helper, 16 x 0.7 gave GRPO advantages of +0.106 (std ~1e-7 against eps 1e-6).
    """
    r = np.repeat(CONSTANTS[:, None], n, axis=1)
    out = jax.device_get(_estimators(r))
    for name in ("grpo", "drgrpo", "rloo", "grpo_std", "filter_std", "filter_var", "whiten"):
        assert np.all(out[name] == 0.0), (name, n, out[name])
    np.testing.assert_array_equal(out["filter_mean"], CONSTANTS)


def test_masked_constant_group_ignores_padding():
    x = np.array([[np.nan, 0.7, 0.7, np.inf, 0.7], [5.0, 5.0, 5.0, 5.0, 5.0]], np.float32)
    where = np.array([[False, True, True, False, True], [False] * 5])
    mom = jax.device_get(group_moments(x, where))
    assert mom.mean[0] == np.float32(0.7) and np.isnan(mom.mean[1])  # no valid element: 0 / 0
    np.testing.assert_array_equal(mom.centered, 0.0)
    np.testing.assert_array_equal(mom.sum_sq, 0.0)
    np.testing.assert_array_equal(mom.count, [3.0, 0.0])
    # masked whitening of equal values (GAE advantages with a constant return) is exactly 0 too
    tokens = np.where(where[:1], np.float32(-0.3), np.float32(9.0))
    np.testing.assert_array_equal(A.masked_whiten(tokens, where[:1]), 0.0)
    assert A.masked_var(tokens, where[:1]) == 0.0


# ---------------------------------------------------------------- float64 reference, analysed bound
def ref_grpo(s):
    """RAGEN / verl GRPO in float64, straight from the formula: (s - mean) / (std_unbiased + eps)."""
    s = s.astype(np.float64)
    mean = s.mean(axis=1, keepdims=True)
    std = s.std(axis=1, ddof=1, keepdims=True)
    return (s - mean) / (std + EPS), s - mean, std[:, 0]


def float32_bound(s, adv, std):
    """Bound on |A_float32 - A_float64| for GRPO, per entry of s: f32[G, S] (float64 reference values).

    n = group size, R = max s - min s (per group), u = 2^-24, sigma = std (float64), eps = 1e-6; the
    inputs are float32, so the float64 reference sees them exactly. Following ``group_moments``:
      d_i = fl(s_i - s_0):       |dd_i| <= u |s_i - s_0| <= u R
      dbar = fl(sum d / n):      any summation order errs by <= (n - 1) u sum|d_i| <= (n - 1) n u R, so
                                 after / n (one more rounding, and the dd_i): |d dbar| <= (n + 1) u R
      c_i = fl(d_i - dbar):      |dc_i| <= u R + (n + 1) u R + u |c_i| <= (n + 3) u R =: E
      SS = fl(sum c_i^2):        |dSS| <= 2 E sum|c_i| + n u SS  with sum|c_i| <= sqrt(n SS)
      sigma = sqrt(SS / (n-1)):  |dsigma| <= E sqrt(n / (n - 1)) + (n / 2 + 2) u sigma =: E_sigma
      A_i = c_i / (sigma + eps): |dA_i| <= (E + |A_i| E_sigma) / (sigma + eps) + 3 u |A_i|
    (the 3 u |A_i|: the add, the divide, and eps = 1e-6 rounded to float32). First-order terms only;
    the test allows twice the bound for the dropped O(u^2) terms. A constant group has R = 0, so its
    bound is exactly 0: the float32 advantages must be exactly 0 too.
    """
    n = s.shape[1]
    s = s.astype(np.float64)
    r = (s.max(axis=1) - s.min(axis=1))[:, None]
    sigma = std[:, None]
    e_c = (n + 3) * U * r
    e_sigma = e_c * np.sqrt(n / (n - 1)) + (n / 2 + 2) * U * sigma
    return (e_c + np.abs(adv) * e_sigma) / (sigma + EPS) + 3 * U * np.abs(adv), e_c


def random_cases(seed=0, count=160):
    """count cases (group size 2..64, 1..4 groups each), rewards of several kinds: f32[G, S] each."""
    rng = np.random.default_rng(seed)
    cases = []
    for k in range(count):
        n, g = int(rng.integers(2, 65)), int(rng.integers(1, 5))
        kind = k % 5
        if kind == 0:  # few distinct values, many repeats (success / format-penalty rewards)
            r = rng.choice(np.array([0.0, 1.0, -0.1, 0.7, -1.1, 10.0]), size=(g, n))
        elif kind == 1:  # constant groups
            r = np.repeat(rng.normal(size=(g, 1)) * 10.0 ** rng.integers(-3, 3), n, axis=1)
        elif kind == 2:  # a large common offset with small noise
            r = 10.0 + rng.normal(size=(g, n)) * 10.0 ** rng.integers(-4, 0)
        elif kind == 3:  # all equal but one
            r = np.full((g, n), rng.normal())
            r[:, rng.integers(n)] += rng.normal() * 10.0 ** rng.integers(-6, 1)
        else:  # continuous, random scale
            r = rng.normal(size=(g, n)) * 10.0 ** rng.integers(-3, 3) + rng.normal()
        cases.append(r.astype(np.float32))
    return cases


def test_grpo_matches_float64_reference_within_analysed_bound():
    cases = random_cases()
    assert len(cases) >= 120
    worst = 0.0
    for s in cases:
        # Pad to the constant test's shape [7, n] (groups are independent) so both share compiles.
        padded = np.concatenate([s, np.repeat(s[-1:], len(CONSTANTS) - len(s), axis=0)])
        out = {k: v[: len(s)] for k, v in jax.device_get(_estimators(padded)).items()}
        want, centered, std = ref_grpo(s)
        bound, e_c = float32_bound(s, want, std)
        err = np.abs(out["grpo"].astype(np.float64) - want)
        assert np.all(err <= 2 * bound), (s, out["grpo"], want, err, bound)
        worst = max(worst, float(np.max(np.where(bound > 0, err / np.where(bound > 0, bound, 1), 0))))
        n = s.shape[1]
        assert np.all(np.abs(out["drgrpo"] - centered) <= 2 * e_c)
        loo = s.astype(np.float64) - (s.sum(1, keepdims=True, dtype=np.float64) - s) / (n - 1)
        rloo_bound = 2 * (e_c * n / (n - 1) + 2 * U * np.abs(loo))  # c_i * fl(n / (n-1))
        assert np.all(np.abs(out["rloo"] - loo) <= rloo_bound)
        assert np.all(np.abs(out["grpo_std"] - std) <= 2 * float32_bound_sigma(s, std))
    print(f'worst err / bound: {worst:.3g}')
    assert worst > 0.0  # the bound is exercised, not vacuous


def float32_bound_sigma(s, std):
    """E_sigma from ``float32_bound`` plus one rounding of the returned std: f32[G]."""
    n = s.shape[1]
    r = s.astype(np.float64).max(axis=1) - s.astype(np.float64).min(axis=1)
    return (n + 3) * U * r * np.sqrt(n / (n - 1)) + (n / 2 + 3) * U * std


def test_group_var_ddof_and_moments_shapes():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    mom = group_moments(x)
    assert mom.mean.shape == (2, 3) and mom.centered.shape == x.shape and mom.count.shape == (2, 3)
    np.testing.assert_allclose(group_var(mom, 0), x.var(-1), rtol=1e-6)
    np.testing.assert_allclose(group_var(mom, 1), x.var(-1, ddof=1), rtol=1e-6)
    with pytest.raises(ValueError, match="axis"):
        group_moments(np.float32(1.0))

