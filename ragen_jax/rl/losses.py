"""Policy and value losses as (sum, count) pairs: PPO clip (clip-higher + dual clip), entropy, KL.

Semantics follow verl ``core_algos.py`` (``compute_policy_loss_vanilla``, ``agg_loss``,
``kl_penalty``, ``compute_value_loss``) and RAGEN's actor (``ragen/workers/actor/dp_actor.py::update_policy``):
    total = L_pg - entropy_coeff * agg(H) + kl_coef * agg(KL(logp, ref_logp)).

The (sum, count) convention: every loss returns ``Weighted(sum, count)`` with loss = sum / count, where
count is chosen per aggregation mode so that sum_total / count_total over micro-batches (and devices)
equals the loss of the whole batch exactly:
  token-mean               sum of masked token losses            / number of loss tokens
  seq-mean-token-mean      sum over sequences of their token mean / sequences with >= 1 loss token
  seq-mean-token-sum       sum over sequences of their token sum  / number of sequences
  seq-mean-token-sum-norm  sum of masked token losses            / (number of sequences * norm_length)
For seq-mean-token-sum-norm verl divides each micro-batch's token sum by a constant (the response
width) and then averages micro-batches, which makes its value depend on the micro-batch size; the form
here is Dr.GRPO's sum / (num_sequences * horizon), equal to verl's at micro-batch size 1 (RAGEN's
base setting). "Sequences" are rows with ``sequence_mask`` True (default: every row), so padding rows
added to fill a mini-batch can be excluded from the denominators.

Accumulate with ``jax.tree.map(jnp.add, ...)`` and divide once with ``weighted_mean``; for gradients,
differentiate ``micro.sum / global_count`` per micro-batch and add the gradients.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ragen_jax.models.attention import segment_starts

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# verl's names and the short names used in papers / tunix.
_KL_ALIASES = {"k1": "kl", "k2": "mse", "mse_kl": "mse", "k3": "low_var_kl"}
KL_TYPES = ("kl", "abs", "mse", "low_var_kl")
LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi / pi_old) and the k3 log-ratio to +-20 before exp
LOW_VAR_KL_CLAMP = 10.0  # verl clamps the k3 estimate to [-10, 10]


class Weighted(NamedTuple):
    """A loss or metric as an unreduced pair: value = sum / count (both f32[]). A pytree."""

    sum: jax.Array
    count: jax.Array


def weighted_mean(w: Weighted) -> jax.Array:
    """sum / count, and 0 when count is 0 (an empty micro-batch contributes nothing)."""
    return jnp.where(w.count > 0, w.sum / jnp.where(w.count > 0, w.count, 1.0), 0.0)


def accumulate(*parts: Weighted) -> Weighted:
    """Add (sum, count) pairs (or pytrees of them, e.g. aux dicts) from micro-batches / devices."""
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def aggregate(
    loss_mat: jax.Array,
    mask: jax.Array,
    mode: str = "token-mean",
    norm_length: float | None = None,
    sequence_mask: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> Weighted:
    """Aggregate per-token losses f32[B, L] over loss tokens ``mask`` bool[B, L] (see module doc).

    mode (static) is one of AGG_MODES; norm_length (static, default L) is the seq-mean-token-sum-norm
    horizon; sequence_mask bool[B] selects the rows that count as sequences (default all rows).
    Tokens of rows outside ``sequence_mask`` are ignored in every mode. segments int32[B, L]: several
    sequences packed into each row (contiguous runs of one id, 0 = padding, ``rl/packing.py``); the
    sequences are then those runs instead of the rows (and ``sequence_mask`` must be None).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode {mode!r}; expected one of {AGG_MODES}.")
    if segments is not None:
        if sequence_mask is not None:
            raise ValueError("aggregate: pass sequence_mask (rows as sequences) or segments (packed rows), not both")
        return _aggregate_packed(_f32(loss_mat), jnp.asarray(mask, bool), mode, norm_length, segments)
    x = _f32(loss_mat)
    m = jnp.asarray(mask, bool)
    if sequence_mask is not None:
        m = m & jnp.asarray(sequence_mask, bool)[:, None]
        rows = _f32(sequence_mask)
    else:
        rows = jnp.ones(x.shape[0], jnp.float32)
    mf = _f32(m)
    masked = jnp.where(m, x, 0.0)  # where, not multiply: a NaN/inf on a padding token stays out
    if mode == "token-mean":
        return Weighted(jnp.sum(masked), jnp.sum(mf))
    token_sums = jnp.sum(masked, axis=-1)
    if mode == "seq-mean-token-mean":
        n_tok = jnp.sum(mf, axis=-1)
        has_tok = n_tok > 0
        seq_means = jnp.where(has_tok, token_sums / jnp.where(has_tok, n_tok, 1.0), 0.0)
        return Weighted(jnp.sum(seq_means), jnp.sum(_f32(has_tok)))
    if mode == "seq-mean-token-sum":
        return Weighted(jnp.sum(token_sums), jnp.sum(rows))
    horizon = float(x.shape[-1] if norm_length is None else norm_length)
    return Weighted(jnp.sum(token_sums), jnp.sum(rows) * horizon)


