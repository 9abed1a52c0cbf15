"""The fused PPO / GRPO update as named pure stages, called in order by one jitted program.

``make_update_step(...)`` returns ``step(state, traj, key) -> UpdateResult(state, metrics)``: ``state`` a
``rl.state.TrainState`` (its trained part, ``state.trained()``, is donated: use the returned state; ``ref`` is
only read and ``mi_ema`` passed along outside the program), ``traj`` a ``Trajectories`` batch of R = G * S
rows (group-major), ``key`` the copy-padding key; ``metrics`` a dict of float32 scalars. The jitted program,
``UpdateStep.program(state.trained(), state.ref, traj, key, horizon) -> (trained, metrics)`` (``traj`` cropped
to its bucket width, ``horizon`` the rollout's static width), is the stages below,
each a pure function of its inputs (shapes in their docstrings), and nothing else:

  select_and_plan     the paper's filter: group scores of ``episode_reward`` [G, S] -> ``select_groups`` ->
                      keep bool[G] (rl/filtering.py, RAGEN's rule), the loss-scaling factor s and soft
                      reweighting weights w_g; then the mini-batch plan: kept rows to the front (stable,
                      group-major order), copy-padded to a whole number of mini-batches (RAGEN's batch adjust
                      "copy" mode: duplicates of random kept rows, without replacement when possible; see
                      ``plan_minibatches``). The batch keeps its static R rows = R / mb mini-batch slots;
                      slots past ceil(K / mb) are skipped by ``lax.cond``.
  gather_batch        the plan applied: the R slots' tokens, masks, sampler log-probs, rewards, weights.
  score               forward-only: old log-probs = the sampler's (equal to the trainer's forward on the
                      loss mask), or recomputed under the current actor (``recompute_old_logprobs``);
                      reference log-probs when the KL loss is on; critic values (GAE).
  compute_advantages  on the gathered batch: GAE whitened over the loss tokens of the used rows,
                      *including* copy-padding duplicates (RAGEN computes advantages after its batch
                      adjust), or GRPO / Dr.GRPO / RLOO from the [G, S] rewards (per-group statistics, so
                      unchanged by filtering). Then A <- A * w_g (soft reweight) * s (loss scaling), RAGEN's
                      order.
  update_critic       (GAE only) then update_actor, as RAGEN does; both use the values / advantages above.
  update_actor        ``ppo_epochs`` x mini-batch slots (``lax.scan``), each mini-batch's rows packed into as
                      few rows as hold them (``pack_rows``, rl/packing.py; empty micro-batches skipped) and split into
                      micro-batches (``lax.scan``) whose loss parts are (sum, count) ``Weighted`` pairs: the
                      gradient of each micro-batch's *sum* is accumulated and divided once by the mini-batch
                      count, so it equals the gradient of the whole mini-batch's loss. One optimizer step per
                      mini-batch; a mini-batch whose loss or gradient norm is non-finite makes no step
                      (parameters and optimizer state unchanged) and is counted in ``*/nonfinite_skipped``.
  update_metrics      every metric below, from the stages' outputs.

Parameters are jit arguments (``nnx.merge`` inside), so new parameters never cause a recompile.

Metrics (float32 scalars; verl / RAGEN names where they exist):
  actor/pg_loss, actor/entropy_loss, actor/kl_loss (means over the trained mini-batches);
  actor/entropy (token mean of the full-vocabulary entropy of the update's forward);
  actor/pg_clipfrac, actor/pg_clipfrac_upper (A > 0, ratio > 1 + clip_high), actor/pg_clipfrac_lower
  (A < 0, ratio < 1 - clip_low), actor/pg_clipfrac_dual (verl's "pg_clipfrac_lower": the dual clip bound),
  actor/ppo_kl, actor/grad_norm (pre-clip, mean over mini-batches), actor/lr, actor/nonfinite_skipped;
  actor/old_logprob_diff_{max,mean} (only with recompute_old_logprobs: |sampler - recomputed| on the
  loss tokens); critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean, critic/grad_norm, critic/lr,
  critic/values_mean, critic/returns_mean, critic/nonfinite_skipped (GAE only);
  critic/advantages/{mean,std,min,max,nonzero_frac} (after reweighting / scaling);
  filter/{kept_groups,kept_ratio,zero_std_groups,kept_rows,empty,loss_scale}; rollout/* (RAGEN's filter
  log: in_group_reward_*, chosen_in_group_reward_*, filter_kept_count/ratio, filter_zero_count);
  update/minibatches_used, update/copied_rows, update/tokens (valid tokens the actor's forward and
  backward ran over: the used rows x ppo_epochs), update/rows_run (rows of the bucket width those passes
  ran: fewer than the used rows when packed), update/loss_tokens (loss tokens of the used rows),
  update/width (the bucket width the step ran at, see ``update_width``),
  update/nonfinite_skipped (actor + critic mini-batches whose step was skipped).

The file runs past ~400 lines because the stages, their typed outputs and the mini-batch loop they share
are one program, read top to bottom in the order it runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ragen_jax.models.logprobs import sequence_logprobs
from ragen_jax.rl.optim import learning_rate
from ragen_jax.rl.packing import pack_rows
from ragen_jax.rl import advantages as adv_lib
from ragen_jax.rl import filtering
from ragen_jax.rl.losses import AGG_MODES, ActorLossConfig, Weighted, accumulate, actor_loss_terms, value_loss
from ragen_jax.rl.losses import weighted_mean
from ragen_jax.rl.state import TrainState
from ragen_jax.rollout.trajectories import Trajectories, host_copy

ADV_ESTIMATORS = ("gae", "grpo", "rloo")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Static settings of the update step (all hashable; defaults = RAGEN-2's base config)."""

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    bi_level_gae: bool = False
    high_level_gamma: float = 0.95
    norm_adv_by_std: bool = True
    actor_loss: ActorLossConfig = ActorLossConfig()
    value_clip: float = 0.5
    critic_loss_agg_mode: str = "token-mean"  # verl's critic default (``critic.loss_agg_mode``)
    critic_norm_length: float | None = None  # seq-mean-token-sum-norm horizon; None = the rollout's width
    ppo_epochs: int = 1
    mini_batch_size: int = 32
    micro_batch_size: int = 8
    group_size: int = 16
    temperature: float = 1.0
    recompute_old_logprobs: bool = False
    logprob_chunk: int = 128
    width_buckets: int = 8
    remat: bool = False
    pack_rows: bool = True
    filter_metric: str = "reward_std"
    filter_strategy: str = "top_p"
    filter_value: float = 1.0
    filter_top_p_mode: str = "linear"
    filter_include_zero: bool = True
    filter_eps: float = 0.01
    filter_largest: bool = True
    soft_reweight: bool = False
    loss_scaling: str = "none"

    def __post_init__(self):
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(
                f"Unknown algorithm.adv_estimator {self.adv_estimator!r}; expected one of {ADV_ESTIMATORS}."
            )
        if self.bi_level_gae and self.adv_estimator != "gae":
            raise ValueError("algorithm.bi_level_gae needs algorithm.adv_estimator='gae'.")
        if self.critic_loss_agg_mode not in AGG_MODES:
            raise ValueError(f"Unknown critic loss_agg_mode {self.critic_loss_agg_mode!r}; expected {AGG_MODES}.")
        for name in ("ppo_epochs", "mini_batch_size", "micro_batch_size", "group_size", "logprob_chunk",
                     "width_buckets"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"algorithm.mini_batch_size ({self.mini_batch_size}) must be a multiple of "
                f"algorithm.micro_batch_size ({self.micro_batch_size}); change one of them."
            )
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0 for training, got {self.temperature}.")
        if self.filter_strategy not in filtering.STRATEGIES:
            raise ValueError(f"Unknown filter.strategy {self.filter_strategy!r}; expected {filtering.STRATEGIES}.")
        if self.filter_top_p_mode not in filtering.TOP_P_MODES:
            raise ValueError(f"Unknown filter.top_p_mode {self.filter_top_p_mode!r}; expected {filtering.TOP_P_MODES}.")
        if self.loss_scaling not in filtering.LOSS_SCALING_MODES:
            raise ValueError(
                f"Unknown filter.loss_scaling {self.loss_scaling!r}; expected {filtering.LOSS_SCALING_MODES}."
            )
        filtering.group_scores(jnp.zeros((1, 2)), self.filter_metric)  # validates the metric name

    @property
    def use_critic(self) -> bool:
        return self.adv_estimator == "gae"

    @classmethod
    def from_config(cls, config: Any) -> "UpdateConfig":
        """Build from the run config (configs/base.py: algorithm.*, filter.*, rollout.*).

        ``algorithm.recompute_old_logprobs`` and ``algorithm.logprob_chunk`` are read when present
        (defaults False / 128). Also checks that n_groups * group_size is a multiple of mini_batch_size.
        """
        alg, flt, rollout = config.algorithm, config.filter, config.rollout
        rows = int(rollout.n_groups) * int(rollout.group_size)
        if rows % int(alg.mini_batch_size):
            raise ValueError(
                f"rollout.n_groups * rollout.group_size = {rows} rows is not a multiple of "
                f"algorithm.mini_batch_size = {alg.mini_batch_size}; pick a mini-batch size that divides it."
            )
        loss = ActorLossConfig(
            clip_low=float(alg.clip_ratio_low), clip_high=float(alg.clip_ratio_high), clip_c=float(alg.clip_ratio_c),
            agg_mode=str(alg.loss_agg_mode), entropy_coeff=float(alg.entropy_coeff),
            use_kl_loss=bool(alg.use_kl_loss), kl_coef=float(alg.kl_coeff), kl_type=str(alg.kl_type),
        )
        return cls(
            adv_estimator=str(alg.adv_estimator), gamma=float(alg.gamma), lam=float(alg.lam),
            bi_level_gae=bool(alg.bi_level_gae), high_level_gamma=float(alg.high_level_gamma),
            norm_adv_by_std=bool(alg.norm_adv_by_std), actor_loss=loss, value_clip=float(alg.value_clip),
            ppo_epochs=int(alg.ppo_epochs), mini_batch_size=int(alg.mini_batch_size),
            micro_batch_size=int(alg.micro_batch_size), group_size=int(rollout.group_size),
            temperature=float(rollout.temperature),
            recompute_old_logprobs=bool(alg.get("recompute_old_logprobs", False)),
            logprob_chunk=int(alg.get("logprob_chunk", 128)),
            width_buckets=int(alg.get("width_buckets", 8)),
            remat=bool(alg.get("remat", False)),
            pack_rows=bool(alg.get("pack_rows", True)),
            filter_metric=str(flt.metric), filter_strategy=str(flt.strategy), filter_value=float(flt.value),
            filter_top_p_mode=str(flt.top_p_mode), filter_include_zero=bool(flt.include_zero),
            filter_eps=float(flt.eps), filter_largest=bool(flt.largest), soft_reweight=bool(flt.soft_reweight),
            loss_scaling=str(flt.loss_scaling),
        )


