"""Task-vs-regulariser gradient decomposition by reward-variance bucket (RAGEN-2 fig12).

The SNR mechanism (RAGEN-2, the paper's reward-variance argument): the task (policy-gradient) term's norm is bounded by
c * sqrt(Var(R | x)), while the entropy and KL terms do not depend on reward. RAGEN measures this by
sorting prompt groups by reward std, splitting them into equal-count buckets, and, per bucket, taking
a separate backward pass of each loss component with no optimizer step
(``ragen/trainer/gradient_reporter.py``, ``RewardRolloutFilter.split_into_buckets``,
``dp_actor.update_policy`` with ``grad_component_analysis``). This module does the same with
``jax.grad`` of each term and its global L2 norm (``optax.tree.norm``):

    task    = PPO clipped policy loss          entropy = -entropy_coeff * agg(H)
    kl      = kl_coef * agg(KL(logp, ref))     (each aggregated over the bucket's rows only)

Differences from RAGEN, on purpose: the gradient is of the bucket's exact global loss (one
mini-batch; RAGEN averages micro-batch losses inside each mini-batch); buckets are selected with a
row mask over the full batch, so one compiled function serves every bucket (static shapes). Norms
are before any clipping, like the ``clip_grad_norm_`` return value RAGEN logs.

The policy is any ``logprob_fn(params, batch) -> (logp f32[B, L], entropy f32[B, L])``, so this works
with the toy policies of the tests and with ``ragen_jax.models`` (via ``models.logprobs``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ragen_jax.rl.losses import ActorLossConfig, actor_loss_terms, weighted_mean

LogprobFn = Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, jax.Array]]
BUCKET_MODES = ("quantile", "fixed_rv")
FIXED_RV_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)  # RAGEN fixed_rv: [0,1), [1,2), ..., [5, inf)


@dataclasses.dataclass(frozen=True)
class GradientAnalysisConfig:
    """Static settings. Defaults: RAGEN's 6 quantile buckets and its probe script's regularisers
    (entropy 0.001, KL 0.001 with low_var_kl), on top of the base PPO clip settings."""

    num_buckets: int = 6
    bucket_mode: str = "quantile"
    loss: ActorLossConfig = ActorLossConfig(
        entropy_coeff=0.001, use_kl_loss=True, kl_coef=0.001, kl_type="low_var_kl"
    )

    def __post_init__(self):
        if self.bucket_mode not in BUCKET_MODES:
            raise ValueError(f"Unknown bucket_mode {self.bucket_mode!r}; expected one of {BUCKET_MODES}.")
        if self.num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {self.num_buckets}.")

    @property
    def components(self) -> tuple[str, ...]:
        """The terms RAGEN differentiates: task always; entropy if its coef != 0; kl if KL is on."""
        names = ["task"]
        if self.loss.entropy_coeff != 0:
            names.append("entropy")
        if self.loss.use_kl_loss:
            names.append("kl")
        return tuple(names)


def per_group_reward_std(group_ids, reward_std) -> tuple[np.ndarray, np.ndarray]:
    """Host-side: (unique group ids sorted, mean per-sample reward std of each group).

    group_ids: int[B]; reward_std: f32[B] (the pre-filter group std broadcast to samples, as RAGEN
    stores it in ``batch["reward_std"]``).
    """
    gids = np.asarray(group_ids)
    std = np.asarray(reward_std, np.float64)
    unique, inverse = np.unique(gids, return_inverse=True)
    sums = np.bincount(inverse, weights=std, minlength=unique.size)
    counts = np.bincount(inverse, minlength=unique.size)
    return unique, (sums / np.maximum(counts, 1)).astype(np.float32)


def bucket_groups(group_std, num_buckets: int = 6, mode: str = "quantile") -> dict[str, np.ndarray]:
    """Host-side: bool[G] membership of each bucket, RAGEN ``split_into_buckets`` semantics.

    quantile: groups sorted by std ascending (stable), G // n per bucket, the remainder to the last
    bucket; fixed_rv: std in [0,1), [1,2), [2,3), [3,4), [4,5), [5, inf). Always includes "all".
    Empty buckets are left out (RAGEN skips them), so with fewer groups than buckets only the last
    bucket (holding every group) remains. Keys: "all", "bucket_1" .. "bucket_n".
    """
    std = np.asarray(group_std, np.float64)
    g = std.size
    out = {"all": np.ones(g, bool)}
    if mode == "fixed_rv":
        for i, low in enumerate(FIXED_RV_EDGES):
            high = FIXED_RV_EDGES[i + 1] if i + 1 < len(FIXED_RV_EDGES) else np.inf
            member = (std >= low) & (std < high)
            if member.any():
                out[f"bucket_{i + 1}"] = member
        return out
    if mode != "quantile":
        raise ValueError(f"Unknown bucket_mode {mode!r}; expected one of {BUCKET_MODES}.")
    per_bucket, remainder = divmod(g, num_buckets)
    order = np.argsort(std, kind="stable")
    start = 0
    for i in range(num_buckets):
        size = per_bucket + (remainder if i == num_buckets - 1 else 0)
        if size == 0:
            continue
        member = np.zeros(g, bool)
        member[order[start:start + size]] = True
        out[f"bucket_{i + 1}"] = member
        start += size
    return out


def make_component_grad_norms(
    logprob_fn: LogprobFn, config: GradientAnalysisConfig
) -> Callable[[Any, Mapping[str, jax.Array], jax.Array], dict[str, jax.Array]]:
    """A jitted ``fn(params, batch, row_mask) -> dict`` of per-component gradient norms and losses.

    batch: mapping with "old_logp", "advantages" f32[B, L], "loss_mask" bool[B, L], "ref_logp"
    f32[B, L] when KL is on, plus whatever ``logprob_fn`` reads; every leaf has leading dim B.
    row_mask: bool[B], the rows of the bucket. Output keys: the component names (global L2 norm of
    d term / d params, unclipped) and loss/policy, loss/entropy, loss/kl, loss/total, num_tokens.
    Compiles once per batch shape; reuse it across buckets and steps.
    """
    loss_cfg = config.loss
    components = config.components

    def terms_of(params, batch, row_mask):
        logp, entropy = logprob_fn(params, batch)
        terms, _ = actor_loss_terms(
            logp, entropy, batch["old_logp"], batch["advantages"], batch["loss_mask"], loss_cfg,
            ref_logp=batch.get("ref_logp"), sequence_mask=row_mask,
        )
        return {name: weighted_mean(t) for name, t in terms.items()}

    def fn(params, batch, row_mask):
        out = {}
        for name in components:
            grads = jax.grad(lambda p, name=name: terms_of(p, batch, row_mask)[name])(params)
            out[name] = optax.tree.norm(grads)  # the global L2 norm (formerly optax.global_norm)
        losses = terms_of(params, batch, row_mask)
        out["loss/policy"] = losses["task"]
        out["loss/entropy"] = losses["entropy"]
        out["loss/kl"] = losses["kl"]
        out["loss/total"] = losses["task"] + losses["entropy"] + losses["kl"]
        tokens = jnp.asarray(batch["loss_mask"], bool) & row_mask[:, None]
        out["num_tokens"] = jnp.sum(tokens).astype(jnp.float32)
        return out

    return jax.jit(fn)


def gradient_decomposition(
    params: Any,
    batch: Mapping[str, jax.Array],
    group_ids,
    reward_std,
    logprob_fn: LogprobFn | None = None,
    config: GradientAnalysisConfig = GradientAnalysisConfig(),
    grad_norms_fn: Callable | None = None,
    prefix: str = "grad_norm",
) -> dict[str, float]:
    """Per reward-std bucket: gradient norms of the task, entropy and KL terms (no update).

    params: the policy parameters (any pytree ``logprob_fn`` accepts); batch: see
    ``make_component_grad_norms``; group_ids int[B], reward_std f32[B] (pre-filter group std per
    sample). Pass ``grad_norms_fn`` from ``make_component_grad_norms`` to reuse its compilation,
    otherwise ``logprob_fn`` is required. Returns a flat dict of floats with RAGEN's keys:
      {prefix}/{bucket}/{task,entropy,kl}                 gradient norms
      {prefix}/{bucket}/per_sample/{c}, .../per_token/{c}  norm / #samples, norm / #loss tokens
      {prefix}/{bucket}/loss/{policy,entropy,kl,total}
      {prefix}/{bucket}/reward_std_{mean,min,max}, sample_count, sample_pct
    bucket is "all" or "bucket_1" (lowest std) .. "bucket_n".
    """
    if grad_norms_fn is None:
        if logprob_fn is None:
            raise ValueError("gradient_decomposition needs logprob_fn or a prebuilt grad_norms_fn.")
        grad_norms_fn = make_component_grad_norms(logprob_fn, config)
    gids = np.asarray(group_ids)
    std = np.asarray(reward_std, np.float32)
    unique, std_per_group = per_group_reward_std(gids, std)
    inverse = np.searchsorted(unique, gids)
    buckets = bucket_groups(std_per_group, config.num_buckets, config.bucket_mode)
    total = gids.size
    metrics: dict[str, float] = {}
    for name, group_member in buckets.items():
        rows = group_member[inverse]
        count = int(rows.sum())
        out = jax.device_get(grad_norms_fn(params, batch, jnp.asarray(rows)))
        key = f"{prefix}/{name}"
        metrics[f"{key}/sample_count"] = float(count)
        metrics[f"{key}/sample_pct"] = count / total
        metrics[f"{key}/reward_std_mean"] = float(std_per_group[group_member].mean())
        metrics[f"{key}/reward_std_min"] = float(std[rows].min())
        metrics[f"{key}/reward_std_max"] = float(std[rows].max())
        n_tokens = float(out["num_tokens"])
        for component in config.components:
            norm = float(out[component])
            metrics[f"{key}/{component}"] = norm
            metrics[f"{key}/per_sample/{component}"] = norm / count
            if n_tokens > 0:
                metrics[f"{key}/per_token/{component}"] = norm / n_tokens
        for loss_name in ("policy", "entropy", "kl", "total"):
            metrics[f"{key}/loss/{loss_name}"] = float(out[f"loss/{loss_name}"])
    return metrics


__all__ = [
    "BUCKET_MODES",
    "GradientAnalysisConfig",
    "per_group_reward_std",
    "bucket_groups",
    "make_component_grad_norms",
    "gradient_decomposition",
]
