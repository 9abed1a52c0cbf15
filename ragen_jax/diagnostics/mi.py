"""Mutual-information proxies for template collapse (RAGEN ``ragen/trainer/collapse_metrics.py``), and their EMA state.

Input: the cross-scoring matrices of M sampled reasonings (rows) under N prompts (columns),
L[m, j] = log p(z_m | x_j) under the current policy, as a per-sequence sum (`logp_sum`) and a
per-token mean (`logp_mean`, the sum divided by the number of reasoning tokens). Row m was sampled
from prompt c(m) = `true_col[m]`. The prompt distribution is the batch's empirical one, uniform over
the N columns, so every estimate below is bounded by log N.

    matched_m  = L[m, c(m)]                                = log p(z_m | x_c(m))
    marginal_m = logsumexp_j L[m, j] - log N               = log p_mix(z_m), p_mix = 1/N sum_j p(.|x_j)
    MI         = mean_m matched_m - mean_m marginal_m      (can dip slightly below 0 by noise)
    H(Z|X)     = -mean_m matched_m,     H(Z) = -mean_m marginal_m,     so MI = H(Z) - H(Z|X)
    sigma      = population std over m of marginal_m
    z-score    = mean_m (matched_m - marginal_m) / (sigma + eps) = MI / (sigma + eps)

Every estimate comes twice: from the per-token matrix (`mi_estimate`, `*_est`, `mi_zscore`,
`marginal_std`) and from the per-sequence matrix (`mi_seq_estimate`, `*_seq_est`, `mi_zscore_seq`,
`marginal_std_seq`). Retrieval accuracy uses the per-token matrix only (as RAGEN does).

Static shapes: the sampling functions may produce fewer real rows or columns than the arrays hold
(empty reasoning, groups that were not drawn). `row_valid` / `col_valid` mark the real ones; padded
rows are left out of every mean and padded columns out of every logsumexp, argmax and count, so the
result equals the metrics of the sub-matrix of real rows and columns.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ragen_jax.rl.group_stats import group_moments, group_var

RETRIEVAL_TOP_K = (2, 4, 8)
EMA_DECAY = 0.9
STRATEGY_LABELS = ("first_turn", "trajectory")


def _masked_mean(values: jax.Array, weights: jax.Array, count: jax.Array) -> jax.Array:
    """sum_m weights_m * values_m / count; NaN when count == 0 (no real rows: nothing to report)."""
    return jnp.sum(jnp.where(weights, values, 0.0)) / count


def _matched_and_marginal(
    logp: jax.Array, true_col: jax.Array, col_valid: jax.Array, num_cols: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """matched: f32[M] = L[m, c(m)]; marginal: f32[M] = logsumexp over real columns - log N."""
    matched = jnp.take_along_axis(logp, true_col[:, None], axis=1)[:, 0]
    masked = jnp.where(col_valid[None, :], logp, -jnp.inf)
    marginal = jax.nn.logsumexp(masked, axis=1) - jnp.log(num_cols)
    return matched, marginal


def _estimates(
    logp: jax.Array,
    true_col: jax.Array,
    row_valid: jax.Array,
    col_valid: jax.Array,
    num_cols: jax.Array,
    std_eps: float,
) -> dict[str, jax.Array]:
    matched, marginal = _matched_and_marginal(logp, true_col, col_valid, num_cols)
    # Shifted moments over the real rows (``group_moments``): when every marginal_m is equal, sigma
    # is exactly 0 and the z-score exactly MI / eps, instead of an ulp-level sigma ~1e-7 leaking in.
    matched_mean = group_moments(matched, row_valid).mean
    marginal_moments = group_moments(marginal, row_valid)
    marginal_mean = marginal_moments.mean
    # Population std (divide by the number of rows, not rows - 1), as RAGEN's std(unbiased=False);
    # NaN with no real rows, like the means.
    marginal_std = jnp.sqrt(group_var(marginal_moments, ddof=0))
    mi = matched_mean - marginal_mean
    return {
        "mi": mi,
        "matched_mean": matched_mean,
        "marginal_mean": marginal_mean,
        "marginal_std": marginal_std,
        # mean_m (matched_m - marginal_m) / (sigma + eps) with a scalar denominator is MI / (sigma + eps).
        "zscore": mi / (marginal_std + std_eps),
    }


def _retrieval(
    logp_mean: jax.Array,
    true_col: jax.Array,
    col_signature: jax.Array,
    row_valid: jax.Array,
    col_valid: jax.Array,
    num_rows: jax.Array,
    num_cols: jax.Array,
) -> dict[str, jax.Array]:
    """Retrieval accuracy: is argmax_j L[m, j] (per-token) a column equivalent to c(m)?

    Columns with equal signature (identical prompt tokens) are equivalent. Chance level =
    mean over rows of (#real columns sharing the row's true signature) / N; top-k accuracy asks
    whether any of the k highest columns is equivalent (k_eff = min(k, N)), with chance
    min(1, chance * k_eff).
    """
    num_total_cols = logp_mean.shape[1]
    # Padded columns get signature -1 so they never count as correct, and score -inf so they rank last.
    signature = jnp.where(col_valid, col_signature, -1)
    true_signature = signature[true_col]
    masked = jnp.where(col_valid[None, :], logp_mean, -jnp.inf)

    metrics: dict[str, jax.Array] = {}
    predicted = jnp.argmax(masked, axis=1)  # first maximum on ties, like torch.argmax
    correct = signature[predicted] == true_signature
    accuracy = _masked_mean(correct.astype(jnp.float32), row_valid, num_rows)
    same_signature_cols = jnp.sum(
        (signature[None, :] == true_signature[:, None]) & col_valid[None, :], axis=1
    )
    chance = _masked_mean(same_signature_cols / num_cols, row_valid, num_rows)
    metrics["retrieval_accuracy"] = accuracy
    metrics["retrieval_chance_level"] = chance
    metrics["retrieval_above_chance"] = accuracy - chance

    k_max = min(max(RETRIEVAL_TOP_K), num_total_cols)
    _, top_cols = jax.lax.top_k(masked, k_max)  # [M, k_max], best first
    top_signature = signature[top_cols]
    for k in RETRIEVAL_TOP_K:
        k_static = min(k, k_max)
        k_eff = jnp.minimum(k, num_cols)
        hit = jnp.any(top_signature[:, :k_static] == true_signature[:, None], axis=1)
        accuracy_k = _masked_mean(hit.astype(jnp.float32), row_valid, num_rows)
        chance_k = jnp.minimum(1.0, chance * k_eff)
        metrics[f"retrieval_accuracy@{k}"] = accuracy_k
        metrics[f"retrieval_chance_level@{k}"] = chance_k
        metrics[f"retrieval_above_chance@{k}"] = accuracy_k - chance_k
    return metrics


def mi_metrics(
    logp_sum: jax.Array,
    logp_mean: jax.Array,
    true_col: jax.Array,
    col_signature: jax.Array | None = None,
    std_eps: float = 1e-3,
    *,
    row_valid: jax.Array | None = None,
    col_valid: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """MI proxies from the cross-scoring matrices (jit-able; every value is a float32 scalar).

    Args:
      logp_sum: f32[M, N], log p(z_m | x_j) summed over the reasoning tokens of z_m.
      logp_mean: f32[M, N], the same divided by the number of reasoning tokens of z_m.
      true_col: int32[M], the column each reasoning was sampled from.
      col_signature: int32[N] or None; columns with equal signature (identical prompt tokens) count
        as the same prompt for retrieval accuracy only (never for the logsumexp). None: all distinct.
      std_eps: epsilon of the z-score denominators.
      row_valid: bool[M] or None (all real); padded rows are excluded from every mean.
      col_valid: bool[N] or None (all real); padded columns are excluded from logsumexp and ranking.
        Every real row's true column must be real.

    Returns: mi_estimate, mi_seq_estimate, conditional_entropy_est, conditional_entropy_seq_est,
      reasoning_entropy_est, reasoning_entropy_seq_est, matched_log_prob_mean(_seq),
      marginal_log_prob_mean(_seq), marginal_std(_seq), mi_zscore(_seq), retrieval_accuracy(@2,4,8),
      retrieval_chance_level(@k), retrieval_above_chance(@k), mi_upper_bound = log N, num_rows,
      num_columns. With no real rows the means are NaN. With N = 1 every estimate is 0 and retrieval
      is trivially 1 = chance (RAGEN skips such batches; callers can check num_columns >= 2).
    """
    logp_sum = jnp.asarray(logp_sum, jnp.float32)
    logp_mean = jnp.asarray(logp_mean, jnp.float32)
    if logp_sum.ndim != 2 or logp_sum.shape != logp_mean.shape:
        raise ValueError(
            f"logp_sum and logp_mean must both be [M, N]; got {logp_sum.shape} and {logp_mean.shape}."
        )
    num_rows_total, num_cols_total = logp_sum.shape
    true_col = jnp.asarray(true_col, jnp.int32)
    if true_col.shape != (num_rows_total,):
        raise ValueError(f"true_col must be int32[{num_rows_total}] (one per row); got {true_col.shape}.")
    if col_signature is None:
        col_signature = jnp.arange(num_cols_total, dtype=jnp.int32)
    col_signature = jnp.asarray(col_signature, jnp.int32)
    if col_signature.shape != (num_cols_total,):
        raise ValueError(f"col_signature must be int32[{num_cols_total}]; got {col_signature.shape}.")
    row_valid = jnp.ones(num_rows_total, bool) if row_valid is None else jnp.asarray(row_valid, bool)
    col_valid = jnp.ones(num_cols_total, bool) if col_valid is None else jnp.asarray(col_valid, bool)

    num_rows = jnp.sum(row_valid).astype(jnp.float32)
    num_cols = jnp.sum(col_valid).astype(jnp.float32)

    tok = _estimates(logp_mean, true_col, row_valid, col_valid, num_cols, std_eps)
    seq = _estimates(logp_sum, true_col, row_valid, col_valid, num_cols, std_eps)
    metrics = {
        "mi_estimate": tok["mi"],
        "mi_seq_estimate": seq["mi"],
        "conditional_entropy_est": -tok["matched_mean"],
        "conditional_entropy_seq_est": -seq["matched_mean"],
        "reasoning_entropy_est": -tok["marginal_mean"],
        "reasoning_entropy_seq_est": -seq["marginal_mean"],
        "matched_log_prob_mean": tok["matched_mean"],
        "matched_log_prob_mean_seq": seq["matched_mean"],
        "marginal_log_prob_mean": tok["marginal_mean"],
        "marginal_log_prob_mean_seq": seq["marginal_mean"],
        "marginal_std": tok["marginal_std"],
        "marginal_std_seq": seq["marginal_std"],
        "mi_zscore": tok["zscore"],
        "mi_zscore_seq": seq["zscore"],
        "mi_upper_bound": jnp.log(num_cols),
        "num_rows": num_rows,
        "num_columns": num_cols,
    }
    metrics.update(
        _retrieval(logp_mean, true_col, col_signature, row_valid, col_valid, num_rows, num_cols)
    )
    return metrics


class MarginalStdEma(NamedTuple):
    """EMA of the marginal std for one sampling strategy (a pytree: carried and checkpointed).

    sigma_ema(t) = decay * sigma_ema(t-1) + (1 - decay) * sigma(t), initialised to the first value.
    `token` tracks `marginal_std`, `seq` tracks `marginal_std_seq`; `count` = updates so far.
    """

    token: jax.Array  # f32[]
    seq: jax.Array  # f32[]
    count: jax.Array  # int32[]


def init_marginal_std_ema() -> MarginalStdEma:
    return MarginalStdEma(
        token=jnp.zeros((), jnp.float32), seq=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.int32)
    )


def init_mi_ema_state(labels: tuple[str, ...] = STRATEGY_LABELS) -> dict[str, MarginalStdEma]:
    """One EMA per sampling strategy label (RAGEN keeps them apart: different N, different scale)."""
    return {label: init_marginal_std_ema() for label in labels}


def _ema_step(previous: jax.Array, current: jax.Array, first: jax.Array, decay: float) -> jax.Array:
    return jnp.where(first, current, decay * previous + (1.0 - decay) * current)


def update_marginal_std_ema(
    ema: MarginalStdEma, metrics: dict[str, jax.Array], decay: float = EMA_DECAY
) -> MarginalStdEma:
    """Fold this step's marginal stds into the EMA.

    A step that produced no usable estimate (no real rows, or fewer than 2 columns, which RAGEN
    skips entirely) leaves the state unchanged, so one empty batch cannot poison the average.
    """
    usable = (metrics["num_rows"] >= 1) & (metrics["num_columns"] >= 2)
    first = ema.count == 0
    token = _ema_step(ema.token, metrics["marginal_std"], first, decay)
    seq = _ema_step(ema.seq, metrics["marginal_std_seq"], first, decay)
    return MarginalStdEma(
        token=jnp.where(usable, token, ema.token).astype(jnp.float32),
        seq=jnp.where(usable, seq, ema.seq).astype(jnp.float32),
        count=ema.count + usable.astype(jnp.int32),
    )


def mi_metrics_with_ema(
    ema: MarginalStdEma,
    metrics: dict[str, jax.Array],
    decay: float = EMA_DECAY,
    std_eps: float = 1e-3,
) -> tuple[dict[str, jax.Array], MarginalStdEma]:
    """Update the EMA with `metrics` (from `mi_metrics`) and add the EMA z-scores.

    mi_zscore_ema = mean_m (matched_m - marginal_m) / (sigma_ema + eps) = MI / (sigma_ema + eps),
    and the same for the per-sequence variant. Returns (metrics with marginal_std_ema(_seq) and
    mi_zscore_ema(_seq) added, new EMA state).
    """
    new_ema = update_marginal_std_ema(ema, metrics, decay)
    out = dict(metrics)
    out["marginal_std_ema"] = new_ema.token
    out["marginal_std_ema_seq"] = new_ema.seq
    out["mi_zscore_ema"] = metrics["mi_estimate"] / (new_ema.token + std_eps)
    out["mi_zscore_ema_seq"] = metrics["mi_seq_estimate"] / (new_ema.seq + std_eps)
    return out, new_ema



def should_compute_mi(step: int, compute_freq: int = 5) -> bool:
    """RAGEN's schedule: never at step 0, always at step 1, then every `compute_freq` steps."""
    if compute_freq < 1:
        raise ValueError(f"compute_freq must be >= 1; got {compute_freq}.")
    if step <= 0:
        return False
    return step == 1 or step % compute_freq == 0
