"""Group mean and spread that are exact for a group of equal values: one helper for every estimator.

GRPO / Dr.GRPO / RLOO advantages, the SNR filter's reward spread, batch whitening and the MI z-score
all centre a group of values and divide by its spread. Computed naively in float32, a group of equal
values does not centre to zero: sum(x) / n rounds (16 x 0.7 gives a mean one ulp off), the std comes
out ~1e-7 instead of 0, and GRPO's (r - mean) / (std + 1e-6) then gives every sample of a group that
carries no signal the same advantage of up to +-0.1. RAGEN (``ragen/trainer/core_algos.py``
``compute_grpo_outcome_advantage``) and verl compute the same formula in torch, where the same rounding
happens; here only the arithmetic changes, never the formula.

Shifted two-pass moments over the last axis (x_ref = the group's first valid element):
    d_i   = x_i - x_ref                  every d_i is exactly 0 for a constant group
    dbar  = sum_i d_i / n
    mean  = x_ref + dbar                 exactly x_ref for a constant group
    c_i   = d_i - dbar                   (= x_i - mean), exactly 0 for a constant group
    ss    = sum_i c_i^2                  exactly 0 for a constant group
A constant group is therefore exact for every group size and summation order (a sum of exact zeros
is 0), and the shift also removes the cancellation of a large common offset (rewards 10 + noise).
For a non-constant group the float32 error of c_i is at most about (n + 3) * u * (max x - min x),
u = 2^-24 (see ``tests/rl/test_group_stats.py`` for the full bound checked against float64).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupMoments(NamedTuple):
    """Moments of each group (the last axis) of x: f32[..., S].

    mean:     f32[...]      x_ref + dbar;
    centered: f32[..., S]   c_i = x_i - mean (0 where ``where`` is False);
    sum_sq:   f32[...]      sum_i c_i^2 over the valid elements;
    count:    f32[...]      number of valid elements n.
    """

    mean: jax.Array
    centered: jax.Array
    sum_sq: jax.Array
    count: jax.Array


def _reference(x: jax.Array, where: jax.Array | None) -> jax.Array:
    """The shift x_ref: f32[..., 1], the first valid element of each group (0 for an empty group,
    so that padding, which may hold inf or NaN, never leaks into the statistics)."""
    if where is None:
        return x[..., :1]
    first = jnp.argmax(where, axis=-1)[..., None]
    ref = jnp.take_along_axis(x, first, axis=-1)
    return jnp.where(jnp.any(where, axis=-1, keepdims=True), ref, 0.0)


def group_moments(x: jax.Array, where: jax.Array | None = None) -> GroupMoments:
    """Shifted two-pass moments of each group along the last axis (formulas in the module docstring).

    x: f32[..., S] (any real dtype; computed in float32); where: bool[..., S] or None (all valid).
    With no valid element mean = 0 / 0 = NaN; a NaN or inf in a group makes its moments non-finite
    and leaves other groups alone. Returns ``GroupMoments``.
    """
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0:
        raise ValueError("group_moments needs at least one axis (the group axis is the last one).")
    ref = _reference(x, where)
    if where is None:
        count = jnp.full(x.shape[:-1], x.shape[-1], jnp.float32)
        d = x - ref
    else:
        where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
        count = jnp.sum(where, axis=-1).astype(jnp.float32)
        d = jnp.where(where, x - ref, 0.0)
    dbar = jnp.sum(d, axis=-1) / count
    centered = d - dbar[..., None]
    if where is not None:
        centered = jnp.where(where, centered, 0.0)
    return GroupMoments(
        mean=ref[..., 0] + dbar,
        centered=centered,
        sum_sq=jnp.sum(centered * centered, axis=-1),
        count=count,
    )


def group_var(moments: GroupMoments, ddof: int = 0) -> jax.Array:
    """var = sum_i c_i^2 / (n - ddof): f32[...] (ddof 1 is torch.std's unbiased default, 0 np.var's).

    Exactly 0 for a constant group. No guard for n <= ddof (0 / 0 = NaN): the conventions differ
    (verl's GRPO uses std 1 for a singleton group, the filter 0, the MI metrics NaN), so callers
    choose theirs.
    """
    return moments.sum_sq / (moments.count - ddof)


__all__ = ["GroupMoments", "group_moments", "group_var"]
