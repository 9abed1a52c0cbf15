"""Per-token log-probabilities and entropies from hidden states, chunked over the sequence.

The sampler and the trainer both call ``logprobs_from_logits`` on float32 logits divided by the same
temperature, so the log-probs a rollout stores and the ones the trainer recomputes are the same
numbers up to float rounding of the two forward passes.

For large vocabularies ``chunked_token_logprobs`` never builds the full [B, L, V] logits: it maps over
blocks of ``chunk`` positions, each materialising only [B, chunk, V].
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def logprobs_from_logits(
    logits: jax.Array, targets: jax.Array, temperature: jax.Array | float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """log p(target) and the full-vocabulary entropy under softmax(logits / temperature).

    logits: f32[..., V]; targets: int32[...]. Returns (logp f32[...], entropy f32[...]).
    logp = z_target - logsumexp(z);  H = logsumexp(z) - sum_v softmax(z)_v z_v,  z = logits / T.
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    target_z = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jnp.exp(z - lse[..., None])
    entropy = lse - jnp.sum(probs * z, axis=-1)
    return target_z - lse, entropy


def chunked_token_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    lm_logits: Callable[[jax.Array], jax.Array],
    temperature: jax.Array | float = 1.0,
    chunk: int = 128,
) -> tuple[jax.Array, jax.Array]:
    """``logprobs_from_logits(lm_logits(hidden), targets)`` computed ``chunk`` positions at a time.

    hidden: [B, L, d] final hidden states; targets: int32[B, L] (the token each position predicts).
    Returns (logp f32[B, L], entropy f32[B, L]). L need not be a multiple of ``chunk``.
    """
    b, length, d = hidden.shape
    if length <= chunk:
        return logprobs_from_logits(lm_logits(hidden), targets, temperature)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    hidden_p = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets_p = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden_c = hidden_p.reshape(b, n_chunks, chunk, d).swapaxes(0, 1)
    targets_c = targets_p.reshape(b, n_chunks, chunk).swapaxes(0, 1)

    # Rematerialise each chunk's logits in the backward pass; otherwise autodiff keeps every
    # [B, chunk, V] block alive and the chunking saves no memory when training.
    @jax.checkpoint
    def one_chunk(args):
        h, t = args
        return logprobs_from_logits(lm_logits(h), t, temperature)

    logp, entropy = jax.lax.map(one_chunk, (hidden_c, targets_c))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :length]
    return unchunk(logp), unchunk(entropy)


def sequence_logprobs(
    model, tokens: jax.Array, valid: jax.Array, temperature: jax.Array | float = 1.0, chunk: int = 128,
    remat: bool = False, segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced next-token log-probs of whole sequences that may contain padding anywhere.

    tokens: int32[B, L]; valid: bool[B, L]. Returns (logp, entropy), both f32[B, L]:
    logp[b, t] = log p(tokens[b, t] | the valid tokens of row b before t), predicted from the hidden
    state of the previous *valid* position (so holes left by padding are skipped, exactly as in the
    KV-cache path). Zero where t is padding or the first valid token of its row. remat (static): see
    ``Transformer.__call__`` (for gradients through this function; same values). segments: int32[B, L]
    or None, sequences packed into the rows (``Transformer.__call__``): "row" above then reads "sequence".
    """
    packed = {} if segments is None else {"segments": segments}  # a model without packing support still works
    hidden, _ = model(tokens, valid, return_hidden=True, remat=remat, **packed)
    length = tokens.shape[1]
    index = jnp.arange(length)
    last_valid = jax.lax.cummax(jnp.where(valid, index, -1), axis=1)
    prev = jnp.concatenate([jnp.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], axis=1)
    hidden_prev = jnp.take_along_axis(hidden, jnp.maximum(prev, 0)[..., None], axis=1)
    logp, entropy = chunked_token_logprobs(hidden_prev, tokens, model.lm_logits, temperature, chunk)
    scored = valid & (prev >= 0)
    if segments is not None:  # a sequence's first token is not predicted from the one packed before it
        scored = scored & (jnp.take_along_axis(segments, jnp.maximum(prev, 0), axis=1) == segments)
    return jnp.where(scored, logp, 0.0), jnp.where(scored, entropy, 0.0)