def _aggregate_packed(x: jax.Array, m: jax.Array, mode: str, norm_length: float | None,
                      segments: jax.Array) -> Weighted:
    """``aggregate`` over the sequences packed into rows: the same pairs, summed in another order.

    Sequences are the runs of one non-zero id in ``segments``; a sequence's token mean divides each of
    its loss tokens by its loss-token count n_s, read at every token from running counts (exact: they
    are small integers).
    """
    masked = jnp.where(m, x, 0.0)
    starts = segment_starts(segments)
    ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(m[:, :1])], axis=1)  # the next position starts a run
    first = starts & (segments != 0)  # one per sequence
    if mode == "token-mean":
        return Weighted(jnp.sum(masked), jnp.sum(_f32(m)))
    if mode == "seq-mean-token-mean":
        counted = jnp.cumsum(m, axis=1, dtype=jnp.int32)
        before = jax.lax.cummax(jnp.where(starts, counted - m.astype(jnp.int32), 0), axis=1)
        through = jax.lax.cummin(jnp.where(ends, counted, jnp.iinfo(jnp.int32).max), axis=1, reverse=True)
        n_tok = _f32(through - before)  # loss tokens of the position's sequence
        per_token = jnp.where(m, masked / jnp.where(n_tok > 0, n_tok, 1.0), 0.0)
        return Weighted(jnp.sum(per_token), jnp.sum(_f32(first & (n_tok > 0))))
    sequences = jnp.sum(_f32(first))
    if mode == "seq-mean-token-sum":
        return Weighted(jnp.sum(masked), sequences)
    horizon = float(x.shape[-1] if norm_length is None else norm_length)
    return Weighted(jnp.sum(masked), sequences * horizon)


