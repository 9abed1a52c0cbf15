"""The fused PPO / GRPO update: filter -> gather + copy-pad -> score -> advantages -> critic -> actor.

``make_update_step(...)`` returns ONE jitted program (parameters and optimizer states donated) that
turns a ``Trajectories`` batch into new parameters and a dict of float32 scalar metrics:

  a. filter   group scores of ``episode_reward`` [G, S] -> ``select_groups`` -> keep bool[G]
              (rl/filtering.py, RAGEN's rule), filter metrics, soft reweighting / loss scaling factors.
  b. gather   kept rows to the front (stable, group-major order), then copy-padding to a whole number
              of mini-batches (RAGEN's batch adjust "copy" mode: the extra rows are duplicates of random
              kept rows, without replacement when possible; see ``plan_minibatches``). The batch keeps its
              static R rows = R / mb mini-batch slots; slots past ceil(K / mb) are skipped by ``lax.cond``.
  c. score    old log-probs = the sampler's (equal to the trainer's forward on the loss mask), or
              recomputed under the current actor (``recompute_old_logprobs``; the |sampler - recomputed|
              gap is then always logged); reference log-probs when the KL loss is on; critic values (GAE).
  d. advantages on the gathered batch: GAE whitened over the loss tokens of the used rows, *including*
              copy-padding duplicates (RAGEN computes advantages after its batch adjust), or GRPO /
              Dr.GRPO / RLOO from the [G, S] rewards (per-group statistics, so unchanged by filtering).
              Then A <- A * w_g (soft reweight) * s (loss scaling), RAGEN's order.
  e/f. critic (GAE only) then actor, as RAGEN does; both use the values / advantages of (c)-(d).
              ``ppo_epochs`` x mini-batch slots (``lax.scan``), each mini-batch split into micro-batches
              (``lax.scan``) whose loss parts are (sum, count) ``Weighted`` pairs: the gradient of each
              micro-batch's *sum* is accumulated and divided once by the mini-batch count, so it equals
              the gradient of the whole mini-batch's loss. One optimizer step per mini-batch.
  g. guard    a mini-batch whose loss or gradient norm is non-finite makes no optimizer step (params
              and optimizer state unchanged) and is counted in ``update/nonfinite_skipped``.

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
  backward ran over: the used rows x ppo_epochs), update/loss_tokens (loss tokens of the used rows),
  update/nonfinite_skipped (actor + critic mini-batches whose step was skipped).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ragen_jax.models.logprobs import sequence_logprobs
from ragen_jax.rl.optim import learning_rate
from ragen_jax.rl import advantages as adv_lib
from ragen_jax.rl import filtering
from ragen_jax.rl.losses import AGG_MODES, ActorLossConfig, Weighted, accumulate, actor_loss_terms, value_loss
from ragen_jax.rl.losses import weighted_mean
from ragen_jax.rollout.trajectories import Trajectories

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
    ppo_epochs: int = 1
    mini_batch_size: int = 32
    micro_batch_size: int = 8
    group_size: int = 16
    temperature: float = 1.0
    recompute_old_logprobs: bool = False
    logprob_chunk: int = 128
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
        for name in ("ppo_epochs", "mini_batch_size", "micro_batch_size", "group_size", "logprob_chunk"):
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


class UpdateResult(NamedTuple):
    actor_params: Any
    critic_params: Any
    actor_opt_state: Any
    critic_opt_state: Any
    metrics: dict[str, jax.Array]


def _to_slots(x: jax.Array, n_slots: int) -> jax.Array:
    """[R, ...] -> [R / mb, mb, ...]"""
    return x.reshape(n_slots, x.shape[0] // n_slots, *x.shape[1:])


def _to_micro(tree, micro: int):
    """Leaves [mb, ...] -> [mb / micro, micro, ...]"""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // micro, micro, *x.shape[1:]), tree)


def _zeros_like_shapes(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _minibatch_loop(
    loss_fn: Callable, tx: optax.GradientTransformation, params, opt_state, slots: dict, n_used: jax.Array,
    epochs: int, micro: int,
):
    """``epochs`` passes over the mini-batch slots; slot j trains only when j < n_used.

    loss_fn(params, micro_batch) -> (sum_loss f32[], (count f32[], per_mb dict[str, Weighted],
    per_token dict[str, Weighted])). Per mini-batch: grads = sum_micro grad(sum_loss) / sum_micro count
    (= the gradient of the mini-batch loss), one optimizer step unless loss or grads are non-finite.
    Returns (params, opt_state, metrics): per_mb entries are averaged over the trained mini-batches,
    per_token entries are (sum, count) accumulated over everything trained, plus grad_norm, and the
    counts of trained / non-finite mini-batches.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    first_micro = jax.tree.map(lambda x: x[0, :micro], slots)
    out_shapes = jax.eval_shape(grad_fn, params, first_micro)
    (_, (_, mb_shape, tok_shape)), grad_shape = out_shapes
    zero_mb = jax.tree.map(lambda _: Weighted(jnp.zeros(()), jnp.zeros(())), mb_shape,
                           is_leaf=lambda x: isinstance(x, Weighted))
    zero_stats = {
        "per_mb": zero_mb, "per_token": _zeros_like_shapes(tok_shape),
        "grad_norm": Weighted(jnp.zeros(()), jnp.zeros(())), "trained": jnp.zeros(()),
        "nonfinite": jnp.zeros(()),
    }

    def train_one(params, opt_state, batch):
        def micro_step(carry, mb):
            grads_acc, loss_acc, count_acc, per_mb_acc, tok_acc = carry
            (loss_sum, (count, per_mb, per_tok)), grads = grad_fn(params, mb)
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            return (grads_acc, loss_acc + loss_sum, count_acc + count, accumulate(per_mb_acc, per_mb),
                    accumulate(tok_acc, per_tok)), None

        # gradients accumulate in float32 whatever the parameter dtype (bf16 sums would drift)
        grad_zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), grad_shape)
        init = (grad_zeros, jnp.zeros(()), jnp.zeros(()), _zeros_like_shapes(mb_shape),
                _zeros_like_shapes(tok_shape))
        (grads, loss_sum, count, per_mb, per_tok), _ = jax.lax.scan(micro_step, init, _to_micro(batch, micro))
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
        sanitize = lambda x: jnp.where(finite, x, 0.0)
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

    def slot_step(carry, xs):
        params, opt_state, acc = carry
        index, batch = xs
        params, opt_state, stats = jax.lax.cond(
            index < n_used,
            lambda: train_one(params, opt_state, batch),
            lambda: (params, opt_state, zero_stats),
        )
        return (params, opt_state, accumulate(acc, stats)), None

    def epoch_step(carry, _):
        xs = (jnp.arange(jax.tree.leaves(slots)[0].shape[0]), slots)
        return jax.lax.scan(slot_step, carry, xs)[0], None

    (params, opt_state, acc), _ = jax.lax.scan(epoch_step, (params, opt_state, zero_stats), None, length=epochs)
    return params, opt_state, acc