class MinibatchPlan(NamedTuple):
    """Where each of the R slots of the gathered batch reads its row from.

    src int32[R]: source row of slot j; active bool[R]: slot j is in a used mini-batch
    (j < num_minibatches * mb); is_copy bool[R]: slot j is a copy-padding duplicate;
    num_kept int32[]: K; num_minibatches int32[]: ceil(K / mb).
    """

    src: jax.Array
    active: jax.Array
    is_copy: jax.Array
    num_kept: jax.Array
    num_minibatches: jax.Array


def plan_minibatches(row_keep: jax.Array, mini_batch_size: int, key: jax.Array) -> MinibatchPlan:
    """Kept rows first (stable), then copy-padding up to ceil(K / mb) * mb rows.

    row_keep: bool[R]. Slots j < K read the j-th kept row (original order). Slots K <= j read
    perm[(j - K) mod K], perm a random permutation of the kept rows (``key``): distinct duplicates while
    the padding needs at most K rows, cycling through the permutation otherwise. Slots past the used
    mini-batches also read kept rows (never touched; this keeps filtered rows out of every computation).
    With K = 0 nothing is used (src is the identity).
    """
    r = row_keep.shape[0]
    slot = jnp.arange(r, dtype=jnp.int32)
    num_kept = jnp.sum(row_keep, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(row_keep, 0, 1), stable=True).astype(jnp.int32)
    priority = jnp.where(row_keep, jax.random.uniform(key, (r,)), 2.0)
    perm = jnp.argsort(priority).astype(jnp.int32)
    copy_src = perm[jnp.mod(slot - num_kept, jnp.maximum(num_kept, 1))]
    src = jnp.where(slot < num_kept, order, jnp.where(num_kept > 0, copy_src, slot))
    num_minibatches = (num_kept + mini_batch_size - 1) // mini_batch_size
    active = slot < num_minibatches * mini_batch_size
    return MinibatchPlan(src, active, active & (slot >= num_kept), num_kept, num_minibatches)


