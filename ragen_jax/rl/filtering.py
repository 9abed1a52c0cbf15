"""SNR-Aware Filtering: score prompt groups by reward spread and keep the informative ones.

RAGEN-2's filter (``ragen/trainer/rollout_filter.py``: ``RewardRolloutFilter._select_top_groups``) keeps the prompt
groups whose in-group reward spread is highest, because the task gradient of a group is bounded by
c * sqrt(Var(R | x)) while the KL / entropy gradients are not: low-variance groups only add
input-agnostic regulariser noise. Everything here is a pure, jittable function of arrays; strategy
names, modes and thresholds are static Python values (pass them as static arguments under ``jax.jit``).

Layout: rewards are f32[G, S], G prompt groups of S episodes each (one env seed per group).
``select_groups`` returns a bool[G] mask of static shape; the trainer gathers the kept groups itself.

Tie-breaking: groups with equal scores are ranked by lower group index first (a stable sort). RAGEN
uses ``torch.sort`` / ``torch.topk``, whose order among exact ties is unspecified.

Non-finite rewards: a NaN or inf reward makes its group's score NaN/inf, and selection over NaN
scores is undefined (comparisons with NaN are false). Nothing inside jit can raise, so the trainer
calls ``check_finite_rewards`` on the host before the step and logs ``all_finite`` every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rl.group_stats import group_moments, group_var

SCORE_METRICS = ("reward_std", "reward_var", "reward_mean", "reward_sum")
# RAGEN's config names for the same metrics.
_METRIC_ALIASES = {"reward_variance": "reward_std", "reward": "reward_mean"}
STRATEGIES = ("top_p", "top_k", "top_k_abs", "min_p")
TOP_P_MODES = ("linear", "softmax")
LOSS_SCALING_MODES = ("none", "linear", "sqrt")

# |score| <= ZERO_SCORE_TOL counts as a zero-variance group (RAGEN's include_zero test).
ZERO_SCORE_TOL = 1e-10
# Slack RAGEN's min_p comparisons use.
_MIN_P_TOL = 1e-10


def _resolve_metric(metric: str) -> str:
    metric = _METRIC_ALIASES.get(metric, metric)
    if metric not in SCORE_METRICS:
        raise ValueError(
            f"Unknown filter metric {metric!r}; expected one of {SCORE_METRICS} "
            f"(RAGEN aliases: {sorted(_METRIC_ALIASES)})."
        )
    return metric


def group_scores(rewards: jax.Array, metric: str = "reward_std", ddof: int | None = None) -> jax.Array:
    """Per-group selection score over the S episode rewards of each group.

    rewards: f32[G, S] episode rewards (any real dtype; computed in float32). Returns f32[G].
    Metrics (static):
      reward_std  (RAGEN's "reward_variance"): sqrt(sum_s (R_s - mean)^2 / (S - ddof)), ddof default 1
                  (torch.std, unbiased) -- a standard deviation despite RAGEN's name;
      reward_var  (VAGEN / the newer verl, TRL, SkyRL ports): sum_s (R_s - mean)^2 / (S - ddof),
                  ddof default 0 (np.var);
      reward_mean (RAGEN's "reward"): mean_s R_s;   reward_sum: sum_s R_s.
    When S <= ddof the spread is undefined (torch.std of one sample is NaN); it is defined here as 0
    (no within-group signal), as VAGEN does for singleton groups.
    NaN behaviour: a non-finite reward makes that group's score NaN (or inf); other groups are unaffected.
    """
    metric = _resolve_metric(metric)
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be f32[G, S] (groups x samples), got shape {r.shape}.")
    s = r.shape[1]
    if metric == "reward_mean":
        return group_moments(r).mean
    if metric == "reward_sum":
        return jnp.sum(r, axis=1)
    if ddof is None:
        ddof = 1 if metric == "reward_std" else 0
    if s - ddof <= 0:
        # Still propagate non-finite rewards instead of hiding them behind the 0.
        return jnp.where(jnp.all(jnp.isfinite(r), axis=1), 0.0, jnp.nan).astype(jnp.float32)
    # Shifted moments: a group of equal rewards gets exactly 0 whatever the summation order (e.g. on
    # different meshes), so the include_zero rule sees it as a zero-variance group.
    var = group_var(group_moments(r), ddof)
    return jnp.sqrt(var) if metric == "reward_std" else var


def _candidates(scores: jax.Array, include_zero: bool) -> jax.Array:
    """bool[G]: groups that take part in selection (include_zero=False drops |score| <= 1e-10)."""
    if include_zero:
        return jnp.ones(scores.shape, bool)
    return jnp.abs(scores) > ZERO_SCORE_TOL


def _rank(key: jax.Array, candidates: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Order candidates by ``key`` descending (ties: lower index first), non-candidates last.

    Returns (order int32[G]: group index at each rank, rank int32[G]: rank of each group).
    """
    g = key.shape[0]
    index = jnp.arange(g, dtype=jnp.int32)
    # lexsort: the last key is primary. "+ 0.0" folds -0.0 into 0.0 so they tie.
    order = jnp.lexsort((index, -key + 0.0, ~candidates)).astype(jnp.int32)
    rank = jnp.zeros(g, jnp.int32).at[order].set(index)
    return order, rank


def _top_p_linear(
    scores: jax.Array, cand: jax.Array, value: float, eps: float, largest: bool
) -> jax.Array:
    """RAGEN linear top-p: the shortest prefix (in score order) whose score mass reaches p * total.

    tau = p * sum_{candidates} score - eps. Walk down the sorted candidates; before adding the next
    score stop if the running sum already is >= tau, or if that score is <= 0. Keep the prefix when
    the running sum ended >= tau, otherwise keep nothing. (With all scores 0 the prefix is empty, so
    the step trains on nothing; RAGEN counts such empty steps toward its early stop.)
    For largest=False the scores are walked in ascending order, with the same rules on the raw scores.
    """
    g = scores.shape[0]
    n_cand = jnp.sum(cand)
    order, rank = _rank(scores if largest else -scores, cand)
    sorted_scores = jnp.where(cand[order], scores[order], 0.0)
    threshold = value * jnp.sum(jnp.where(cand, scores, 0.0)) - eps
    cum_inclusive = jnp.cumsum(sorted_scores)
    # cum_before[i] = running sum before considering sorted position i; position g is a sentinel.
    cum_before = jnp.concatenate([jnp.zeros(1, jnp.float32), cum_inclusive])
    position = jnp.arange(g + 1)
    next_score = jnp.concatenate([sorted_scores, jnp.zeros(1, jnp.float32)])
    stop = (cum_before >= threshold) | (next_score <= 0) | (position >= n_cand)
    count = jnp.argmax(stop)  # the sentinel guarantees a True
    reached = cum_before[count] >= threshold
    return cand & (rank < count) & reached


def _top_p_softmax(scores: jax.Array, cand: jax.Array, value: float, largest: bool) -> jax.Array:
    """RAGEN softmax top-p: probs = softmax(+-score) over candidates; keep the first
    k = (first sorted index with cumsum >= p) + 1 groups, at most #candidates (so >= 1 when any)."""
    logits = scores if largest else -scores
    any_cand = jnp.any(cand)
    masked = jnp.where(cand, logits, -jnp.inf)
    # With no candidate every logit is -inf; use zeros to stay finite (the result is masked by cand).
    probs = jax.nn.softmax(jnp.where(any_cand, masked, 0.0))
    probs = jnp.where(cand, probs, 0.0)
    order, rank = _rank(probs, cand)
    cum = jnp.cumsum(probs[order])
    k = jnp.minimum(jnp.sum(cum < value) + 1, jnp.sum(cand))  # torch.searchsorted(cum, p) + 1
    return cand & (rank < k)


def _top_k(scores: jax.Array, cand: jax.Array, k_requested: int, largest: bool) -> jax.Array:
    """Keep the k best candidates, k = max(1, min(k_requested, #candidates)); none if no candidate."""
    _, rank = _rank(scores if largest else -scores, cand)
    k = jnp.maximum(jnp.minimum(k_requested, jnp.sum(cand)), 1)
    return cand & (rank < k)


def _min_p(scores: jax.Array, cand: jax.Array, value: float, largest: bool) -> jax.Array:
    """largest: keep score >= value * max(score); smallest: keep score <= min(score) / value."""
    if largest:
        best = jnp.max(jnp.where(cand, scores, -jnp.inf))
        return cand & (scores >= best * value - _MIN_P_TOL)
    best = jnp.min(jnp.where(cand, scores, jnp.inf))
    return cand & (scores <= best / (value + _MIN_P_TOL) + _MIN_P_TOL)


def select_groups(
    scores: jax.Array,
    strategy: str = "top_p",
    value: float = 0.9,
    top_p_mode: str = "linear",
    include_zero: bool = True,
    eps: float = 0.01,
    largest: bool = True,
) -> jax.Array:
    """Which groups to keep: bool[G] (static shape), RAGEN's ``_select_top_groups`` exactly.

    scores: f32[G] from ``group_scores``. All other arguments are static Python values.
    1. include_zero=False first removes groups with |score| <= 1e-10 from the candidates; with no
       candidate left nothing is kept, whatever the strategy.
    2. strategy:
       top_p  value >= 1 keeps every candidate (value=1, include_zero=True is "no filter");
              mode "linear": see ``_top_p_linear`` (eps = RAGEN's selection_eps, 0.01);
              mode "softmax": see ``_top_p_softmax`` (scale dependent; always keeps >= 1 group).
       top_k  k = max(1, min(int(value * G), #candidates)) best candidates (value is a fraction).
       top_k_abs  k = max(1, min(int(value), #candidates)) best candidates.
       min_p  keep score >= value * max (largest) or score <= min / value (smallest).
    largest=False ranks by lowest score instead (RAGEN's ``rollout_filter_type: smallest``).
    NaN scores make the selection undefined; check rewards with ``check_finite_rewards`` first.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown filter strategy {strategy!r}; expected one of {STRATEGIES}.")
    if top_p_mode not in TOP_P_MODES:
        raise ValueError(f"Unknown top_p_mode {top_p_mode!r}; expected one of {TOP_P_MODES}.")
    scores = jnp.asarray(scores, jnp.float32)
    if scores.ndim != 1:
        raise ValueError(f"scores must be f32[G], got shape {scores.shape}.")
    g = scores.shape[0]
    value = float(value)
    cand = _candidates(scores, include_zero)
    if strategy == "top_p":
        if value >= 1.0:
            return cand
        if top_p_mode == "linear":
            return _top_p_linear(scores, cand, value, float(eps), largest)
        return _top_p_softmax(scores, cand, value, largest)
    if strategy == "top_k":
        return _top_k(scores, cand, int(value * g), largest)
    if strategy == "top_k_abs":
        return _top_k(scores, cand, int(value), largest)
    return _min_p(scores, cand, value, largest)


def is_no_filter(strategy: str, value: float, include_zero: bool) -> bool:
    """True when the settings keep every group untouched (RAGEN then skips the filter entirely)."""
    return strategy == "top_p" and value >= 1.0 and include_zero


def select_groups_variance_mass(variances: jax.Array, top_p: float = 0.9) -> tuple[jax.Array, jax.Array]:
    """VAGEN's ``reward_variance_top_p``: keep the shortest variance-sorted prefix covering p of the mass.

    variances: f32[G] (``group_scores(r, "reward_var")``, ddof 0 as in VAGEN). Sort descending (ties:
    lower index first); before each group stop if the running sum >= p * total; keep at least one
    group. If the total variance is <= 0, keep everything (RAGEN's linear mode keeps nothing there).
    Returns (keep bool[G], loss_scale f32[]): VAGEN multiplies the kept advantages by
    sqrt(#kept / G); when everything is kept because the total is zero it applies no scale (1.0).
    """
    v = jnp.asarray(variances, jnp.float32)
    g = v.shape[0]
    all_cand = jnp.ones(g, bool)
    order, rank = _rank(v, all_cand)
    sorted_v = v[order]
    total = jnp.sum(v)
    target = float(top_p) * total
    cum_before = jnp.concatenate([jnp.zeros(1, jnp.float32), jnp.cumsum(sorted_v)])
    stop = jnp.concatenate([cum_before[:-1] >= target, jnp.ones(1, bool)])
    count = jnp.maximum(jnp.argmax(stop), 1)
    has_mass = total > 0
    keep = jnp.where(has_mass, rank < count, True)
    scale = jnp.where(has_mass, jnp.sqrt(count / g), 1.0).astype(jnp.float32)
    return keep, scale


def soft_reweight_weights(group_std: jax.Array, keep: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """RAGEN's soft advantage reweighting: w_g = std_g / (max_{kept g'} std_g' + eps).

    group_std: f32[G] (the GRPO group std; RAGEN uses 1.0 for singleton groups); keep: bool[G] or
    None (all). The trainer multiplies each kept sample's advantages by its group's weight:
    A <- A * w_g. Weights of dropped groups are 0. Returns f32[G].
    """
    std = jnp.asarray(group_std, jnp.float32)
    keep = jnp.ones(std.shape, bool) if keep is None else jnp.asarray(keep, bool)
    max_std = jnp.max(jnp.where(keep, std, -jnp.inf))
    max_std = jnp.where(jnp.any(keep), max_std, 0.0)
    return jnp.where(keep, std / (max_std + eps), 0.0)


def filter_loss_scale(kept_ratio: jax.Array | float, mode: str = "none") -> jax.Array:
    """RAGEN's ``filter_loss_scaling``: multiply advantages by 1 (none), r (linear) or sqrt(r) (sqrt),
    r = kept groups / G. Returns f32[]."""
    if mode not in LOSS_SCALING_MODES:
        raise ValueError(f"Unknown filter loss scaling {mode!r}; expected one of {LOSS_SCALING_MODES}.")
    r = jnp.asarray(kept_ratio, jnp.float32)
    if mode == "none":
        return jnp.ones((), jnp.float32)
    return r if mode == "linear" else jnp.sqrt(r)


def filter_metrics(rewards: jax.Array, scores: jax.Array, keep: jax.Array) -> dict[str, jax.Array]:
    """RAGEN's filter log: spread statistics over all groups and over the kept groups.

    rewards: f32[G, S]; scores: f32[G] (the selection scores); keep: bool[G]. Keys (f32[] each):
    in_group_reward_{std,max,mean,sum} (mean over all groups), chosen_in_group_reward_* (mean over
    kept groups, 0 if none), filter_kept_count, filter_kept_ratio (= kept / G), filter_zero_count
    (|score| <= 1e-10). The std is the unbiased one, as RAGEN logs it.
    """
    r = jnp.asarray(rewards, jnp.float32)
    keep = jnp.asarray(keep, bool)
    stats = {
        "std": group_scores(r, "reward_std"),
        "max": jnp.max(r, axis=1),
        "mean": group_moments(r).mean,
        "sum": jnp.sum(r, axis=1),
    }
    n_kept = jnp.sum(keep)
    out = {}
    for name, per_group in stats.items():
        out[f"in_group_reward_{name}"] = jnp.mean(per_group)
        chosen = jnp.sum(jnp.where(keep, per_group, 0.0)) / jnp.maximum(n_kept, 1)
        out[f"chosen_in_group_reward_{name}"] = chosen
    out["filter_kept_count"] = n_kept.astype(jnp.float32)
    out["filter_kept_ratio"] = n_kept.astype(jnp.float32) / r.shape[0]
    out["filter_zero_count"] = jnp.sum(jnp.abs(scores) <= ZERO_SCORE_TOL).astype(jnp.float32)
    return out


def all_finite(x: jax.Array) -> jax.Array:
    """Jittable bool[]: every entry of x is finite (log it; act on it on the host)."""
    return jnp.all(jnp.isfinite(jnp.asarray(x)))


def check_finite_rewards(rewards, name: str = "rewards", max_listed: int = 10) -> None:
    """Host-side guard: raise ValueError naming how many rewards are non-finite and where.

    rewards: array-like of any shape (e.g. f32[G, S]); positions are listed as index tuples
    (group, sample) for the first ``max_listed`` offenders. Call before the jitted step: inside jit a
    NaN reward silently becomes NaN scores and NaN advantages.
    """
    r = np.asarray(rewards, dtype=np.float64)
    bad = ~np.isfinite(r)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    where = [tuple(int(i) for i in idx) for idx in np.argwhere(bad)[:max_listed]]
    values = [float(r[idx]) for idx in where]
    more = f" (first {max_listed} shown)" if n_bad > max_listed else ""
    raise ValueError(
        f"{n_bad} non-finite {name} of {r.size} at positions {where}{more} with values {values}. "
        "Fix the environment reward / format penalty that produced them (or drop those episodes) "
        "before computing filter scores and advantages."
    )


__all__ = [
    "SCORE_METRICS",
    "STRATEGIES",
    "TOP_P_MODES",
    "LOSS_SCALING_MODES",
    "ZERO_SCORE_TOL",
    "group_scores",
    "select_groups",
    "is_no_filter",
    "select_groups_variance_mass",
    "soft_reweight_weights",
    "filter_loss_scale",
    "filter_metrics",
    "all_finite",
    "check_finite_rewards",
]