def token_entropy(logits: jax.Array) -> jax.Array:
    """Full-vocabulary entropy of softmax(logits): f32[..., V] -> f32[...].

    H = logsumexp(z) - sum_v softmax(z)_v z_v, computed in float32 from the max-shifted logits (stable
    for any logit scale). For long sequences and big vocabularies use the model's chunked path,
    ``ragen_jax.models.logprobs.chunked_token_logprobs``, which returns (logp, entropy) from hidden
    states without materialising [B, L, V].
    """
    z = _f32(logits)
    z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = jax.nn.logsumexp(z, axis=-1)
    p = jnp.exp(z - lse[..., None])
    return lse - jnp.sum(p * z, axis=-1)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "kl") -> jax.Array:
    """Per-token KL estimate between the policy and the reference, from sampled-token log-probs.

    kind (static): "kl" (k1) = logp - ref; "abs" = |logp - ref|; "mse" (k2) = 0.5 (logp - ref)^2;
    "low_var_kl" (k3) = exp(d) - d - 1 with d = clamp(ref - logp, +-20), then clamped to [-10, 10].
    f32[B, L] each.
    """
    kind = _KL_ALIASES.get(kind, kind)
    if kind not in KL_TYPES:
        hint = " (did you mean 'low_var_kl'?)" if kind.replace("-", "_") == "low_var_kl" else ""
        raise ValueError(
            f"Unknown KL type {kind!r}{hint}; expected one of {KL_TYPES} or aliases {sorted(_KL_ALIASES)}."
        )
    lp, ref = _f32(logp), _f32(ref_logp)
    if kind == "kl":
        return lp - ref
    if kind == "abs":
        return jnp.abs(lp - ref)
    if kind == "mse":
        return 0.5 * jnp.square(lp - ref)
    d = jnp.clip(ref - lp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def _token_mean(x: jax.Array, m: jax.Array) -> Weighted:
    return Weighted(jnp.sum(jnp.where(m, _f32(x), 0.0)), jnp.sum(_f32(m)))


def ppo_token_losses(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float = 3.0,
) -> dict[str, jax.Array]:
    """Per-token PPO terms (verl ``compute_policy_loss_vanilla``), each f32[B, L].

    log_ratio = clamp(logp - old_logp, +-20);  rho = exp(log_ratio)
    l1 = -A rho;  l2 = -A clip(rho, 1 - clip_low, 1 + clip_high);  l_clip = max(l1, l2)
    dual clip (A < 0 only): l = min(l_clip, -A * clip_c);  l = l_clip for A >= 0.
    Also returns bool indicator maps for the metrics: clipped (l2 > l1, verl's pg_clipfrac),
    clipped_upper (A > 0 and rho > 1 + clip_high), clipped_lower (A < 0 and rho < 1 - clip_low),
    dual (A < 0 and l_clip > -A * clip_c, verl's pg_clipfrac_lower), and the log ratio.
    """
    if not clip_c > 1.0:
        raise ValueError(f"clip_c (dual-clip ratio c) must be > 1.0, got {clip_c}.")
    a = _f32(advantages)
    log_ratio = jnp.clip(_f32(logp) - _f32(old_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    l1 = -a * ratio
    l2 = -a * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    l_clip = jnp.maximum(l1, l2)
    l3 = -a * clip_c
    negative = a < 0
    loss = jnp.where(negative, jnp.minimum(l_clip, l3), l_clip)
    return {
        "loss": loss,
        "log_ratio": log_ratio,
        "clipped": l2 > l1,
        "clipped_upper": (a > 0) & (ratio > 1.0 + clip_high),
        "clipped_lower": negative & (ratio < 1.0 - clip_low),
        "dual": negative & (l_clip > l3),
    }


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float = 3.0,
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
    sequence_mask: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> tuple[Weighted, dict[str, Weighted]]:
    """PPO clipped policy loss with clip-higher and dual clip, aggregated by ``agg_mode``.

    logp, old_logp, advantages: f32[B, L]; mask: bool[B, L]; segments: packed sequences (``aggregate``).
    Returns (loss, aux) where aux holds token-mean (sum, count) metrics: clipfrac (verl pg_clipfrac),
    clipfrac_upper, clipfrac_lower, clipfrac_dual (verl pg_clipfrac_lower), approx_kl (verl ppo_kl =
    mean(old_logp - logp)), ratio_mean, advantage_mean. GRPO and PPO use the same loss (they differ in
    advantages and mode).
    """
    terms = ppo_token_losses(logp, old_logp, advantages, clip_low, clip_high, clip_c)
    m = jnp.asarray(mask, bool)
    if sequence_mask is not None:
        m = m & jnp.asarray(sequence_mask, bool)[:, None]
    loss = aggregate(terms["loss"], m, agg_mode, norm_length, segments=segments)
    aux = {
        "clipfrac": _token_mean(terms["clipped"], m),
        "clipfrac_upper": _token_mean(terms["clipped_upper"], m),
        "clipfrac_lower": _token_mean(terms["clipped_lower"], m),
        "clipfrac_dual": _token_mean(terms["dual"], m),
        "approx_kl": _token_mean(-terms["log_ratio"], m),
        "ratio_mean": _token_mean(jnp.exp(terms["log_ratio"]), m),
        "advantage_mean": _token_mean(advantages, m),
    }
    return loss, aux


def value_loss(
    vpreds: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip_range_value: float = 0.5,
    agg_mode: str = "token-mean",
    norm_length: float | None = None,
    sequence_mask: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> tuple[Weighted, dict[str, Weighted]]:
    """Clipped value loss (verl ``compute_value_loss``), all f32[B, L] (segments: see ``aggregate``):

    v_clip = clip(vpreds, old_values - c, old_values + c)
    loss = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2)).
    aux: vf_clipfrac (token-mean of (v_clip - R)^2 > (vpreds - R)^2), vpred_mean.
    """
    v, old, ret = _f32(vpreds), _f32(old_values), _f32(returns)
    v_clip = jnp.clip(v, old - clip_range_value, old + clip_range_value)
    l1 = jnp.square(v - ret)
    l2 = jnp.square(v_clip - ret)
    m = jnp.asarray(mask, bool)
    if sequence_mask is not None:
        m = m & jnp.asarray(sequence_mask, bool)[:, None]
    agg = aggregate(0.5 * jnp.maximum(l1, l2), m, agg_mode, norm_length, segments=segments)
    aux = {"vf_clipfrac": _token_mean(l2 > l1, m), "vpred_mean": _token_mean(v, m)}
    return agg, aux


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
    """Static settings of the actor loss; defaults are RAGEN-2's ``config/base.yaml``."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0
    agg_mode: str = "token-mean"
    norm_length: float | None = None  # seq-mean-token-sum-norm horizon; None = the mask width L
    entropy_coeff: float = 0.001
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_type: str = "kl"

    def __post_init__(self):
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"Unknown loss_agg_mode {self.agg_mode!r}; expected one of {AGG_MODES}.")
        if not self.clip_c > 1.0:
            raise ValueError(f"clip_c (dual-clip ratio c) must be > 1.0, got {self.clip_c}.")
        kind = _KL_ALIASES.get(self.kl_type, self.kl_type)
        if kind not in KL_TYPES:
            raise ValueError(f"Unknown kl_type {self.kl_type!r}; expected one of {KL_TYPES}.")


def actor_loss_terms(
    logp: jax.Array,
    entropy: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: ActorLossConfig,
    ref_logp: jax.Array | None = None,
    sequence_mask: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> tuple[dict[str, Weighted], dict[str, Weighted]]:
    """The three separately-differentiable parts of the actor loss, each a Weighted pair:

    task    = PPO clipped policy loss (``policy_loss``);
    entropy = -entropy_coeff * agg(H)   (the bonus, as a loss term);
    kl      = kl_coef * agg(KL(logp, ref_logp))  (zero pair with count of the task term when KL is off).
    All three share the same aggregation and mask, hence the same count, so they add to the total.
    entropy: f32[B, L] full-vocabulary token entropy of the current policy; segments: packed sequences
    (``aggregate``). Returns (terms, aux).
    """
    task, aux = policy_loss(
        logp, old_logp, advantages, mask, config.clip_low, config.clip_high, config.clip_c,
        config.agg_mode, config.norm_length, sequence_mask, segments,
    )
    m = jnp.asarray(mask, bool)
    ent = aggregate(entropy, m, config.agg_mode, config.norm_length, sequence_mask, segments)
    terms = {"task": task, "entropy": Weighted(-config.entropy_coeff * ent.sum, ent.count)}
    rows_m = m if sequence_mask is None else m & jnp.asarray(sequence_mask, bool)[:, None]
    aux["entropy"] = _token_mean(entropy, rows_m)  # logged as a token mean whatever the agg mode
    if config.use_kl_loss:
        if ref_logp is None:
            raise ValueError("use_kl_loss=True needs ref_logp (reference-policy log-probs of the batch).")
        kl_mat = kl_penalty(logp, ref_logp, config.kl_type)
        kl = aggregate(kl_mat, m, config.agg_mode, config.norm_length, sequence_mask, segments)
        terms["kl"] = Weighted(config.kl_coef * kl.sum, kl.count)
        aux["kl"] = kl
    else:
        terms["kl"] = Weighted(jnp.zeros((), jnp.float32), task.count)
    return terms, aux


def actor_loss(
    logp: jax.Array,
    entropy: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: ActorLossConfig,
    ref_logp: jax.Array | None = None,
    sequence_mask: jax.Array | None = None,
) -> tuple[Weighted, dict[str, Weighted]]:
    """Total actor loss L_pg - c_H * agg(H) + c_KL * agg(KL) as one Weighted pair, plus aux metrics
    (including the three parts under "loss/task", "loss/entropy", "loss/kl")."""
    terms, aux = actor_loss_terms(logp, entropy, old_logp, advantages, mask, config, ref_logp, sequence_mask)
    total = Weighted(terms["task"].sum + terms["entropy"].sum + terms["kl"].sum, terms["task"].count)
    for name, term in terms.items():
        aux[f"loss/{name}"] = term
    return total, aux


__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "Weighted",
    "weighted_mean",
    "accumulate",
    "aggregate",
    "token_entropy",
    "kl_penalty",
    "ppo_token_losses",
    "policy_loss",
    "value_loss",
    "ActorLossConfig",
    "actor_loss_terms",
    "actor_loss",
]