# ------------------------------------------------------------------------------ the stages' outputs
class Selection(NamedTuple):
    """The filter's decision and the mini-batch plan (``select_and_plan``).

    rewards f32[G, S]: episode rewards by group; keep bool[G]: kept groups; filter_stats dict[str, f32[]]:
    ``filtering.filter_metrics`` (RAGEN's filter log); loss_scale f32[]: s; group_weight f32[G]: w_g (ones
    without soft reweighting); plan: where each of the R slots reads its row.
    """

    rewards: jax.Array
    keep: jax.Array
    filter_stats: dict[str, jax.Array]
    loss_scale: jax.Array
    group_weight: jax.Array
    plan: MinibatchPlan


class Batch(NamedTuple):
    """The R slots the update trains on, slot j holding row ``plan.src[j]`` of the rollout (``gather_batch``).

    tokens int32[R, L]; valid bool[R, L]; mask bool[R, L]: the loss tokens of the active slots (the only
    tokens a loss, an advantage or a metric reads); sampler_logp f32[R, L]: the rollout's log-probs on the
    mask, 0 elsewhere; reward_tokens f32[R, L]: the episode reward at the last generated token, 0 on
    inactive slots; turn_ids int32[R, L]; row_weight f32[R]: w_g * s of the slot's group.
    """

    tokens: jax.Array
    valid: jax.Array
    mask: jax.Array
    sampler_logp: jax.Array
    reward_tokens: jax.Array
    turn_ids: jax.Array
    row_weight: jax.Array


class Scores(NamedTuple):
    """The forward-only pass over the used slots (``score``); each f32[R, L], 0 off the mask.

    old_logp: log pi_old(a_t | s_t), the PPO ratio's denominator (the sampler's, or recomputed);
    ref_logp: log pi_ref(a_t | s_t) (None without the KL loss); values: V(s_t) (None without a critic).
    """

    old_logp: jax.Array
    ref_logp: jax.Array | None
    values: jax.Array | None


class Advantages(NamedTuple):
    """adv f32[R, L]: A * w_g * s on the mask, 0 elsewhere; returns f32[R, L]: GAE's value targets
    A_gae + V (None for GRPO / RLOO)."""

    adv: jax.Array
    returns: jax.Array | None


class UpdateResult(NamedTuple):
    """What the step returns: the new ``TrainState`` (actor, critic and their optimizer states updated; ref
    and mi_ema the same objects) and the metrics (dict[str, f32[]])."""

    state: TrainState
    metrics: dict[str, jax.Array]


# ------------------------------------------------------------------------------------- the stages
def select_and_plan(cfg: UpdateConfig, traj: Trajectories, key: jax.Array) -> Selection:
    """Filter the G groups (SNR-Aware Filtering) and plan the mini-batches of the kept rows.

    score_g = metric(rewards_g) (reward std by default); keep = select_groups(score) (top-p / top-k /
    top-k-abs / min-p); s = loss_scale(K_groups / G); w_g = soft reweight of std_g (or 1);
    plan = kept rows first, copy-padded to ceil(K / mb) * mb slots (``plan_minibatches``, random ``key``).
    traj: R = G * group_size rows, group-major.
    """
    n_groups = traj.episode_reward.shape[0] // cfg.group_size
    rewards = traj.episode_reward.astype(jnp.float32).reshape(n_groups, cfg.group_size)
    scores = filtering.group_scores(rewards, cfg.filter_metric)
    keep = filtering.select_groups(
        scores, cfg.filter_strategy, cfg.filter_value, cfg.filter_top_p_mode, cfg.filter_include_zero,
        cfg.filter_eps, cfg.filter_largest,
    )
    stats = filtering.filter_metrics(rewards, scores, keep)
    loss_scale = filtering.filter_loss_scale(stats["filter_kept_ratio"], cfg.loss_scaling)
    if cfg.soft_reweight:
        group_weight = filtering.soft_reweight_weights(adv_lib.grpo_group_std(rewards), keep)
    else:
        group_weight = jnp.ones(n_groups, jnp.float32)
    plan = plan_minibatches(jnp.repeat(keep, cfg.group_size), cfg.mini_batch_size, key)
    return Selection(rewards, keep, stats, loss_scale, group_weight, plan)


def gather_batch(cfg: UpdateConfig, traj: Trajectories, sel: Selection) -> Batch:
    """Slot j <- row src[j] for every per-row field; mask = loss_mask[src] & active; row_weight =
    w[group of src] * s. Filtered-out rows reach no later stage (they are never gathered)."""
    plan = sel.plan
    take = lambda x: jnp.take(x, plan.src, axis=0)  # noqa: E731  [R, ...] -> [R, ...] in slot order
    mask = take(traj.loss_mask).astype(bool) & plan.active[:, None]
    return Batch(
        tokens=take(traj.tokens),
        valid=take(traj.valid).astype(bool),
        mask=mask,
        sampler_logp=jnp.where(mask, take(traj.logprobs), 0.0),
        reward_tokens=jnp.where(plan.active[:, None], take(traj.reward_tokens), 0.0),
        turn_ids=take(traj.turn_ids),
        row_weight=take(jnp.repeat(sel.group_weight, cfg.group_size)) * sel.loss_scale,
    )


