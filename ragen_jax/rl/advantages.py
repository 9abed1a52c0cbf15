"""Advantage estimators: GAE over assistant tokens, GRPO / Dr.GRPO, RLOO, bi-level GAE, whitening.

Semantics follow verl ``core_algos.py`` (``compute_gae_advantage_return``,
``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``, ``masked_whiten``) and RAGEN
``ragen/trainer/core_algos.py`` (``compute_bi_level_gae_advantage_return``), called from
``ragen/trainer/agent_trainer.py::compute_advantage``.
All functions are pure and jittable; every output is float32 whatever the input dtype.

Token layout: f32[B, L] per-token arrays with ``mask`` bool[B, L] marking the loss (assistant) tokens.
Outputs are zero at masked-out positions (verl leaves carried values there; no loss reads them).

NaN behaviour: a non-finite reward or value propagates to the advantages of its own sequence (GAE)
or group (GRPO / RLOO), and whitening then spreads it to the whole batch. Check rewards on the host
with ``ragen_jax.rl.filtering.check_finite_rewards`` before the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ragen_jax.rl.group_stats import group_moments, group_var

WHITEN_EPS = 1e-8  # verl masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """sum(x * mask) / sum(mask) over all entries; 0 when the mask is empty. Returns f32[]."""
    m = _f32(mask)
    total = jnp.sum(_f32(x) * m)
    count = jnp.sum(m)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Masked variance over all entries: sum((x - mean)^2) / (n - 1) when unbiased, / n otherwise.

    Shifted two-pass (``group_moments``), so equal values give exactly 0. verl raises for n <= 1
    (unbiased); inside jit that is impossible, so the variance is defined as 0 there (so a single
    token whitens to 0 rather than NaN), and as 0 for an empty mask. Returns f32[].
    """
    return _masked_moments_var(x, mask, unbiased)[1]


def _masked_moments_var(x: jax.Array, mask: jax.Array, unbiased: bool):
    """(moments over all entries of x flattened, variance with the n <= ddof cases set to 0)."""
    mom = group_moments(_f32(x).reshape(-1), jnp.asarray(mask, bool).reshape(-1))
    ddof = 1 if unbiased else 0
    var = mom.sum_sq / jnp.maximum(mom.count - ddof, 1.0)
    return mom, jnp.where(mom.count > ddof, var, 0.0)


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """verl ``masked_whiten``: (x - mean) * rsqrt(var_unbiased + 1e-8) with masked statistics.

    x: f32[...]; mask: bool[...] (same shape). shift_mean=False adds the mean back. Masked-out
    positions are set to 0. Returns f32[...].
    """
    x = _f32(x)
    mom, var = _masked_moments_var(x, mask, unbiased=True)
    # x - mean as the helper's centred values: exactly 0 where every masked value is equal.
    out = mom.centered.reshape(x.shape) * jax.lax.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mom.mean
    return jnp.where(jnp.asarray(mask, bool), out, 0.0)


def _reverse_masked_gae(rewards, values, mask, gamma, lam):
    """verl's GAE recursion, scanning t = L-1 .. 0 with carries (next_value, last_gae) of shape [B].

    delta_t = r_t + gamma * next_value - V_t;   gae_t = delta_t + gamma * lam * last_gae.
    At loss tokens the carries become (V_t, gae_t); at masked tokens both carry through unchanged,
    so GAE runs on the compressed sequence of assistant tokens (a reward on a masked token is lost,
    exactly as in verl). Returns gae f32[B, L] (the carried value at masked positions).
    """
    def step(carry, xs):
        next_value, last_gae = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        gae = delta + gamma * lam * last_gae
        next_value = jnp.where(m_t, v_t, next_value)
        last_gae = jnp.where(m_t, gae, last_gae)
        return (next_value, last_gae), last_gae

    b = rewards.shape[0]
    init = (jnp.zeros(b, jnp.float32), jnp.zeros(b, jnp.float32))
    xs = (rewards.T, values.T, mask.T)
    _, gae_t = jax.lax.scan(step, init, xs, reverse=True)
    return gae_t.T


