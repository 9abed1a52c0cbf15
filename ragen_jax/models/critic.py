"""The PPO critic: a separate copy of the decoder with a scalar value head.

RAGEN-2 (verl) trains the critic as a full copy of the base model (``AutoModelForTokenClassification``
with one label: the backbone plus a Linear(d, 1) ``score`` head), initialised from the same checkpoint
as the actor. Here: ``Critic.backbone`` is a ``Transformer`` with the actor's ``ModelConfig`` (its own
weights; an untied LM head is dropped because the critic never produces logits) and ``value_head`` is
Linear(d, 1) with bias, evaluated in float32.

Which position's value is used (verl ``dp_critic._forward_micro_batch``): the critic runs over
prompt + response and keeps ``values[:, -response_length - 1 : -1]``, i.e. the value paired with
response token t is the head's output at position t - 1: the value of the state *before* token t is
generated (the same hidden state that predicts token t in the actor). ``Critic.__call__`` follows that
convention on sequences with padding anywhere (as ``sequence_logprobs`` does): values[b, t] is the head
on the hidden state of the previous *valid* position of row b, 0 where t is padding or the row's first
valid token. So GAE at a loss token t uses V(s_t) with s_t = the tokens before t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.config import ModelConfig
from ragen_jax.models.transformer import Transformer


def previous_valid_index(valid: jax.Array) -> jax.Array:
    """For each position, the index of the previous valid position of its row, -1 if none.

    valid: bool[B, L] -> int32[B, L]; prev[b, t] = max{s < t : valid[b, s]} (or -1).
    """
    length = valid.shape[1]
    index = jnp.arange(length, dtype=jnp.int32)
    last_valid = jax.lax.cummax(jnp.where(valid, index, -1), axis=1)
    return jnp.concatenate([jnp.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], axis=1)


class Critic(nnx.Module):
    """Decoder backbone + scalar value head.  ``critic(tokens, valid) -> values f32[B, L]``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.backbone = Transformer(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            del self.backbone.lm_head  # the critic never computes logits; no weights, no optimizer state
        self.value_head = nnx.Linear(
            cfg.hidden_size, 1, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32,
            kernel_init=nnx.initializers.normal(0.02), rngs=rngs,
        )

    @classmethod
    def from_actor(cls, actor: Transformer, rngs: nnx.Rngs) -> "Critic":
        """A critic whose backbone is a copy of the actor's weights and whose head is zero.

        RAGEN initialises the critic from the same base checkpoint as the actor; a zero head makes the
        initial values exactly 0 (so the first GAE advantages are the plain returns). The copy owns
        its arrays: updating the critic never touches the actor.
        """
        critic = cls(actor.cfg, rngs)
        actor_params = nnx.state(actor, nnx.Param)
        backbone_params = nnx.state(critic.backbone, nnx.Param)
        copied = jax.tree.map(lambda a: jnp.array(a, copy=True), actor_params)
        if not actor.cfg.tie_embeddings:
            copied.pop("lm_head")
        if jax.tree.structure(copied) != jax.tree.structure(backbone_params):
            raise ValueError("actor and critic backbones differ in structure; build both from one ModelConfig.")
        nnx.update(critic.backbone, copied)
        critic.value_head.kernel.set_value(jnp.zeros_like(critic.value_head.kernel[...]))
        critic.value_head.bias.set_value(jnp.zeros_like(critic.value_head.bias[...]))
        return critic

    def state_values(self, tokens: jax.Array, valid: jax.Array, remat: bool = False,
                     segments: jax.Array | None = None) -> jax.Array:
        """Value of the state after reading each token: head(hidden_t). tokens int32[B, L] -> f32[B, L].
        remat (static), segments (packed sequences): see ``Transformer.__call__``."""
        hidden, _ = self.backbone(tokens, valid, return_hidden=True, remat=remat, segments=segments)
        return self.value_head(hidden.astype(jnp.float32))[..., 0]

    def __call__(self, tokens: jax.Array, valid: jax.Array, remat: bool = False,
                 segments: jax.Array | None = None) -> jax.Array:
        """verl-aligned values: values[b, t] = state_values[b, prev_valid(t)], 0 where there is none
        (or, with ``segments``, where the previous valid position belongs to another sequence).

        tokens: int32[B, L]; valid: bool[B, L]. Returns f32[B, L] (see the module docstring).
        """
        valid = valid.astype(bool)
        per_state = self.state_values(tokens, valid, remat, segments)
        prev = previous_valid_index(valid)
        aligned = jnp.take_along_axis(per_state, jnp.maximum(prev, 0), axis=1)
        scored = valid & (prev >= 0)
        if segments is not None:
            scored = scored & (jnp.take_along_axis(segments, jnp.maximum(prev, 0), axis=1) == segments)
        return jnp.where(scored, aligned, 0.0)


__all__ = ["Critic", "previous_valid_index"]