def score(cfg: UpdateConfig, actor_graphdef, critic_graphdef, state: TrainState, batch: Batch,
          n_used: jax.Array) -> Scores:
    """Old log-probs (the sampler's, or log pi_actor(a_t | s_t) with ``recompute_old_logprobs``), reference
    log-probs log pi_ref (KL loss) and values V(s_t) (GAE), masked to the loss tokens.

    Forward only, micro-batch by micro-batch over the first ``n_used`` (int32[]) mini-batch slots; the
    other slots cost nothing (``lax.cond``).
    """
    forward = _score_forward(cfg, actor_graphdef, critic_graphdef, state, batch, n_used)
    on_mask = lambda x: jnp.where(batch.mask, x, 0.0)  # noqa: E731
    return Scores(
        old_logp=on_mask(forward["old_logp"]) if cfg.recompute_old_logprobs else batch.sampler_logp,
        ref_logp=on_mask(forward["ref_logp"]) if cfg.actor_loss.use_kl_loss else None,
        values=on_mask(forward["values"]) if cfg.use_critic else None,
    )


def compute_advantages(cfg: UpdateConfig, sel: Selection, batch: Batch, scores: Scores) -> Advantages:
    """A on the slots' loss tokens, then A <- A * w_g * s (RAGEN: reweight after the estimator).

    gae:  delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_k (gamma lam)^k delta_{t+k} over loss tokens,
          returns = A + V, A whitened over the used slots' loss tokens (bi-level: per turn, then across
          turns with ``high_level_gamma``); rl/advantages.py.
    grpo: A_i = (R_i - mean_g) / (std_g + eps) (Dr.GRPO without the std); rloo: A_i = R_i - mean_{g, -i};
          from the [G, S] rewards, gathered to the slots and broadcast over the sequence's loss tokens.
    """
    if cfg.use_critic:
        if cfg.bi_level_gae:
            ends = _turn_end_mask(batch.mask, batch.turn_ids)
            adv, returns = adv_lib.bilevel_gae_advantages(
                batch.reward_tokens, scores.values, batch.mask, ends, cfg.gamma, cfg.lam, cfg.high_level_gamma)
        else:
            adv, returns = adv_lib.gae_advantages(batch.reward_tokens, scores.values, batch.mask, cfg.gamma, cfg.lam)
    else:
        if cfg.adv_estimator == "grpo":
            seq_adv = adv_lib.grpo_advantages(sel.rewards, cfg.norm_adv_by_std)
        else:
            seq_adv = adv_lib.rloo_advantages(sel.rewards)
        adv = adv_lib.broadcast_to_tokens(jnp.take(seq_adv.reshape(-1), sel.plan.src, axis=0), batch.mask)
        returns = None
    return Advantages(jnp.where(batch.mask, adv * batch.row_weight[:, None], 0.0), returns)


def update_critic(cfg: UpdateConfig, graphdef, tx: optax.GradientTransformation, params, opt_state, batch: Batch,
                  scores: Scores, advantages: Advantages, n_used: jax.Array):
    """``ppo_epochs`` passes of the clipped value loss over the used mini-batches (verl ``compute_value_loss``):
    L_V = agg(max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2)) / 2. Returns (params, opt_state, stats)
    (stats: ``_minibatch_loop``'s)."""
    inputs = {"tokens": batch.tokens, "valid": batch.valid, "mask": batch.mask, "old_values": scores.values,
              "returns": advantages.returns}
    return _minibatch_loop(functools.partial(_critic_micro_loss, cfg, graphdef), tx, params, opt_state,
                           _train_slots(cfg, inputs), n_used, cfg.ppo_epochs, cfg.micro_batch_size)


def update_actor(cfg: UpdateConfig, graphdef, tx: optax.GradientTransformation, params, opt_state, batch: Batch,
                 scores: Scores, advantages: Advantages, n_used: jax.Array):
    """``ppo_epochs`` passes of the actor loss over the used mini-batches: PPO clip (clip-higher, dual clip)
    - c_H agg(H) + c_KL agg(KL(pi || pi_ref)) (rl/losses.py). Returns (params, opt_state, stats)."""
    inputs = {"tokens": batch.tokens, "valid": batch.valid, "mask": batch.mask, "old_logp": scores.old_logp,
              "adv": advantages.adv}
    if cfg.actor_loss.use_kl_loss:
        inputs["ref_logp"] = scores.ref_logp
    slots = _train_slots(cfg, inputs)
    params, opt_state, stats = _minibatch_loop(functools.partial(_actor_micro_loss, cfg, graphdef), tx, params,
                                               opt_state, slots, n_used, cfg.ppo_epochs, cfg.micro_batch_size)
    return params, opt_state, {**stats, "rows_run": _rows_run(slots, n_used, cfg.micro_batch_size)}


def update_metrics(cfg: UpdateConfig, sel: Selection, batch: Batch, scores: Scores, advantages: Advantages,
                   actor_stats: dict, critic_stats: dict | None, state: TrainState) -> dict[str, jax.Array]:
    """The metrics of the module docstring (every value f32[]) from the stages' outputs and the new state
    (its optimizer states hold the learning rates)."""
    metrics = _filter_metrics(cfg, sel)
    metrics.update(_batch_metrics(cfg, sel, batch, actor_stats, critic_stats))
    if cfg.recompute_old_logprobs:
        gap = jnp.where(batch.mask, jnp.abs(batch.sampler_logp - scores.old_logp), 0.0)  # |sampler - forward|
        metrics["actor/old_logprob_diff_max"] = jnp.max(gap)
        metrics["actor/old_logprob_diff_mean"] = adv_lib.masked_mean(gap, batch.mask)
    stats = adv_lib.advantage_stats(advantages.adv, batch.mask)
    metrics.update({f"critic/advantages/{k.removeprefix('advantage_')}": v for k, v in stats.items()})
    if critic_stats is not None:
        metrics.update(_critic_metrics(critic_stats, state.critic_opt, batch, scores, advantages))
    metrics.update(_actor_metrics(actor_stats, state.actor_opt))
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