def gae_advantages(
    token_rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float | jax.Array = 1.0,
    lam: float | jax.Array = 1.0,
    whiten: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """GAE over loss-masked positions only (verl ``compute_gae_advantage_return``).

    token_rewards: f32[B, L] (RAGEN puts the episode reward on the last assistant token);
    values: f32[B, L] critic values; mask: bool[B, L] loss (assistant) tokens; gamma, lam may be traced.
    Returns (advantages f32[B, L], returns f32[B, L]): returns = raw GAE + V (before whitening);
    advantages are masked-whitened over the batch when ``whiten`` (static). Both are 0 off the mask.
    With gamma = lam = 1 and the reward on the last assistant token, A_t = R - V_t and return_t = R.
    """
    r, v = _f32(token_rewards), _f32(values)
    m = jnp.asarray(mask, bool)
    gae = _reverse_masked_gae(r, v, m, _f32(gamma), _f32(lam))
    returns = jnp.where(m, gae + v, 0.0)
    adv = masked_whiten(gae, m) if whiten else jnp.where(m, gae, 0.0)
    return adv, returns


def bilevel_gae_advantages(
    token_rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    turn_end_mask: jax.Array,
    gamma: float | jax.Array = 1.0,
    lam: float | jax.Array = 1.0,
    high_level_gamma: float | jax.Array = 0.95,
    whiten: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """RAGEN's bi-level GAE: a turn-level GAE over end-of-turn tokens, then a token-level GAE per turn.

    token_rewards: f32[B, L] per-turn rewards on each turn's last token; values f32[B, L];
    mask bool[B, L] loss tokens; turn_end_mask bool[B, L] the last token of each assistant turn (must
    be loss tokens; RAGEN finds them as the nonzero-reward positions, which misses zero-reward turns,
    so here they are explicit).
    High level, over turn ends k backward (V_next = V at the next turn end, 0 after the last):
        A_k = r_k + g_hi * V_next - V_k + g_hi * lam * A_{k+1};   R_k = A_k + V_k.
    Low level, over loss tokens t backward, restarting at every turn end:
        at a turn end: A_t = R_k - V_t (= A_k);   otherwise
        A_t = r_t + gamma * V_{t+1} - V_t + gamma * lam * A_{t+1}   (t+1 = next loss token).
    Returns (advantages whitened over the mask when ``whiten``, returns = A + V), both 0 off the mask.
    """
    r, v = _f32(token_rewards), _f32(values)
    m = jnp.asarray(mask, bool)
    ends = jnp.asarray(turn_end_mask, bool)
    gamma, lam, g_hi = _f32(gamma), _f32(lam), _f32(high_level_gamma)
    b = r.shape[0]
    zeros = jnp.zeros(b, jnp.float32)

    def high_step(carry, xs):
        next_turn_value, last_gae = carry
        r_t, v_t, end_t = xs
        gae = r_t + g_hi * next_turn_value - v_t + g_hi * lam * last_gae
        carry = (jnp.where(end_t, v_t, next_turn_value), jnp.where(end_t, gae, last_gae))
        return carry, jnp.where(end_t, gae + v_t, 0.0)

    _, turn_return_t = jax.lax.scan(high_step, (zeros, zeros), (r.T, v.T, ends.T), reverse=True)
    turn_return = turn_return_t.T  # R_k at turn ends, 0 elsewhere

    def low_step(carry, xs):
        next_value, last_gae = carry
        r_t, v_t, m_t, end_t, ret_t = xs
        next_value = jnp.where(end_t, 0.0, next_value)
        last_gae = jnp.where(end_t, 0.0, last_gae)
        reward = jnp.where(end_t, ret_t, r_t)
        gae = reward + gamma * next_value - v_t + gamma * lam * last_gae
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, gae, last_gae))
        return carry, jnp.where(m_t, gae, 0.0)

    xs = (r.T, v.T, m.T, ends.T, turn_return.T)
    _, gae_t = jax.lax.scan(low_step, (zeros, zeros), xs, reverse=True)
    gae = gae_t.T
    returns = jnp.where(m, gae + v, 0.0)
    adv = masked_whiten(gae, m) if whiten else gae
    return adv, returns


