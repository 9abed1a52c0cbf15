"""Gradient decomposition: buckets as RAGEN splits them, per-term norms against hand-derived gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.diagnostics import gradients as Gr
from ragen_jax.rl.losses import ActorLossConfig, token_entropy


# ---------------------------------------------------------------- buckets
def sizes(buckets):
    return {k: int(v.sum()) for k, v in buckets.items()}


def test_quantile_buckets_follow_ragen():
    std = np.array([0.5, 0.1, 0.9, 0.0, 0.3, 0.7, 0.2, 0.8])
    b = Gr.bucket_groups(std, 6, "quantile")
    # 8 // 6 = 1 per bucket, remainder 2 to the last one; ascending std
    assert sizes(b) == {"all": 8, "bucket_1": 1, "bucket_2": 1, "bucket_3": 1, "bucket_4": 1, "bucket_5": 1, "bucket_6": 3}
    assert np.flatnonzero(b["bucket_1"]).tolist() == [3]
    assert np.flatnonzero(b["bucket_5"]).tolist() == [0]
    assert sorted(np.flatnonzero(b["bucket_6"]).tolist()) == [2, 5, 7]
    few = Gr.bucket_groups(std[:4], 6)  # fewer groups than buckets: all land in the last bucket
    assert sizes(few) == {"all": 4, "bucket_6": 4}
    ties = Gr.bucket_groups(np.zeros(6), 3)  # stable order among equal std
    assert [np.flatnonzero(ties[f"bucket_{i}"]).tolist() for i in (1, 2, 3)] == [[0, 1], [2, 3], [4, 5]]


def test_fixed_rv_buckets_and_group_std():
    b = Gr.bucket_groups(np.array([0.0, 0.99, 1.0, 4.5, 5.0, 12.0]), mode="fixed_rv")
    assert sizes(b) == {"all": 6, "bucket_1": 2, "bucket_2": 1, "bucket_5": 1, "bucket_6": 2}
    unique, std = Gr.per_group_reward_std(np.array([7, 7, 3, 3, 9]), np.array([0.5, 0.5, 0.2, 0.2, 1.0]))
    assert unique.tolist() == [3, 7, 9] and np.allclose(std, [0.2, 0.5, 1.0])
    with pytest.raises(ValueError, match="quantile"):
        Gr.GradientAnalysisConfig(bucket_mode="percentile")


# ---------------------------------------------------------------- toy linear softmax policy
G, S, L, D, V = 6, 2, 5, 4, 6
B = G * S


def toy_logprob_fn(w, batch):
    logits = jnp.einsum("bld,dv->blv", batch["x"], w)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["tokens"][..., None], -1)[..., 0]
    return logp, token_entropy(logits)


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(D, V)) * 0.7
    x = rng.normal(size=(B, L, D))
    tokens = rng.integers(0, V, size=(B, L))
    mask = rng.random((B, L)) < 0.75
    mask[:, 0] = True
    logits = np.einsum("bld,dv->blv", x, w)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    tok_logp = np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    group_ids = np.repeat(np.arange(G), S)
    group_std = np.array([0.0, 2.0, 0.5, 1.5, 1.0, 3.0])
    adv = rng.normal(size=(B, 1)) * group_std[group_ids][:, None] * np.ones((1, L))
    batch = {
        "x": jnp.asarray(x, jnp.float32),
        "tokens": jnp.asarray(tokens, jnp.int32),
        # old log-probs within +-0.1 of the current ones keep every ratio inside the clip range
        "old_logp": jnp.asarray(tok_logp + rng.uniform(-0.1, 0.1, size=(B, L)), jnp.float32),
        "ref_logp": jnp.asarray(tok_logp + rng.uniform(-0.5, 0.5, size=(B, L)), jnp.float32),
        "advantages": jnp.asarray(adv, jnp.float32),
        "loss_mask": jnp.asarray(mask),
    }
    return dict(w=w, x=x, tokens=tokens, mask=mask, batch=batch, group_ids=group_ids,
                reward_std=group_std[group_ids], probs=np.exp(logp), tok_logp=tok_logp)


def numpy_term_grads(t, rows, coef_h, coef_kl):
    """Hand-derived gradients of the three token-mean terms w.r.t. w, over the given rows (float64)."""
    m = t["mask"] & rows[:, None]
    n = m.sum()
    p, x = t["probs"], t["x"]
    onehot = np.eye(V)[t["tokens"]]
    dlogp_dz = onehot - p  # d log p(token) / d logits
    old = np.asarray(t["batch"]["old_logp"], np.float64)
    ref = np.asarray(t["batch"]["ref_logp"], np.float64)
    adv = np.asarray(t["batch"]["advantages"], np.float64)
    ratio = np.exp(t["tok_logp"] - old)
    ent = -(p * np.log(p)).sum(-1)
    # task: mean(-A rho) -> d/dz = -A rho dlogp/dz
    g_task = -(adv * ratio * m)[..., None] * dlogp_dz
    # entropy term -c * mean(H): dH/dz = -p (log p + H)
    g_ent = -coef_h * m[..., None] * (-p * (np.log(p) + ent[..., None]))
    # k3 = e^(ref - logp) - (ref - logp) - 1 -> d/dlogp = 1 - e^(ref - logp)
    g_kl = coef_kl * (m * (1.0 - np.exp(ref - t["tok_logp"])))[..., None] * dlogp_dz
    to_w = lambda gz: np.einsum("bld,blv->dv", x, gz) / n
    losses = {
        "policy": (-adv * ratio * m).sum() / n,
        "entropy": -coef_h * (ent * m).sum() / n,
        "kl": coef_kl * ((np.exp(ref - t["tok_logp"]) - (ref - t["tok_logp"]) - 1) * m).sum() / n,
    }
    return {"task": to_w(g_task), "entropy": to_w(g_ent), "kl": to_w(g_kl)}, losses, n


def test_decomposition_matches_hand_derived_gradients(toy):
    config = Gr.GradientAnalysisConfig(
        num_buckets=3, loss=ActorLossConfig(entropy_coeff=0.05, use_kl_loss=True, kl_coef=0.2, kl_type="low_var_kl")
    )
    traces = {"n": 0}

    def counted(w, batch):
        traces["n"] += 1
        return toy_logprob_fn(w, batch)

    fn = Gr.make_component_grad_norms(counted, config)
    metrics = Gr.gradient_decomposition(
        jnp.asarray(toy["w"], jnp.float32), toy["batch"], toy["group_ids"], toy["reward_std"],
        config=config, grad_norms_fn=fn,
    )
    # buckets by group std ascending: {0.0, 0.5}, {1.0, 1.5}, {2.0, 3.0}
    expected_groups = {"all": range(G), "bucket_1": [0, 2], "bucket_2": [4, 3], "bucket_3": [1, 5]}
    for name, groups in expected_groups.items():
        rows = np.isin(toy["group_ids"], list(groups))
        grads, losses, n_tok = numpy_term_grads(toy, rows, 0.05, 0.2)
        key = f"grad_norm/{name}"
        assert metrics[f"{key}/sample_count"] == rows.sum()
        assert metrics[f"{key}/sample_pct"] == pytest.approx(rows.sum() / B)
        assert metrics[f"{key}/reward_std_mean"] == pytest.approx(toy["reward_std"][rows].mean())
        assert metrics[f"{key}/reward_std_min"] == pytest.approx(toy["reward_std"][rows].min())
        assert metrics[f"{key}/reward_std_max"] == pytest.approx(toy["reward_std"][rows].max())
        for comp, g in grads.items():
            norm = np.sqrt((g**2).sum())
            assert metrics[f"{key}/{comp}"] == pytest.approx(norm, rel=1e-4), (name, comp)
            assert metrics[f"{key}/per_sample/{comp}"] == pytest.approx(norm / rows.sum(), rel=1e-4)
            assert metrics[f"{key}/per_token/{comp}"] == pytest.approx(norm / n_tok, rel=1e-4)
        for loss_name, value in losses.items():
            assert metrics[f"{key}/loss/{loss_name}"] == pytest.approx(value, rel=1e-4, abs=1e-7)
        total = sum(losses.values())
        assert metrics[f"{key}/loss/total"] == pytest.approx(total, rel=1e-4, abs=1e-7)
    # the zero-std bucket's groups carry no task signal in group 0; higher-std buckets carry more
    assert metrics["grad_norm/bucket_3/task"] > metrics["grad_norm/bucket_1/task"]
    # one trace for four buckets (row masks over a static-shape batch): the policy is called once per
    # component gradient plus once for the loss values, all inside a single compile
    assert traces["n"] == len(config.components) + 1


def test_inactive_components_are_not_reported(toy):
    config = Gr.GradientAnalysisConfig(num_buckets=2, loss=ActorLossConfig(entropy_coeff=0.0))
    assert config.components == ("task",)
    metrics = Gr.gradient_decomposition(
        jnp.asarray(toy["w"], jnp.float32), toy["batch"], toy["group_ids"], toy["reward_std"],
        logprob_fn=toy_logprob_fn, config=config,
    )
    assert "grad_norm/all/task" in metrics
    assert not any(k.endswith("/entropy") or k.endswith("/kl") for k in metrics if "/loss/" not in k)
    with pytest.raises(ValueError, match="logprob_fn"):
        Gr.gradient_decomposition(toy["w"], toy["batch"], toy["group_ids"], toy["reward_std"])


# ---------------------------------------------------------------- the real (tiny) transformer
@pytest.mark.slow  # one transformer gradient compile: ~30 s of CPU
def test_runs_on_tiny_transformer():
    from flax import nnx

    from ragen_jax.models.config import get_preset
    from ragen_jax.models.logprobs import sequence_logprobs
    from ragen_jax.models.transformer import Transformer

    cfg = get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=32, vocab_size=40)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def logprob_fn(params, batch):
        model = nnx.merge(graphdef, params)
        return sequence_logprobs(model, batch["tokens"], batch["valid"])

    rng = np.random.default_rng(1)
    b, t = 8, 10
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(b, t)), jnp.int32)
    valid = jnp.ones((b, t), bool)
    loss_mask = jnp.asarray(np.arange(t)[None, :] >= 4).repeat(b, 0)  # "assistant" tokens: the tail
    logp, _ = logprob_fn(state, {"tokens": tokens, "valid": valid})
    group_ids = np.repeat(np.arange(4), 2)
    reward_std = np.array([0.0, 0.5, 1.0, 2.0])[group_ids]
    batch = {
        "tokens": tokens, "valid": valid, "loss_mask": loss_mask,
        "old_logp": logp, "ref_logp": logp - 0.05,
        "advantages": jnp.asarray(rng.normal(size=(b, 1)) * reward_std[:, None] * np.ones((1, t)), jnp.float32),
    }
    config = Gr.GradientAnalysisConfig(num_buckets=2)
    fn = Gr.make_component_grad_norms(logprob_fn, config)
    metrics = Gr.gradient_decomposition(state, batch, group_ids, reward_std, config=config, grad_norms_fn=fn)
    for name in ("all", "bucket_1", "bucket_2"):
        for comp in ("task", "entropy", "kl"):
            assert math.isfinite(metrics[f"grad_norm/{name}/{comp}"]) and metrics[f"grad_norm/{name}/{comp}"] > 0
    # the masked-bucket path equals a direct gradient on the gathered rows of bucket_2 (groups 2, 3);
    # the 4 gathered rows are repeated twice to reuse the compile (a token mean is unchanged by that)
    rows = np.tile(np.flatnonzero(np.isin(group_ids, [2, 3])), 2)
    sub = {k: v[rows] for k, v in batch.items()}
    direct = jax.device_get(fn(state, sub, jnp.ones(len(rows), bool)))
    for comp in ("task", "entropy", "kl"):
        assert metrics[f"grad_norm/bucket_2/{comp}"] == pytest.approx(float(direct[comp]), rel=1e-4)