# --------------------------------------------------------------------------------- stage helpers
def _slots(tree: dict, mini_batch_size: int) -> dict:
    """Leaves [R, ...] -> [R / mb, mb, ...] (one entry per mini-batch slot)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // mini_batch_size, mini_batch_size, *x.shape[1:]), tree)


def _train_slots(cfg: UpdateConfig, inputs: dict) -> dict:
    """The mini-batch slots the actor or critic trains on (leaves [R / mb, mb, L]); with ``pack_rows`` each
    slot's rows packed into its first rows, plus ``"segments"`` (``rl/packing.py``)."""
    slots = _slots(inputs, cfg.mini_batch_size)
    return jax.vmap(pack_rows)(slots) if cfg.pack_rows else slots


def _rows_run(slots: dict, n_used: jax.Array, micro: int) -> jax.Array:
    """f32[]: rows one pass of forward and backward runs over: the used slots' micro-batches that hold a
    token, times the micro-batch size (packed slots leave their last micro-batches empty)."""
    micro_valid = _to_micro(jax.tree.map(lambda x: x.swapaxes(0, 1), slots["valid"]), micro)  # [mb/m, m, n, L]
    holds = jnp.any(micro_valid, axis=(1, 3))  # [mb / micro, n_slots]
    used = jnp.arange(holds.shape[1]) < n_used
    return jnp.sum(holds & used[None, :]).astype(jnp.float32) * micro


def _to_micro(tree, micro: int):
    """Leaves [mb, ...] -> [mb / micro, micro, ...]"""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // micro, micro, *x.shape[1:]), tree)


def _score_forward(cfg: UpdateConfig, actor_graphdef, critic_graphdef, state: TrainState, batch: Batch,
                   n_used: jax.Array) -> dict[str, jax.Array]:
    """{"old_logp", "ref_logp", "values"} (those the config needs), each f32[R, L]; zeros in unused slots."""
    wanted = [name for name, on in (("old_logp", cfg.recompute_old_logprobs),
                                    ("ref_logp", cfg.actor_loss.use_kl_loss), ("values", cfg.use_critic)) if on]
    if not wanted:
        return {}

    def score_micro(mb):
        out = {}
        if "old_logp" in wanted:
            model = nnx.merge(actor_graphdef, state.actor)
            out["old_logp"] = sequence_logprobs(model, mb["tokens"], mb["valid"], cfg.temperature,
                                                cfg.logprob_chunk)[0]
        if "ref_logp" in wanted:
            ref = nnx.merge(actor_graphdef, state.ref)
            out["ref_logp"] = sequence_logprobs(ref, mb["tokens"], mb["valid"], cfg.temperature,
                                                cfg.logprob_chunk)[0]
        if "values" in wanted:
            critic = nnx.merge(critic_graphdef, state.critic)
            out["values"] = critic(mb["tokens"], mb["valid"])
        return out

    inputs = _slots({"tokens": batch.tokens, "valid": batch.valid}, cfg.mini_batch_size)
    mb_size = cfg.mini_batch_size

    def score_slot(index, slot):
        def run():
            out = jax.lax.map(score_micro, _to_micro(slot, cfg.micro_batch_size))
            return jax.tree.map(lambda x: x.reshape(mb_size, *x.shape[2:]), out)

        zeros = {k: jnp.zeros(slot["tokens"].shape, jnp.float32) for k in wanted}
        return jax.lax.cond(index < n_used, run, lambda: zeros)

    out = jax.lax.map(lambda xs: score_slot(*xs), (jnp.arange(inputs["tokens"].shape[0]), inputs))
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)


def _turn_end_mask(loss_mask: jax.Array, turn_ids: jax.Array) -> jax.Array:
    """bool[B, L]: loss tokens whose next position is not a loss token of the same turn."""
    next_loss = jnp.concatenate([loss_mask[:, 1:], jnp.zeros_like(loss_mask[:, :1])], axis=1)
    next_turn = jnp.concatenate([turn_ids[:, 1:], jnp.full_like(turn_ids[:, :1], -1)], axis=1)
    return loss_mask & ~(next_loss & (next_turn == turn_ids))


def _actor_micro_loss(cfg: UpdateConfig, graphdef, params, mb):
    """Sum-form actor loss of one micro-batch: L_pg - c_H agg(H) + c_KL agg(KL), as sums."""
    model = nnx.merge(graphdef, params)
    segments = mb.get("segments")
    logp, entropy = sequence_logprobs(model, mb["tokens"], mb["valid"], cfg.temperature, cfg.logprob_chunk,
                                      cfg.remat, segments)
    terms, aux = actor_loss_terms(logp, entropy, mb["old_logp"], mb["adv"], mb["mask"], cfg.actor_loss,
                                  mb.get("ref_logp"), segments=segments)
    total = terms["task"].sum + terms["entropy"].sum + terms["kl"].sum
    count = terms["task"].count
    kl = aux.get("kl", Weighted(jnp.zeros(()), count))
    per_mb = {
        "pg_loss": terms["task"],
        "entropy_loss": terms["entropy"],
        "kl_loss": Weighted(kl.sum, kl.count),
    }
    per_token = {k: aux[k] for k in ("entropy", "clipfrac", "clipfrac_upper", "clipfrac_lower",
                                     "clipfrac_dual", "approx_kl")}
    return total, (count, per_mb, per_token)


def _critic_micro_loss(cfg: UpdateConfig, graphdef, params, mb):
    """Sum-form clipped value loss of one micro-batch (verl ``compute_value_loss``)."""
    critic = nnx.merge(graphdef, params)
    segments = mb.get("segments")
    vpreds = critic(mb["tokens"], mb["valid"], cfg.remat, segments)
    loss, aux = value_loss(vpreds, mb["old_values"], mb["returns"], mb["mask"], cfg.value_clip,
                           cfg.critic_loss_agg_mode, cfg.critic_norm_length, segments=segments)
    return loss.sum, (loss.count, {"vf_loss": loss}, aux)