def grpo_advantages(scores: jax.Array, norm_by_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """GRPO outcome advantages per group (verl / RAGEN ``compute_grpo_outcome_advantage``).

    scores: f32[G, S] episode rewards. A = (s - mean_g) / (std_g + eps) with the unbiased std
    (torch.std); norm_by_std=False (static) gives Dr.GRPO: A = s - mean_g. A singleton group (S = 1)
    uses mean 0 and std 1, as verl does (so A = s / (1 + eps), or s). mean, s - mean and std come from
    ``group_moments``, so a group of equal rewards gets exactly A = 0. Returns f32[G, S]; broadcast to
    the tokens with ``broadcast_to_tokens``. Groups are independent, so dropping other groups
    (filtering) leaves a kept group's advantages unchanged. NaN in a group makes that group's
    advantages NaN.
    """
    s = _f32(scores)
    if s.ndim != 2:
        raise ValueError(f"scores must be f32[G, S] (groups x samples), got shape {s.shape}.")
    if s.shape[1] == 1:
        return s / (jnp.ones((), jnp.float32) + eps) if norm_by_std else s
    mom = group_moments(s)
    if not norm_by_std:
        return mom.centered
    std = jnp.sqrt(group_var(mom, ddof=1))
    return mom.centered / (std + eps)[:, None]


def grpo_group_std(scores: jax.Array) -> jax.Array:
    """The std GRPO divides by, per group: unbiased std (exactly 0 for equal rewards), or 1.0 for
    singleton groups. f32[G, S] -> f32[G]."""
    s = _f32(scores)
    if s.shape[1] == 1:
        return jnp.ones(s.shape[0], jnp.float32)
    return jnp.sqrt(group_var(group_moments(s), ddof=1))


def rloo_advantages(scores: jax.Array) -> jax.Array:
    """RLOO (verl ``compute_rloo_outcome_advantage``): A_i = s_i - mean_{j != i} s_j.

    = (S / (S - 1)) * (s_i - mean_g), with s_i - mean_g from ``group_moments`` (exactly 0 for equal
    rewards). A singleton group keeps A = s (verl). f32[G, S] -> f32[G, S].
    """
    s = _f32(scores)
    n = s.shape[1]
    if n == 1:
        return s
    return group_moments(s).centered * (n / (n - 1))


def broadcast_to_tokens(sequence_advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Put one advantage per sequence on every loss token: f32[B], bool[B, L] -> f32[B, L]."""
    return _f32(sequence_advantages)[:, None] * _f32(mask)


def advantage_stats(advantages: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Batch statistics of the advantages on loss tokens (for logging): mean, std (population), min,
    max, and the fraction of loss tokens with a nonzero advantage. Each f32[]; 0 for an empty mask."""
    a = _f32(advantages)
    m = jnp.asarray(mask, bool)
    any_tok = jnp.any(m)
    mean = masked_mean(a, m)
    var = masked_var(a, m, unbiased=False)
    return {
        "advantage_mean": mean,
        "advantage_std": jnp.sqrt(var),
        "advantage_min": jnp.where(any_tok, jnp.min(jnp.where(m, a, jnp.inf)), 0.0),
        "advantage_max": jnp.where(any_tok, jnp.max(jnp.where(m, a, -jnp.inf)), 0.0),
        "advantage_nonzero_frac": masked_mean((a != 0).astype(jnp.float32), m),
    }


__all__ = [
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "gae_advantages",
    "bilevel_gae_advantages",
    "grpo_advantages",
    "grpo_group_std",
    "rloo_advantages",
    "broadcast_to_tokens",
    "advantage_stats",
]
