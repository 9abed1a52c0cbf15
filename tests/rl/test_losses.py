"""Losses against numpy ports of verl's formulas, hand values, and the micro-batch (sum, count) contract."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.rl import losses as Lo


# ---------------------------------------------------------------- numpy references
def ref_ppo(logp, old, adv, lo=0.2, hi=0.28, c=3.0):
    ratio = np.exp(np.clip(logp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - lo, 1 + hi)
    lc = np.maximum(l1, l2)
    return np.where(adv < 0, np.minimum(lc, -adv * c), lc)


def ref_agg(x, mask, mode, horizon=None):
    """verl agg_loss (rows here all have >= 1 token, where verl and the (sum, count) form agree)."""
    m = mask.astype(np.float64)
    if mode == "token-mean":
        return (x * m).sum() / m.sum()
    if mode == "seq-mean-token-mean":
        return ((x * m).sum(1) / m.sum(1)).mean()
    if mode == "seq-mean-token-sum":
        return (x * m).sum(1).mean()
    return (x * m).sum() / (x.shape[0] * (x.shape[1] if horizon is None else horizon))


def test_ppo_token_losses_match_verl_formula():
    rng = np.random.default_rng(0)
    logp = rng.normal(size=(6, 9)) * 0.5 - 2
    old = logp + rng.normal(size=(6, 9)) * 0.6  # ratios well outside [0.8, 1.28] and beyond c = 3
    adv = rng.normal(size=(6, 9)) * 2
    terms = Lo.ppo_token_losses(logp, old, adv)
    np.testing.assert_allclose(terms["loss"], ref_ppo(logp, old, adv), rtol=1e-5, atol=1e-6)
    ratio = np.exp(logp - old)
    assert np.any(terms["dual"]) and np.any(terms["clipped_upper"]) and np.any(terms["clipped_lower"])
    np.testing.assert_array_equal(terms["clipped_upper"], (adv > 0) & (ratio > 1.28))
    np.testing.assert_array_equal(terms["clipped_lower"], (adv < 0) & (ratio < 0.8))
    np.testing.assert_array_equal(terms["dual"], (adv < 0) & (ratio > 3.0))


def test_ppo_hand_values_and_clamp():
    # A = 1, ratio 2 -> clipped at 1.28: loss -1.28; A = -1, ratio 5 -> dual clip caps at 3
    logp = np.log(np.array([[2.0, 5.0, 0.5, 1.0]]))
    adv = np.array([[1.0, -1.0, -1.0, 2.0]])
    terms = Lo.ppo_token_losses(logp, np.zeros((1, 4)), adv)
    np.testing.assert_allclose(terms["loss"][0], [-1.28, 3.0, 0.8, -2.0], rtol=1e-6)
    # log-ratio clamp at +-20: no overflow for absurd differences
    t = Lo.ppo_token_losses(np.array([[50.0, -50.0]]), np.zeros((1, 2)), np.array([[-1.0, 1.0]]))
    np.testing.assert_allclose(t["log_ratio"][0], [20.0, -20.0])
    assert np.all(np.isfinite(t["loss"]))
    with pytest.raises(ValueError, match="clip_c"):
        Lo.ppo_token_losses(logp, logp, adv, clip_c=1.0)


def test_policy_loss_aux_metrics_by_hand():
    logp = np.log(np.array([[2.0, 5.0, 0.5, 1.0]]))
    adv = np.array([[1.0, -1.0, -1.0, 2.0]])
    mask = np.array([[1, 1, 1, 0]], bool)
    loss, aux = Lo.policy_loss(logp, np.zeros((1, 4)), adv, mask)
    assert float(loss.count) == 3 and float(Lo.weighted_mean(loss)) == pytest.approx((-1.28 + 3 + 0.8) / 3, rel=1e-6)
    mean = lambda k: float(Lo.weighted_mean(aux[k]))
    assert mean("clipfrac") == pytest.approx(2 / 3)  # tokens 0 (upper) and 2 (lower)
    assert mean("clipfrac_upper") == pytest.approx(1 / 3)
    assert mean("clipfrac_lower") == pytest.approx(1 / 3)
    assert mean("clipfrac_dual") == pytest.approx(1 / 3)
    assert mean("approx_kl") == pytest.approx(-(math.log(2) + math.log(5) + math.log(0.5)) / 3, rel=1e-6)
    assert mean("advantage_mean") == pytest.approx(-1 / 3)


@pytest.mark.parametrize("mode", Lo.AGG_MODES)
def test_aggregate_matches_verl(mode):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 7))
    mask = rng.random((5, 7)) < 0.6
    mask[:, 0] = True
    w = Lo.aggregate(x, mask, mode)
    assert float(Lo.weighted_mean(w)) == pytest.approx(ref_agg(x, mask, mode), rel=1e-5)
    if mode == "seq-mean-token-sum-norm":
        w = Lo.aggregate(x, mask, mode, norm_length=40)
        assert float(Lo.weighted_mean(w)) == pytest.approx(ref_agg(x, mask, mode, 40), rel=1e-5)


def test_aggregate_counts_and_empty_rows():
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [np.nan, 7.0, 8.0]])
    mask = np.array([[1, 1, 0], [0, 0, 0], [0, 1, 1]], bool)  # row 1 empty; NaN sits on a masked token
    tm = Lo.aggregate(x, mask, "token-mean")
    assert (float(tm.sum), float(tm.count)) == (18.0, 4.0)
    smm = Lo.aggregate(x, mask, "seq-mean-token-mean")  # empty row is not a sequence here
    assert (float(smm.sum), float(smm.count)) == (1.5 + 7.5, 2.0)
    sms = Lo.aggregate(x, mask, "seq-mean-token-sum")
    assert (float(sms.sum), float(sms.count)) == (18.0, 3.0)
    rows = np.array([True, False, True])
    sms = Lo.aggregate(x, mask, "seq-mean-token-sum", sequence_mask=rows)
    assert (float(sms.sum), float(sms.count)) == (18.0, 2.0)
    norm = Lo.aggregate(x, mask, "seq-mean-token-sum-norm", norm_length=10)
    assert (float(norm.sum), float(norm.count)) == (18.0, 30.0)
    assert float(Lo.weighted_mean(Lo.Weighted(jnp.float32(0), jnp.float32(0)))) == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        Lo.aggregate(x, mask, "mean")


# ---------------------------------------------------------------- micro-batch accumulation == whole batch
B, L, D, V = 8, 6, 5, 7


@pytest.fixture(scope="module")
def toy_batch():
    rng = np.random.default_rng(2)
    mask = rng.random((B, L)) < 0.7
    mask[3] = False  # a row with no loss token
    mask[5, :] = True
    return {
        "x": jnp.asarray(rng.normal(size=(B, L, D)), jnp.float32),
        "tokens": jnp.asarray(rng.integers(0, V, size=(B, L)), jnp.int32),
        "old_logp": jnp.asarray(rng.normal(size=(B, L)) * 0.3 - 2.0, jnp.float32),
        "ref_logp": jnp.asarray(rng.normal(size=(B, L)) * 0.3 - 2.0, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=(B, L)), jnp.float32),
        "mask": jnp.asarray(mask),
    }


def toy_logprobs(w, batch):
    """A linear softmax policy: logits = x @ w. Returns (logp of the tokens, full-vocab entropy)."""
    logits = jnp.einsum("bld,dv->blv", batch["x"], w)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["tokens"][..., None], -1)[..., 0]
    return logp, Lo.token_entropy(logits)


@pytest.mark.parametrize("mode", Lo.AGG_MODES)
def test_microbatch_accumulation_equals_whole_batch(toy_batch, mode):
    config = Lo.ActorLossConfig(agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_coef=0.1, kl_type="k3")
    w = jnp.asarray(np.random.default_rng(3).normal(size=(D, V)) * 0.5, jnp.float32)

    def weighted(w, batch):
        logp, ent = toy_logprobs(w, batch)
        total, aux = Lo.actor_loss(logp, ent, batch["old_logp"], batch["advantages"], batch["mask"], config, batch["ref_logp"])
        return total, aux

    whole, whole_aux = weighted(w, toy_batch)
    whole_loss = Lo.weighted_mean(whole)
    whole_grad = jax.grad(lambda w: Lo.weighted_mean(weighted(w, toy_batch)[0]))(w)

    splits = [slice(0, 3), slice(3, 4), slice(4, 8)]  # uneven micro-batches, one holding the empty row
    micro = [{k: v[s] for k, v in toy_batch.items()} for s in splits]
    parts = [weighted(w, mb) for mb in micro]
    total = Lo.accumulate(*[p[0] for p in parts])
    aux = Lo.accumulate(*[p[1] for p in parts])
    np.testing.assert_allclose(float(Lo.weighted_mean(total)), float(whole_loss), rtol=1e-6, atol=1e-7)
    for key in whole_aux:
        np.testing.assert_allclose(float(Lo.weighted_mean(aux[key])), float(Lo.weighted_mean(whole_aux[key])), rtol=1e-6, atol=1e-7)
    count = total.count  # the global denominator, known after a cheap counting pass
    grad = sum(jax.grad(lambda w, mb=mb: weighted(w, mb)[0].sum / count)(w) for mb in micro)
    np.testing.assert_allclose(grad, whole_grad, rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(whole_grad))) > 1e-3  # the check is not vacuous


def test_actor_loss_is_sum_of_terms(toy_batch):
    config = Lo.ActorLossConfig(entropy_coeff=0.5, use_kl_loss=True, kl_coef=0.2)
    w = jnp.full((D, V), 0.1, jnp.float32)
    logp, ent = toy_logprobs(w, toy_batch)
    args = (logp, ent, toy_batch["old_logp"], toy_batch["advantages"], toy_batch["mask"], config, toy_batch["ref_logp"])
    total, aux = Lo.actor_loss(*args)
    m = np.asarray(toy_batch["mask"])
    pg = ref_ppo(np.asarray(logp, np.float64), np.asarray(toy_batch["old_logp"]), np.asarray(toy_batch["advantages"]))
    kl = np.asarray(logp, np.float64) - np.asarray(toy_batch["ref_logp"])
    want = ref_agg(pg, m, "token-mean") - 0.5 * ref_agg(np.asarray(ent), m, "token-mean") + 0.2 * ref_agg(kl, m, "token-mean")
    assert float(Lo.weighted_mean(total)) == pytest.approx(want, rel=1e-5)
    parts = sum(float(Lo.weighted_mean(aux[f"loss/{k}"])) for k in ("task", "entropy", "kl"))
    assert parts == pytest.approx(float(Lo.weighted_mean(total)), rel=1e-6)
    no_kl, aux2 = Lo.actor_loss(*args[:5], Lo.ActorLossConfig(entropy_coeff=0.0))
    assert float(Lo.weighted_mean(aux2["loss/kl"])) == 0.0 and float(Lo.weighted_mean(aux2["loss/entropy"])) == 0.0
    with pytest.raises(ValueError, match="ref_logp"):
        Lo.actor_loss(*args[:5], Lo.ActorLossConfig(use_kl_loss=True, kl_coef=0.1))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        Lo.ActorLossConfig(agg_mode="seq-mean")


# ---------------------------------------------------------------- KL, value loss, entropy
def test_kl_estimators_by_hand():
    logp = np.array([[-1.0, -2.0, -3.0, 0.0]])
    ref = np.array([[-2.0, -2.0, -1.0, -40.0]])
    d = logp - ref
    np.testing.assert_allclose(Lo.kl_penalty(logp, ref, "kl"), d)
    np.testing.assert_allclose(Lo.kl_penalty(logp, ref, "k1"), d)
    np.testing.assert_allclose(Lo.kl_penalty(logp, ref, "abs"), np.abs(d))
    np.testing.assert_allclose(Lo.kl_penalty(logp, ref, "mse"), 0.5 * d**2)
    k3 = np.asarray(Lo.kl_penalty(logp, ref, "low_var_kl"))[0]
    # exp(d) - d - 1 with d = ref - logp: d = -1 -> e^-1; d = 0 -> 0; d = 2 -> e^2 - 3;
    # d = -40 is clamped to -20 -> e^-20 + 19, then the estimate is clamped to 10
    np.testing.assert_allclose(k3, [math.exp(-1), 0.0, math.exp(2) - 3, 10.0], rtol=1e-6)
    assert float(Lo.kl_penalty(np.array([0.0]), np.array([5.0]), "k3")[0]) == 10.0  # e^5 - 6 clamped to 10
    with pytest.raises(ValueError, match="low_var_kl"):
        Lo.kl_penalty(logp, ref, "low-var-kl")


def test_value_loss_matches_verl():
    rng = np.random.default_rng(4)
    v, old, ret = (rng.normal(size=(4, 5)) for _ in range(3))
    mask = rng.random((4, 5)) < 0.7
    mask[:, 0] = True
    loss, aux = Lo.value_loss(v, old, ret, mask, 0.5)
    vc = np.clip(v, old - 0.5, old + 0.5)
    want = 0.5 * ref_agg(np.maximum((v - ret) ** 2, (vc - ret) ** 2), mask, "token-mean")
    assert float(Lo.weighted_mean(loss)) == pytest.approx(want, rel=1e-5)
    frac = ((vc - ret) ** 2 > (v - ret) ** 2)[mask].mean()
    assert float(Lo.weighted_mean(aux["vf_clipfrac"])) == pytest.approx(frac)


def test_token_entropy():
    rng = np.random.default_rng(5)
    z = rng.normal(size=(3, 4, 11)) * 3
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(Lo.token_entropy(z), -(p * np.log(p)).sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(Lo.token_entropy(np.zeros((2, 50))), [math.log(50)] * 2, rtol=1e-6)
    big = Lo.token_entropy(jnp.array([[1e4, 0.0, -1e4], [3e4, 3e4, 0.0]], jnp.float32))
    np.testing.assert_allclose(big, [0.0, math.log(2)], atol=1e-6)
    assert Lo.token_entropy(jnp.zeros((2, 8), jnp.bfloat16)).dtype == jnp.float32
    g = jax.grad(lambda z: Lo.token_entropy(z).sum())(jnp.asarray(z[0, 0], jnp.float32))
    pz = p[0, 0]
    np.testing.assert_allclose(g, -pz * (np.log(pz) + (-(pz * np.log(pz)).sum())), rtol=1e-4, atol=1e-6)


def test_low_precision_inputs_give_float32_losses():
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    logp = np.log(np.array([[0.3, 0.5]]))
    loss, aux = Lo.policy_loss(bf(logp), bf(logp - 0.1), bf([[0.7, -1.5]]), np.ones((1, 2), bool))
    assert loss.sum.dtype == jnp.float32 and loss.count.dtype == jnp.float32
    assert all(v.sum.dtype == jnp.float32 for v in aux.values())
    assert Lo.kl_penalty(bf(logp), bf(logp), "k3").dtype == jnp.float32
    vl, _ = Lo.value_loss(bf([[0.1, 0.2]]), bf([[0.0, 0.0]]), np.array([[0.7, 1.5]]), np.ones((1, 2), bool))
    assert vl.sum.dtype == jnp.float32
    # fractional returns are not truncated: 0.5 * ((0.1 - 0.7)^2 + (0.2 - 1.5)^2) / 2 with v unclipped
    v_bf = np.asarray(bf([[0.1, 0.2]]), np.float64)
    want = 0.25 * ((v_bf[0, 0] - 0.7) ** 2 + (v_bf[0, 1] - 1.5) ** 2)
    assert float(Lo.weighted_mean(vl)) == pytest.approx(want, rel=1e-5)