def _filter_metrics(cfg: UpdateConfig, sel: Selection) -> dict[str, jax.Array]:
    """rollout/* (RAGEN's filter log) and filter/*."""
    metrics = {f"rollout/{k}": v for k, v in sel.filter_stats.items()}
    kept_groups = jnp.sum(sel.keep).astype(jnp.float32)
    metrics["filter/kept_groups"] = kept_groups
    metrics["filter/kept_ratio"] = kept_groups / sel.keep.shape[0]
    metrics["filter/zero_std_groups"] = sel.filter_stats["filter_zero_count"]
    metrics["filter/kept_rows"] = sel.plan.num_kept.astype(jnp.float32)
    metrics["filter/empty"] = (sel.plan.num_kept == 0).astype(jnp.float32)
    metrics["filter/loss_scale"] = sel.loss_scale
    return metrics


def _batch_metrics(cfg: UpdateConfig, sel: Selection, batch: Batch, actor_stats: dict,
                   critic_stats: dict | None) -> dict[str, jax.Array]:
    """update/*: what the step trained on and how many mini-batch steps it skipped."""
    plan = sel.plan
    critic_skipped = jnp.zeros(()) if critic_stats is None else critic_stats["nonfinite"]
    return {
        "update/minibatches_used": plan.num_minibatches.astype(jnp.float32),
        "update/copied_rows": jnp.sum(plan.is_copy).astype(jnp.float32),
        "update/tokens": jnp.sum(batch.valid & plan.active[:, None]).astype(jnp.float32) * cfg.ppo_epochs,
        "update/rows_run": actor_stats["rows_run"] * cfg.ppo_epochs,
        "update/loss_tokens": jnp.sum(batch.mask).astype(jnp.float32),
        "update/width": jnp.asarray(batch.tokens.shape[1], jnp.float32),
        "update/nonfinite_skipped": actor_stats["nonfinite"] + critic_skipped,
    }


def _critic_metrics(stats: dict, opt_state, batch: Batch, scores: Scores,
                    advantages: Advantages) -> dict[str, jax.Array]:
    """critic/*: the value loss and its clip fraction over the trained mini-batches, the values and returns."""
    return {
        "critic/vf_loss": weighted_mean(stats["per_mb"]["vf_loss"]),
        "critic/vf_clipfrac": weighted_mean(stats["per_token"]["vf_clipfrac"]),
        "critic/vpred_mean": weighted_mean(stats["per_token"]["vpred_mean"]),
        "critic/grad_norm": weighted_mean(stats["grad_norm"]),
        "critic/lr": learning_rate(opt_state),
        "critic/values_mean": adv_lib.masked_mean(scores.values, batch.mask),
        "critic/returns_mean": adv_lib.masked_mean(advantages.returns, batch.mask),
        "critic/nonfinite_skipped": stats["nonfinite"],
    }


def _actor_metrics(stats: dict, opt_state) -> dict[str, jax.Array]:
    """actor/*: losses averaged over the trained mini-batches, token-level entropy, clip fractions and KL."""
    per_mb, per_tok = stats["per_mb"], stats["per_token"]
    return {
        "actor/pg_loss": weighted_mean(per_mb["pg_loss"]),
        "actor/kl_loss": weighted_mean(per_mb["kl_loss"]),
        "actor/entropy_loss": weighted_mean(per_mb["entropy_loss"]),
        "actor/entropy": weighted_mean(per_tok["entropy"]),
        "actor/pg_clipfrac": weighted_mean(per_tok["clipfrac"]),
        "actor/pg_clipfrac_upper": weighted_mean(per_tok["clipfrac_upper"]),
        "actor/pg_clipfrac_lower": weighted_mean(per_tok["clipfrac_lower"]),
        "actor/pg_clipfrac_dual": weighted_mean(per_tok["clipfrac_dual"]),  # verl: pg_clipfrac_lower
        "actor/ppo_kl": weighted_mean(per_tok["approx_kl"]),
        "actor/grad_norm": weighted_mean(stats["grad_norm"]),
        "actor/lr": learning_rate(opt_state),
        "actor/nonfinite_skipped": stats["nonfinite"],
    }


# ------------------------------------------------------------------------------- the mini-batch loop
class _LossShapes(NamedTuple):
    """Abstract shapes of one micro-batch's gradient and its per-mini-batch / per-token loss parts."""

    grads: Any
    per_mb: Any
    per_token: Any


def _zeros_like_shapes(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _accumulate_micro(grad_fn: Callable, params, batch: dict, micro: int, shapes: _LossShapes):
    """Sum over the mini-batch's micro-batches (``lax.scan``) of grad(sum_loss), sum_loss, count and the loss
    parts. batch leaves [mb, ...]; returns (grads f32 tree, loss_sum f32[], count f32[], per_mb, per_token).
    Packed rows (``"segments"`` in batch) leave their last micro-batches empty: those are skipped, as they
    add exactly zero."""

    def run(mb):
        (loss_sum, (count, per_mb, per_tok)), grads = grad_fn(params, mb)
        return loss_sum, count, per_mb, per_tok, grads

    def skip(_):
        return (jnp.zeros(()), jnp.zeros(()), _zeros_like_shapes(shapes.per_mb),
                _zeros_like_shapes(shapes.per_token), _zeros_like_shapes(shapes.grads))

    def micro_step(carry, mb):
        grads_acc, loss_acc, count_acc, per_mb_acc, tok_acc = carry
        if "segments" in mb:
            loss_sum, count, per_mb, per_tok, grads = jax.lax.cond(jnp.any(mb["valid"]), run, skip, mb)
        else:
            loss_sum, count, per_mb, per_tok, grads = run(mb)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return (grads_acc, loss_acc + loss_sum, count_acc + count, accumulate(per_mb_acc, per_mb),
                accumulate(tok_acc, per_tok)), None

    # gradients accumulate in float32 whatever the parameter dtype (bf16 sums would drift)
    grad_zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shapes.grads)
    init = (grad_zeros, jnp.zeros(()), jnp.zeros(()), _zeros_like_shapes(shapes.per_mb),
            _zeros_like_shapes(shapes.per_token))
    return jax.lax.scan(micro_step, init, _to_micro(batch, micro))[0]