def _turn_end_mask(loss_mask: jax.Array, turn_ids: jax.Array) -> jax.Array:
    """bool[B, L]: loss tokens whose next position is not a loss token of the same turn."""
    next_loss = jnp.concatenate([loss_mask[:, 1:], jnp.zeros_like(loss_mask[:, :1])], axis=1)
    next_turn = jnp.concatenate([turn_ids[:, 1:], jnp.full_like(turn_ids[:, :1], -1)], axis=1)
    return loss_mask & ~(next_loss & (next_turn == turn_ids))


class UpdateStep:
    """The jitted update; call as ``step(actor_params, critic_params, actor_opt_state, critic_opt_state,
    ref_params, traj, key) -> UpdateResult``. ``traces`` counts how often the body was traced."""

    def __init__(self, actor_graphdef, critic_graphdef, config: UpdateConfig, actor_tx, critic_tx):
        self.actor_graphdef = actor_graphdef
        self.critic_graphdef = critic_graphdef
        self.config = config
        self.actor_tx = actor_tx
        self.critic_tx = critic_tx
        self.traces = 0
        self._jitted = jax.jit(self._step, donate_argnums=(0, 1, 2, 3))

    def __call__(self, actor_params, critic_params, actor_opt_state, critic_opt_state, ref_params,
                 traj: Trajectories, key: jax.Array) -> UpdateResult:
        return self._jitted(actor_params, critic_params, actor_opt_state, critic_opt_state, ref_params, traj, key)

    # ------------------------------------------------------------------------------------------------
    def _check(self, critic_params, critic_opt_state, ref_params, traj: Trajectories) -> tuple[int, int]:
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
        if cfg.actor_loss.use_kl_loss and ref_params is None:
            raise ValueError("algorithm.use_kl_loss=True needs ref_params (the reference policy's parameters).")
        if cfg.use_critic and (critic_params is None or critic_opt_state is None):
            raise ValueError(
                "adv_estimator='gae' needs critic_params and critic_opt_state (build a Critic, e.g. "
                "Critic.from_actor, and critic_tx.init(critic_params))."
            )
        return rows // cfg.group_size, rows // cfg.mini_batch_size

    def _score(self, actor_params, critic_params, ref_params, slots, n_used):
        """Forward-only pass over the used slots: recomputed old log-probs, reference log-probs, values."""
        cfg = self.config
        wanted = []
        if cfg.recompute_old_logprobs:
            wanted.append("old_logp")
        if cfg.actor_loss.use_kl_loss:
            wanted.append("ref_logp")
        if cfg.use_critic:
            wanted.append("values")
        if not wanted:
            return {}

        def score_micro(mb):
            out = {}
            if "old_logp" in wanted:
                model = nnx.merge(self.actor_graphdef, actor_params)
                out["old_logp"] = sequence_logprobs(model, mb["tokens"], mb["valid"], cfg.temperature,
                                                    cfg.logprob_chunk)[0]
            if "ref_logp" in wanted:
                ref = nnx.merge(self.actor_graphdef, ref_params)
                out["ref_logp"] = sequence_logprobs(ref, mb["tokens"], mb["valid"], cfg.temperature,
                                                    cfg.logprob_chunk)[0]
            if "values" in wanted:
                critic = nnx.merge(self.critic_graphdef, critic_params)
                out["values"] = critic(mb["tokens"], mb["valid"])
            return out

        inputs = {"tokens": slots["tokens"], "valid": slots["valid"]}
        mb_size = inputs["tokens"].shape[1]

        def score_slot(index, batch):
            def run():
                out = jax.lax.map(score_micro, _to_micro(batch, cfg.micro_batch_size))
                return jax.tree.map(lambda x: x.reshape(mb_size, *x.shape[2:]), out)

            zeros = {k: jnp.zeros(batch["tokens"].shape, jnp.float32) for k in wanted}
            return jax.lax.cond(index < n_used, run, lambda: zeros)

        out = jax.lax.map(lambda xs: score_slot(*xs), (jnp.arange(inputs["tokens"].shape[0]), inputs))
        return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)

    def _step(self, actor_params, critic_params, actor_opt_state, critic_opt_state, ref_params, traj, key):
        self.traces += 1  # Python side effect: runs once per trace, never at run time
        cfg = self.config
        n_groups, n_slots = self._check(critic_params, critic_opt_state, ref_params, traj)
        metrics: dict[str, jax.Array] = {}

        # a. filter -----------------------------------------------------------------------------
        rewards = traj.episode_reward.astype(jnp.float32).reshape(n_groups, cfg.group_size)
        scores = filtering.group_scores(rewards, cfg.filter_metric)
        keep = filtering.select_groups(
            scores, cfg.filter_strategy, cfg.filter_value, cfg.filter_top_p_mode, cfg.filter_include_zero,
            cfg.filter_eps, cfg.filter_largest,
        )
        fm = filtering.filter_metrics(rewards, scores, keep)
        metrics.update({f"rollout/{k}": v for k, v in fm.items()})
        loss_scale = filtering.filter_loss_scale(fm["filter_kept_ratio"], cfg.loss_scaling)
        if cfg.soft_reweight:
            group_weight = filtering.soft_reweight_weights(adv_lib.grpo_group_std(rewards), keep)
        else:
            group_weight = jnp.ones(n_groups, jnp.float32)

        # b. gather kept rows to the front and copy-pad -----------------------------------------
        row_keep = jnp.repeat(keep, cfg.group_size)
        plan = plan_minibatches(row_keep, cfg.mini_batch_size, key)
        take = lambda x: jnp.take(x, plan.src, axis=0)
        tokens, valid = take(traj.tokens), take(traj.valid).astype(bool)
        token_mask = take(traj.loss_mask).astype(bool) & plan.active[:, None]
        row_weight = take(jnp.repeat(group_weight, cfg.group_size)) * loss_scale

        # c. score ------------------------------------------------------------------------------
        to_slots = lambda x: _to_slots(x, n_slots)
        scored = self._score(actor_params, critic_params, ref_params,
                             {"tokens": to_slots(tokens), "valid": to_slots(valid)}, plan.num_minibatches)
        sampler_logp = jnp.where(token_mask, take(traj.logprobs), 0.0)
        if cfg.recompute_old_logprobs:
            old_logp = jnp.where(token_mask, scored["old_logp"], 0.0)
            gap = jnp.where(token_mask, jnp.abs(sampler_logp - old_logp), 0.0)
            metrics["actor/old_logprob_diff_max"] = jnp.max(gap)
            metrics["actor/old_logprob_diff_mean"] = adv_lib.masked_mean(gap, token_mask)
        else:
            old_logp = sampler_logp

        # d. advantages ---------------------------------------------------------------------------
        if cfg.use_critic:
            values = jnp.where(token_mask, scored["values"], 0.0)
            token_rewards = jnp.where(plan.active[:, None], take(traj.reward_tokens), 0.0)
            if cfg.bi_level_gae:
                ends = _turn_end_mask(token_mask, take(traj.turn_ids))
                adv, returns = adv_lib.bilevel_gae_advantages(
                    token_rewards, values, token_mask, ends, cfg.gamma, cfg.lam, cfg.high_level_gamma)
            else:
                adv, returns = adv_lib.gae_advantages(token_rewards, values, token_mask, cfg.gamma, cfg.lam)
        else:
            if cfg.adv_estimator == "grpo":
                seq_adv = adv_lib.grpo_advantages(rewards, cfg.norm_adv_by_std)
            else:
                seq_adv = adv_lib.rloo_advantages(rewards)
            adv = adv_lib.broadcast_to_tokens(take(seq_adv.reshape(-1)), token_mask)
        adv = jnp.where(token_mask, adv * row_weight[:, None], 0.0)
        stats = adv_lib.advantage_stats(adv, token_mask)
        metrics.update({f"critic/advantages/{k.removeprefix('advantage_')}": v for k, v in stats.items()})

        # e/f. critic then actor --------------------------------------------------------------------
        common = {"tokens": tokens, "valid": valid, "mask": token_mask}
        micro = cfg.micro_batch_size
        if cfg.use_critic:
            critic_slots = jax.tree.map(to_slots, {**common, "old_values": values, "returns": returns})
            critic_params, critic_opt_state, cstats = _minibatch_loop(
                self._critic_loss, self.critic_tx, critic_params, critic_opt_state, critic_slots,
                plan.num_minibatches, cfg.ppo_epochs, micro)
            metrics["critic/vf_loss"] = weighted_mean(cstats["per_mb"]["vf_loss"])
            metrics["critic/vf_clipfrac"] = weighted_mean(cstats["per_token"]["vf_clipfrac"])
            metrics["critic/vpred_mean"] = weighted_mean(cstats["per_token"]["vpred_mean"])
            metrics["critic/grad_norm"] = weighted_mean(cstats["grad_norm"])
            metrics["critic/lr"] = learning_rate(critic_opt_state)
            metrics["critic/values_mean"] = adv_lib.masked_mean(values, token_mask)
            metrics["critic/returns_mean"] = adv_lib.masked_mean(returns, token_mask)
            metrics["critic/nonfinite_skipped"] = cstats["nonfinite"]
            critic_skipped = cstats["nonfinite"]
        else:
            critic_skipped = jnp.zeros(())

        actor_inputs = {**common, "old_logp": old_logp, "adv": adv}
        if cfg.actor_loss.use_kl_loss:
            actor_inputs["ref_logp"] = jnp.where(token_mask, scored["ref_logp"], 0.0)
        actor_params, actor_opt_state, astats = _minibatch_loop(
            self._actor_loss, self.actor_tx, actor_params, actor_opt_state, jax.tree.map(to_slots, actor_inputs),
            plan.num_minibatches, cfg.ppo_epochs, micro)
        per_tok = astats["per_token"]
        metrics["actor/pg_loss"] = weighted_mean(astats["per_mb"]["pg_loss"])
        metrics["actor/kl_loss"] = weighted_mean(astats["per_mb"]["kl_loss"])
        metrics["actor/entropy_loss"] = weighted_mean(astats["per_mb"]["entropy_loss"])
        metrics["actor/entropy"] = weighted_mean(per_tok["entropy"])
        metrics["actor/pg_clipfrac"] = weighted_mean(per_tok["clipfrac"])
        metrics["actor/pg_clipfrac_upper"] = weighted_mean(per_tok["clipfrac_upper"])
        metrics["actor/pg_clipfrac_lower"] = weighted_mean(per_tok["clipfrac_lower"])
        metrics["actor/pg_clipfrac_dual"] = weighted_mean(per_tok["clipfrac_dual"])  # verl: pg_clipfrac_lower
        metrics["actor/ppo_kl"] = weighted_mean(per_tok["approx_kl"])
        metrics["actor/grad_norm"] = weighted_mean(astats["grad_norm"])
        metrics["actor/lr"] = learning_rate(actor_opt_state)
        metrics["actor/nonfinite_skipped"] = astats["nonfinite"]

        # h. batch bookkeeping ------------------------------------------------------------------------
        kept_groups = jnp.sum(keep).astype(jnp.float32)
        metrics["filter/kept_groups"] = kept_groups
        metrics["filter/kept_ratio"] = kept_groups / n_groups
        metrics["filter/zero_std_groups"] = fm["filter_zero_count"]
        metrics["filter/kept_rows"] = plan.num_kept.astype(jnp.float32)
        metrics["filter/empty"] = (plan.num_kept == 0).astype(jnp.float32)
        metrics["filter/loss_scale"] = loss_scale
        metrics["rollout/in_group_reward_std"] = fm["in_group_reward_std"]
        metrics["rollout/chosen_in_group_reward_std"] = fm["chosen_in_group_reward_std"]
        metrics["update/minibatches_used"] = plan.num_minibatches.astype(jnp.float32)
        metrics["update/copied_rows"] = jnp.sum(plan.is_copy).astype(jnp.float32)
        active_valid = valid & plan.active[:, None]
        metrics["update/tokens"] = jnp.sum(active_valid).astype(jnp.float32) * cfg.ppo_epochs
        metrics["update/loss_tokens"] = jnp.sum(token_mask).astype(jnp.float32)
        metrics["update/nonfinite_skipped"] = astats["nonfinite"] + critic_skipped
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return UpdateResult(actor_params, critic_params, actor_opt_state, critic_opt_state, metrics)

    # ------------------------------------------------------------------------------------------------
    def _actor_loss(self, params, mb):
        """Sum-form actor loss of one micro-batch: L_pg - c_H agg(H) + c_KL agg(KL), as sums."""
        cfg = self.config
        model = nnx.merge(self.actor_graphdef, params)
        logp, entropy = sequence_logprobs(model, mb["tokens"], mb["valid"], cfg.temperature, cfg.logprob_chunk)
        terms, aux = actor_loss_terms(logp, entropy, mb["old_logp"], mb["adv"], mb["mask"], cfg.actor_loss,
                                      mb.get("ref_logp"))
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

    def _critic_loss(self, params, mb):
        """Sum-form clipped value loss of one micro-batch (verl ``compute_value_loss``)."""
        cfg = self.config
        critic = nnx.merge(self.critic_graphdef, params)
        vpreds = critic(mb["tokens"], mb["valid"])
        loss, aux = value_loss(vpreds, mb["old_values"], mb["returns"], mb["mask"], cfg.value_clip,
                               cfg.critic_loss_agg_mode)
        return loss.sum, (loss.count, {"vf_loss": loss}, aux)


def make_update_step(
    actor_graphdef,
    critic_graphdef,
    update_config: UpdateConfig,
    actor_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation | None,
) -> UpdateStep:
    """Build the jitted update step (see the module docstring for what it does, in order).

    actor_graphdef / critic_graphdef: from ``nnx.split(model)`` (a module is accepted and split);
    critic_graphdef and critic_tx are required when ``update_config.adv_estimator == 'gae'`` and
    ignored otherwise. The returned ``UpdateStep`` is called as
        step(actor_params, critic_params, actor_opt_state, critic_opt_state, ref_params, traj, key)
    with params = the ``nnx.State`` halves of ``nnx.split``, opt states from ``tx.init(params)``,
    ref_params the reference policy's state (or None when the KL loss is off), traj a ``Trajectories``
    of R = G * group_size rows (R a multiple of mini_batch_size) and key a PRNG key (copy-padding).
    The four state arguments are donated: do not reuse them after the call.
    Returns ``UpdateResult(actor_params, critic_params, actor_opt_state, critic_opt_state, metrics)``.
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


__all__ = ["ADV_ESTIMATORS", "UpdateConfig", "MinibatchPlan", "plan_minibatches", "UpdateResult", "UpdateStep",
           "make_update_step"]
