"""The critic (value positions, copy from the actor) and the optimizer (against torch.optim.AdamW)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from ragen_jax.models.critic import Critic, previous_valid_index
from ragen_jax.models.config import get_preset
from ragen_jax.models.transformer import Transformer
from ragen_jax.rl.optim import make_optimizer, learning_rate


def tiny_cfg(**kw):
    return get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, **kw)


@pytest.fixture(scope="module")
def actor():
    return Transformer(tiny_cfg(), rngs=nnx.Rngs(0))


def test_previous_valid_index_python_reference():
    valid = np.array([[1, 1, 0, 1, 0, 1], [0, 0, 1, 1, 1, 0]], bool)
    expected = np.full(valid.shape, -1)
    for b in range(2):
        for t in range(valid.shape[1]):
            before = [s for s in range(t) if valid[b, s]]
            expected[b, t] = before[-1] if before else -1
    np.testing.assert_array_equal(np.asarray(previous_valid_index(jnp.asarray(valid))), expected)


def test_from_actor_copies_backbone_and_zeroes_head(actor):
    critic = Critic.from_actor(actor, nnx.Rngs(5))
    a = jax.tree.leaves(nnx.state(actor, nnx.Param))
    c = jax.tree.leaves(nnx.state(critic.backbone, nnx.Param))
    assert len(a) == len(c) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, c))
    tokens = jnp.arange(10, 22, dtype=jnp.int32).reshape(2, 6)
    np.testing.assert_array_equal(np.asarray(critic(tokens, jnp.ones((2, 6), bool))), 0.0)
    # Its own weights: changing the critic leaves the actor alone.
    critic.backbone.embed.embedding.set_value(critic.backbone.embed.embedding[...] + 1.0)
    assert not np.array_equal(np.asarray(actor.embed.embedding[...]), np.asarray(critic.backbone.embed.embedding[...]))


def test_untied_critic_drops_the_lm_head():
    actor = Transformer(tiny_cfg(tie_embeddings=False), rngs=nnx.Rngs(0))
    critic = Critic.from_actor(actor, nnx.Rngs(1))
    assert not hasattr(critic.backbone, "lm_head")
    np.testing.assert_array_equal(np.asarray(critic.backbone.final_norm.weight[...]),
                                  np.asarray(actor.final_norm.weight[...]))


def test_values_use_the_previous_valid_position(actor):
    """verl: the value paired with token t is the head on the hidden state before t (numpy reference)."""
    critic = Critic.from_actor(actor, nnx.Rngs(1))
    w = np.random.default_rng(0).normal(size=(64, 1)).astype(np.float32)
    critic.value_head.kernel.set_value(jnp.asarray(w))
    critic.value_head.bias.set_value(jnp.asarray([0.25], jnp.float32))
    rng = np.random.default_rng(1)
    tokens = rng.integers(8, 264, (3, 9)).astype(np.int32)
    valid = np.array([[1] * 9, [1, 1, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1]], bool)
    values = np.asarray(critic(jnp.asarray(tokens), jnp.asarray(valid)))
    hidden = np.asarray(actor(jnp.asarray(tokens), jnp.asarray(valid), return_hidden=True)[0], np.float64)
    for b in range(3):
        for t in range(9):
            before = [s for s in range(t) if valid[b, s]]
            expected = hidden[b, before[-1]] @ w[:, 0] + 0.25 if (valid[b, t] and before) else 0.0
            np.testing.assert_allclose(values[b, t], expected, rtol=1e-5, atol=1e-5, err_msg=f"{b},{t}")


def test_adamw_with_clipping_matches_torch():
    """Three steps of clip_by_global_norm(1.0) + AdamW against torch's clip_grad_norm_ + AdamW."""
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = [{k: (rng.normal(size=v.shape) * scale).astype(np.float32) for k, v in params.items()}
             for scale in (3.0, 0.05, 1.0)]
    lr, wd = 1e-2, 0.01
    tx = make_optimizer(lr, 0.9, 0.999, wd, 1.0)
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    update = jax.jit(tx.update)
    for g in grads:
        u, state = update(jax.tree.map(jnp.asarray, g), state, p)
        p = jax.tree.map(lambda x, y: x + y, p, u)

    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = torch.optim.AdamW(list(tp.values()), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for g in grads:
        for k, t in tp.items():
            t.grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 1.0)
        opt.step()
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), tp[k].detach().numpy(), rtol=1e-6, atol=1e-7)


def test_optimizer_state_and_lr_are_float32_for_bfloat16_params():
    tx = make_optimizer(1e-6)
    params = {"w": jnp.ones((3, 2), jnp.bfloat16)}
    state = tx.init(params)
    assert learning_rate(state).dtype == jnp.float32
    np.testing.assert_allclose(float(learning_rate(state)), 1e-6, rtol=1e-7)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))
    u, state = tx.update({"w": jnp.full((3, 2), 0.5, jnp.bfloat16)}, state, params)
    import optax

    new = optax.apply_updates(params, u)
    assert new["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs,match", [({"lr": 0.0}, "actor_lr"), ({"lr": 1e-6, "grad_clip": 0.0}, "grad_clip"),
                                          ({"lr": 1e-6, "b2": 1.0}, "b2")])
def test_bad_optimizer_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(**kwargs)