def _train_minibatch(grad_fn: Callable, tx: optax.GradientTransformation, params, opt_state, batch: dict,
                     micro: int, shapes: _LossShapes):
    """One optimizer step on one mini-batch: grads = sum_micro grad(sum_loss) / sum_micro count, skipped
    (params and opt_state unchanged, stats zeroed, nonfinite = 1) when the loss or |grads| is non-finite."""
    grads, loss_sum, count, per_mb, per_tok = _accumulate_micro(grad_fn, params, batch, micro, shapes)
    inv = jnp.where(count > 0, 1.0 / jnp.where(count > 0, count, 1.0), 0.0)
    grads = jax.tree.map(lambda g: g * inv, grads)
    loss = loss_sum * inv
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(_):
        updates, new_opt = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    params, opt_state = jax.lax.cond(finite, apply, lambda _: (params, opt_state), None)
    keep = finite.astype(jnp.float32)
    sanitize = lambda x: jnp.where(finite, x, 0.0)  # noqa: E731
    stats = {
        # per mini-batch value sum / count, averaged over the finite mini-batches
        "per_mb": jax.tree.map(lambda w: Weighted(sanitize(weighted_mean(w)), keep), per_mb,
                               is_leaf=lambda x: isinstance(x, Weighted)),
        "per_token": jax.tree.map(sanitize, per_tok),
        "grad_norm": Weighted(sanitize(grad_norm), keep),
        "trained": keep,
        "nonfinite": 1.0 - keep,
    }
    return params, opt_state, stats


