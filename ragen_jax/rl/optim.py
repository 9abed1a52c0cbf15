"""Optimizers of the actor and the critic: global-norm clipping then AdamW, constant learning rate.

RAGEN-2 / verl: AdamW (betas 0.9 / 0.999, eps 1e-8, weight decay 0.01), gradient clipping at global
norm 1.0, constant schedule without warmup; actor lr 1e-6, critic lr 1e-5 (RAGEN's ``config/base.yaml``).

Float hygiene: every hyperparameter is a float32 entry of the
optimizer state (``optax.inject_hyperparams(..., hyperparam_dtype=float32)``), so the learning rate is
logged and checkpointed with the state and a bfloat16 model never rounds it; the AdamW moments are
float32 whatever the parameter dtype (gradients and parameters are cast to float32 before the
optimizer sees them; ``optax.apply_updates`` casts the float32 updates back to each parameter's dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

ADAM_EPS = 1e-8  # torch.optim.AdamW / verl default


def _to_f32(tree):
    return jax.tree.map(lambda x: None if x is None else jnp.asarray(x, jnp.float32), tree,
                        is_leaf=lambda x: x is None)


def in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run ``tx`` on float32 copies of the gradients and parameters (so its state is float32)."""

    def init(params):
        return tx.init(_to_f32(params))

    def update(updates, state, params=None):
        return tx.update(_to_f32(updates), state, None if params is None else _to_f32(params))

    return optax.GradientTransformation(init, update)


def _clipped_adamw(learning_rate, b1, b2, weight_decay, grad_clip) -> optax.GradientTransformation:
    # g <- g * min(1, grad_clip / ||g||_2);  then AdamW:
    # m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
    return in_float32(optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(learning_rate, b1=b1, b2=b2, eps=ADAM_EPS, weight_decay=weight_decay),
    ))


def make_optimizer(
    lr: float,
    b1: float = 0.9,
    b2: float = 0.999,
    weight_decay: float = 0.01,
    grad_clip: float = 1.0,
) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) then AdamW(lr, b1, b2, eps=1e-8, weight_decay), constant lr.

    The returned transformation's state is an ``optax.InjectHyperparamsState``: read the learning rate
    as ``learning_rate(opt_state)`` (float32). Raises ValueError for settings optax would silently
    accept but that cannot train (non-positive lr or grad_clip, betas outside [0, 1)).
    """
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}; set optim.actor_lr / optim.critic_lr.")
    if not grad_clip > 0:
        raise ValueError(f"grad_clip must be > 0, got {grad_clip}; set optim.grad_clip (RAGEN: 1.0).")
    for name, beta in (("b1", b1), ("b2", b2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}; set optim.{name}.")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}; set optim.weight_decay.")
    factory = optax.inject_hyperparams(_clipped_adamw, hyperparam_dtype=jnp.float32)
    return factory(learning_rate=lr, b1=b1, b2=b2, weight_decay=weight_decay, grad_clip=grad_clip)


def learning_rate(opt_state) -> jax.Array:
    """The float32 learning rate held in a ``make_optimizer`` state (0.0 for other optimizers)."""
    hyper = getattr(opt_state, "hyperparams", None)
    if hyper is None or "learning_rate" not in hyper:
        return jnp.zeros((), jnp.float32)
    return jnp.asarray(hyper["learning_rate"], jnp.float32)


__all__ = ["make_optimizer", "in_float32", "learning_rate", "ADAM_EPS"]