def _minibatch_loop(
    loss_fn: Callable, tx: optax.GradientTransformation, params, opt_state, slots: dict, n_used: jax.Array,
    epochs: int, micro: int,
):
    """``epochs`` passes over the mini-batch slots (leaves [n_slots, mb, ...]); slot j trains only when
    j < n_used.

    loss_fn(params, micro_batch) -> (sum_loss f32[], (count f32[], per_mb dict[str, Weighted],
    per_token dict[str, Weighted])). Per mini-batch: ``_train_minibatch``. Returns (params, opt_state,
    stats): per_mb entries are averaged over the trained mini-batches, per_token entries are (sum, count)
    accumulated over everything trained, plus grad_norm, and the counts of trained / non-finite
    mini-batches.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    first_micro = jax.tree.map(lambda x: x[0, :micro], slots)
    (_, (_, mb_shape, tok_shape)), grad_shape = jax.eval_shape(grad_fn, params, first_micro)
    shapes = _LossShapes(grad_shape, mb_shape, tok_shape)
    zero_mb = jax.tree.map(lambda _: Weighted(jnp.zeros(()), jnp.zeros(())), mb_shape,
                           is_leaf=lambda x: isinstance(x, Weighted))
    zero_stats = {
        "per_mb": zero_mb, "per_token": _zeros_like_shapes(tok_shape),
        "grad_norm": Weighted(jnp.zeros(()), jnp.zeros(())), "trained": jnp.zeros(()),
        "nonfinite": jnp.zeros(()),
    }

    def slot_step(carry, xs):
        params, opt_state, acc = carry
        index, batch = xs
        params, opt_state, stats = jax.lax.cond(
            index < n_used,
            lambda: _train_minibatch(grad_fn, tx, params, opt_state, batch, micro, shapes),
            lambda: (params, opt_state, zero_stats),
        )
        return (params, opt_state, accumulate(acc, stats)), None

    def epoch_step(carry, _):
        xs = (jnp.arange(jax.tree.leaves(slots)[0].shape[0]), slots)
        return jax.lax.scan(slot_step, carry, xs)[0], None

    (params, opt_state, acc), _ = jax.lax.scan(epoch_step, (params, opt_state, zero_stats), None, length=epochs)
    return params, opt_state, acc


# ---------------------------------------------------------------------------------- the jitted step
def update_width(longest: int, seq_len: int, buckets: int) -> int:
    """The width the update runs at: the smallest bucket width that holds the batch's longest row.

    Bucket widths are k * step (k = 1, 2, ...) capped at ``seq_len``, step = ceil(seq_len / buckets)
    rounded up to a multiple of 8: at most ``buckets`` widths, so at most that many compiles of the update
    per run, each running < step padding positions per row past the longest. ``buckets`` = 1 always runs
    at ``seq_len``, the rollout's static width.
    """
    step = -(-seq_len // buckets)
    step = -(-step // 8) * 8
    return min(seq_len, max(1, -(-longest // step)) * step)


class UpdateStep:
    """The jitted update; call as ``step(state, traj, key) -> UpdateResult(state, metrics)`` (``state`` a
    ``TrainState`` whose trained part is donated). ``program`` is the jitted function itself,
    ``program(trained, ref, traj, key, horizon) -> (trained, metrics)`` (trained = ``state.trained()``,
    donated; horizon static, see ``_step``): the
    reference parameters and the MI state stay out of its outputs, so they are never copied or donated.

    A call first crops the batch to ``update_width`` (``fit_width``): the rows are right-padded to the
    rollout's static width, and the forward, backward, masks and reductions then cost the real tokens plus
    less than one bucket step, not that width; the program compiles once per bucket width it meets.
    ``traces_by_width`` counts how often the body was traced at each width, ``traces`` is the largest of
    those counts (1 when every width compiled once)."""

    def __init__(self, actor_graphdef, critic_graphdef, config: UpdateConfig, actor_tx, critic_tx):
        self.actor_graphdef = actor_graphdef
        self.critic_graphdef = critic_graphdef
        self.config = config
        self.actor_tx = actor_tx
        self.critic_tx = critic_tx
        self.traces_by_width: dict[int, int] = {}
        self.program = jax.jit(self._step, donate_argnums=0, static_argnums=4)

    @property
    def traces(self) -> int:
        return max(self.traces_by_width.values(), default=0)

    def fit_width(self, traj: Trajectories) -> Trajectories:
        """``traj`` cropped to ``update_width(max(lengths), L, width_buckets)``; unchanged at full width."""
        longest = int(np.max(host_copy(traj.lengths)))
        width = update_width(longest, traj.seq_len, self.config.width_buckets)
        return traj if width == traj.seq_len else traj.crop(width)

    def __call__(self, state: TrainState, traj: Trajectories, key: jax.Array) -> UpdateResult:
        trained, metrics = self.program(state.trained(), state.ref, self.fit_width(traj), key, traj.seq_len)
        return UpdateResult(state.replace(**trained), metrics)

    def _step(self, trained: dict, ref, traj: Trajectories, key: jax.Array,
              horizon: int) -> tuple[dict, dict[str, jax.Array]]:
        """The stages in order; trained: ``TrainState.trained()``, ref: the reference parameters or None,
        horizon (static): the rollout's static width, seq-mean-token-sum-norm's constant (a cropped batch
        must divide by the same constant as the uncropped one, not by its bucket width)."""
        width = traj.seq_len  # Python side effect below: runs once per trace, never at run time
        self.traces_by_width[width] = self.traces_by_width.get(width, 0) + 1
        cfg = self.config
        if cfg.actor_loss.norm_length is None:
            cfg = dataclasses.replace(cfg, actor_loss=dataclasses.replace(cfg.actor_loss, norm_length=float(horizon)))
        if cfg.critic_norm_length is None:
            cfg = dataclasses.replace(cfg, critic_norm_length=float(horizon))
        state = TrainState(**trained, ref=ref)
        self._check(state, traj)
        sel = select_and_plan(cfg, traj, key)
        batch = gather_batch(cfg, traj, sel)
        n_used = sel.plan.num_minibatches
        scores = score(cfg, self.actor_graphdef, self.critic_graphdef, state, batch, n_used)
        advantages = compute_advantages(cfg, sel, batch, scores)
        critic, critic_opt, critic_stats = state.critic, state.critic_opt, None
        if cfg.use_critic:
            critic, critic_opt, critic_stats = update_critic(
                cfg, self.critic_graphdef, self.critic_tx, critic, critic_opt, batch, scores, advantages, n_used)
        actor, actor_opt, actor_stats = update_actor(
            cfg, self.actor_graphdef, self.actor_tx, state.actor, state.actor_opt, batch, scores, advantages, n_used)
        state = state.replace(actor=actor, critic=critic, actor_opt=actor_opt, critic_opt=critic_opt)
        return state.trained(), update_metrics(cfg, sel, batch, scores, advantages, actor_stats, critic_stats, state)

    def _check(self, state: TrainState, traj: Trajectories) -> None:
        cfg = self.config
        rows = traj.tokens.shape[0]
        if rows % cfg.group_size:
            raise ValueError(
                f"the batch has {rows} rows, not a multiple of group_size {cfg.group_size}; rows must be laid "
                "out group-major (row = g * group_size + s)."
            )
        if rows % cfg.mini_batch_size:
            raise ValueError(
                f"the batch has {rows} rows, not a multiple of algorithm.mini_batch_size "
                f"{cfg.mini_batch_size}; pick a mini-batch size that divides n_groups * group_size."
            )
        if cfg.actor_loss.use_kl_loss and state.ref is None:
            raise ValueError("algorithm.use_kl_loss=True needs ref_params (the reference policy's parameters, "
                             "TrainState.ref).")
        if cfg.use_critic and (state.critic is None or state.critic_opt is None):
            raise ValueError(
                "adv_estimator='gae' needs critic_params and critic_opt_state in the TrainState (build a Critic, "
                "e.g. Critic.from_actor, and critic_tx.init(critic_params))."
            )


def make_update_step(
    actor_graphdef,
    critic_graphdef,
    update_config: UpdateConfig,
    actor_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation | None,
) -> UpdateStep:
    """Build the jitted update step (see the module docstring for its stages, in order).

    actor_graphdef / critic_graphdef: from ``nnx.split(model)`` (a module is accepted and split);
    critic_graphdef and critic_tx are required when ``update_config.adv_estimator == 'gae'`` and
    ignored otherwise. The returned ``UpdateStep`` is called as ``step(state, traj, key)`` with ``state`` a
    ``TrainState``: actor / critic the ``nnx.State`` halves of ``nnx.split``, actor_opt / critic_opt from
    ``tx.init(params)`` (critic and critic_opt None without a critic), ref the reference policy's state
    (None when the KL loss is off), mi_ema passed through; traj a ``Trajectories`` of R = G * group_size
    rows (R a multiple of mini_batch_size) and key a PRNG key (copy-padding). The trained part of the state
    (actor, critic, their optimizer states) is donated: use the returned state. Returns
    ``UpdateResult(state, metrics)``.
    """
    if isinstance(actor_graphdef, nnx.Module):
        actor_graphdef = nnx.split(actor_graphdef)[0]
    if isinstance(critic_graphdef, nnx.Module):
        critic_graphdef = nnx.split(critic_graphdef)[0]
    if update_config.use_critic and (critic_graphdef is None or critic_tx is None):
        raise ValueError(
            "adv_estimator='gae' trains a critic: pass its graphdef and optimizer (ragen_jax.models.critic.Critic, "
            "ragen_jax.rl.optim.make_optimizer(optim.critic_lr, ...)), or use algorithm.adv_estimator='grpo'."
        )
    return UpdateStep(actor_graphdef, critic_graphdef, update_config, actor_tx, critic_tx)


__all__ = ["ADV_ESTIMATORS", "UpdateConfig", "update_width", "MinibatchPlan", "plan_minibatches", "Selection", "Batch", "Scores",
           "Advantages", "UpdateResult", "select_and_plan", "gather_batch", "score", "compute_advantages",
           "update_critic", "update_actor", "update_metrics", "UpdateStep", "make_update_step"]
