"""The training loop: rollout -> MI diagnostics -> filtered PPO/GRPO update -> record (RAGEN ``agent_trainer.py::fit``).

Per step s (1-based), everything random is a function of (config.seed, s), so a resumed run repeats
the uninterrupted one exactly:
  1. rollout of n_groups x group_size episodes on env seeds train_seed + (s-1) * n_groups + g;
  2. MI diagnostics at step 1 and every ``mi.every`` steps, on the pre-filter batch, for the
     first-turn and trajectory strategies (``ragen_jax.diagnostics``);
  3. the fused update (``ragen_jax.rl.update``): filter groups, copy-pad, score, advantages, critic and
     actor mini-batch updates;
  4. metrics (JSONL + TensorBoard + progress line), sample conversations, validation every
     ``validation.every`` steps (and before training), early-stopping rules (``early_stop``),
     checkpoints every ``trainer.checkpoint_every`` steps, at the end, at an early stop and on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.diagnostics import mi_sampling
from ragen_jax.diagnostics.cross_scoring import TRACE_COUNTS, score_pairs
from ragen_jax.diagnostics.mi import init_marginal_std_ema, should_compute_mi
from ragen_jax.parallel import distributed, sharding
from ragen_jax.rl.filtering import check_finite_rewards
from ragen_jax.rl.optim import make_optimizer
from ragen_jax.rl.update import UpdateConfig, make_update_step
from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.layout import RolloutConfig, rollout_config
from ragen_jax.rollout.validation import concat, validation_metrics
from ragen_jax.setup.build import build_env, build_policy, build_tokenizer
from ragen_jax.sft.warm_start import load_warm_start
from ragen_jax.train.checkpoint import Checkpointer, PreemptionGuard
from ragen_jax.train.early_stop import EarlyStop
from ragen_jax.train.metrics import MetricsWriter, Progress

MI_STRATEGIES = {"first_turn": "collapse_first_turn_sample", "trajectory": "collapse_trajectory_sample"}
PROGRESS_KEYS = ("train/success", "val/success", "rollout/in_group_reward_std", "filter/kept_ratio",
                 "collapse_trajectory_sample/mi_estimate")


@dataclasses.dataclass
class Run:
    """Everything built once per run from the config."""

    config: Any
    tokenizer: Any
    env: Any
    env_params: Any
    actor_graphdef: Any
    critic_graphdef: Any
    rollout_cfg: RolloutConfig
    rollout: Rollout
    val_rollout: Rollout
    update_step: Any
    actor_tx: Any
    critic_tx: Any


@dataclasses.dataclass
class TrainState:
    """What a checkpoint holds as arrays (``meta`` holds the rest)."""

    actor: Any
    critic: Any
    actor_opt: Any
    critic_opt: Any
    ref: Any
    mi_ema: dict

    def tree(self) -> dict:
        return {"actor": self.actor, "critic": self.critic, "actor_opt": self.actor_opt,
                "critic_opt": self.critic_opt, "ref": self.ref, "mi_ema": self.mi_ema}

    @classmethod
    def from_tree(cls, tree: dict) -> "TrainState":
        return cls(**tree)


def build_run(config) -> tuple[Run, TrainState]:
    tokenizer = build_tokenizer(config)
    env, env_params = build_env(config)
    actor, critic = build_policy(config, tokenizer, warm_start=load_warm_start)
    actor_graphdef, actor_params = nnx.split(actor)
    update_cfg = UpdateConfig.from_config(config)
    o = config.optim
    actor_tx = make_optimizer(o.actor_lr, o.b1, o.b2, o.weight_decay, o.grad_clip)
    critic_tx, critic_graphdef, critic_params, critic_opt = None, None, None, None
    if update_cfg.use_critic:
        critic_graphdef, critic_params = nnx.split(critic)
        critic_tx = make_optimizer(o.critic_lr, o.b1, o.b2, o.weight_decay, o.grad_clip)
        critic_opt = critic_tx.init(critic_params)
    r_cfg = rollout_config(config)
    rollout = Rollout(actor_graphdef, tokenizer, env, r_cfg, env_params=env_params, model_cfg=actor.cfg)
    # Validation: n_groups x 1 sample per chunk, as many chunks as validation.episodes needs; built
    # once so that every validation reuses one compiled program.
    val_cfg = dataclasses.replace(r_cfg, n_groups=min(config.validation.episodes, r_cfg.batch), group_size=1)
    val_rollout = Rollout(actor_graphdef, tokenizer, env, val_cfg, env_params=env_params, model_cfg=actor.cfg)
    update_step = make_update_step(actor_graphdef, critic_graphdef, update_cfg, actor_tx, critic_tx)
    ref = jax.tree.map(jnp.copy, actor_params) if config.algorithm.use_kl_loss else None
    labels = tuple(MI_STRATEGIES.values())
    state = TrainState(actor=actor_params, critic=critic_params, actor_opt=actor_tx.init(actor_params),
                       critic_opt=critic_opt, ref=ref, mi_ema={k: init_marginal_std_ema() for k in labels})
    run = Run(config, tokenizer, env, env_params, actor_graphdef, critic_graphdef, r_cfg, rollout, val_rollout,
              update_step, actor_tx, critic_tx)
    return run, state


def rollout_metrics(traj) -> dict[str, float]:
    t = traj.to_numpy()
    played = max(int(t.turn_active.sum()), 1)
    return {
        "train/success": float(t.success.mean()),
        "train/episode_reward": float(t.episode_reward.mean()),
        "train/num_actions": float(t.num_actions.mean()),
        "train/valid_action_rate": float((t.turn_format_ok & t.turn_active).sum() / played),
        "train/num_turns": float(t.num_turns.mean()),
        "train/response_length": float(t.response_lengths.sum() / played),
        "train/sequence_length": float(t.lengths.mean()),
        "train/generated_tokens": float(t.loss_mask.sum()),
    }


def mi_diagnostics(run: Run, state: TrainState, traj, key) -> tuple[dict[str, float], dict]:
    """Both MI strategies on the pre-filter batch; returns (metrics, new EMA states)."""
    cfg, r = run.config, run.rollout_cfg
    model = nnx.merge(run.actor_graphdef, state.actor)
    common = dict(prompt_len=run.rollout.cache_len, reasoning_len=r.max_new_tokens)
    metrics, ema = {}, dict(state.mi_ema)
    strategies = [s for s in ("first_turn", "trajectory") if getattr(cfg.mi, s)]
    for i, name in enumerate(strategies):
        k = jax.random.fold_in(key, i)
        if name == "first_turn":
            pairs = mi_sampling.sample_first_turn_pairs(
                k, traj.tokens, traj.valid, traj.reasoning_mask, traj.turn_ids, traj.group_ids,
                num_samples=cfg.mi.num_samples, num_groups=r.n_groups, **common)
        else:
            pairs = mi_sampling.sample_trajectory_pairs(
                k, traj.tokens, traj.valid, traj.reasoning_mask, traj.turn_ids,
                num_samples=cfg.mi.num_samples, max_turns=r.max_turns, **common)
        label = MI_STRATEGIES[name]
        out, ema[label] = score_pairs(model, pairs, ema[label], r.temperature, std_eps=cfg.mi.std_eps,
                                      ema_decay=cfg.mi.ema_decay)
        metrics.update({f"{label}/{k2}": v for k2, v in out.items()})
    return metrics, ema


def validate(run: Run, params, step: int) -> dict[str, float]:
    """Validation rollouts on seeds validation.seed + i, i < validation.episodes (RAGEN: 512 x 1 from 123)."""
    cfg, r = run.config, run.val_rollout.config
    key = jax.random.fold_in(jax.random.key(cfg.seed + 7919), step)
    n = cfg.validation.episodes
    seeds = r.val_seed + np.arange(-(-n // r.n_groups) * r.n_groups, dtype=np.int32)
    temperature = r.val_temperature
    parts = [
        run.val_rollout.run(params, jax.random.fold_in(key, c), chunk, temperature, greedy=r.val_greedy).to_numpy()
        for c, chunk in enumerate(np.split(seeds, len(seeds) // r.n_groups))
    ]
    trajs = jax.tree.map(lambda x: x[:n], concat(parts))
    return {f"val/{k}": v for k, v in validation_metrics(trajs, group_size=1).items()}


def _block(tree):
    jax.block_until_ready(tree)
    return tree


def train(config, run_dir: str) -> dict:
    """Train (or resume) in ``run_dir``; returns a summary (last metrics, stop reason, wall time)."""
    t_start = time.time()
    run, state = build_run(config)
    is_main = distributed.is_main_process()
    # Place the state on the ('data', 'fsdp', 'tensor') mesh before restoring, so that a checkpoint
    # comes back with the same shardings.
    run, state = sharding.shard_run(run, state, sharding.make_mesh(config))
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=config.trainer.keep_checkpoints)
    early = EarlyStop.from_config(config)
    start = 1
    if ckpt.latest_step() is not None:
        tree, meta, step = ckpt.restore(state.tree())
        state = TrainState.from_tree(tree)
        early = EarlyStop.from_json(meta["early_stop"])
        start = step + 1
        if is_main:
            print(f"resuming from checkpoint step {step} in {ckpt.directory}", flush=True)
    writer = MetricsWriter(run_dir, enabled=is_main)
    progress = Progress(config.trainer.total_steps, start - 1, enabled=is_main and config.trainer.progress,
                        keys=PROGRESS_KEYS)
    guard = PreemptionGuard()
    base_key = jax.random.key(config.seed)
    last: dict[str, float] = {}
    stop_reason = ""

    def save(step: int) -> None:
        ckpt.save(step, state.tree(), {"step": step, "early_stop": early.to_json(),
                                        "seed_counter": run.rollout_cfg.train_seed + step * run.rollout_cfg.n_groups})

    try:
        if start == 1 and config.validation.every > 0:
            last = writer.write(0, validate(run, state.actor, 0))
            progress.update(0, last)
        for step in range(start, config.trainer.total_steps + 1):
            key = jax.random.fold_in(base_key, step)
            k_roll, k_mi, k_upd = jax.random.split(key, 3)
            metrics: dict[str, Any] = {}
            t0 = time.time()
            traj = _block(run.rollout.run(state.actor, k_roll, run.rollout_cfg.train_seeds(step - 1)))
            metrics["timing/rollout_s"] = time.time() - t0
            check_finite_rewards(np.asarray(traj.episode_reward), "episode rewards")
            metrics.update(rollout_metrics(traj))

            if config.mi.enabled and should_compute_mi(step, config.mi.every) and config.rollout.context_mode == "full":
                t1 = time.time()
                mi_metrics, state.mi_ema = mi_diagnostics(run, state, traj, k_mi)
                metrics.update(_block(mi_metrics))
                metrics["timing/mi_s"] = time.time() - t1

            t2 = time.time()
            result = run.update_step(state.actor, state.critic, state.actor_opt, state.critic_opt, state.ref,
                                     traj, k_upd)
            _block(result.metrics)
            state.actor, state.critic = result.actor_params, result.critic_params
            state.actor_opt, state.critic_opt = result.actor_opt_state, result.critic_opt_state
            metrics["timing/update_s"] = time.time() - t2
            metrics.update(result.metrics)
            metrics["timing/step_s"] = time.time() - t0
            metrics["throughput/generated_tokens_per_s"] = metrics["train/generated_tokens"] / max(
                metrics["timing/rollout_s"], 1e-9)
            metrics["throughput/update_tokens_per_s"] = float(result.metrics.get("update/tokens", 0.0)) / max(
                metrics["timing/update_s"], 1e-9)

            empty = float(result.metrics.get("filter/empty", 0.0)) > 0
            nonfinite = float(result.metrics.get("update/nonfinite_skipped", 0.0)) > 0
            stop_reason = early.after_step(float(metrics.get("rollout/in_group_reward_std", np.nan)), empty, nonfinite)

            if config.validation.every > 0 and (step % config.validation.every == 0 or step == config.trainer.total_steps):
                metrics.update(validate(run, state.actor, step))
                stop_reason = stop_reason or early.after_validation(metrics["val/success"])
            if config.trainer.sample_every > 0 and (step == 1 or step % config.trainer.sample_every == 0):
                for i in range(min(2, traj.num_rows)):
                    writer.write_text(step, f"train sample {i} (reward {float(traj.episode_reward[i]):.3g})",
                                      traj.to_text(i, run.tokenizer))
            metrics["early_stop/reward_std_baseline"] = early.baseline if early.baseline is not None else np.nan
            last = writer.write(step, metrics)
            progress.update(step, last)

            done = step == config.trainer.total_steps
            if stop_reason or done or guard.requested or step % config.trainer.checkpoint_every == 0:
                save(step)
            if stop_reason:
                if is_main:
                    print(f"early stop at step {step}: {stop_reason}: {early.explain()}", flush=True)
                break
            if guard.requested:
                stop_reason = "preempted"
                if is_main:
                    print(f"SIGTERM: checkpoint written at step {step}; exiting", flush=True)
                break
    finally:
        guard.close()
        writer.close()
        ckpt.close()
    if is_main and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        from ragen_jax.train.plots import make_plots

        make_plots(run_dir)
    return {
        "run_dir": run_dir,
        "stop_reason": stop_reason or "completed",
        "wall_time_s": time.time() - t_start,
        "traces": trace_counts(run),
        "last": {k: v for k, v in last.items() if k.startswith(("train/", "val/", "filter/", "rollout/"))},
    }


def trace_counts(run: Run) -> dict[str, int]:
    """How often each jitted program of the run was traced (each should be 1)."""
    counts = {"rollout": run.rollout.trace_count, "validation_rollout": run.val_rollout.trace_count,
              "update": run.update_step.traces}
    counts.update({f"mi/{k}": v for k, v in TRACE_COUNTS.items()})
    return counts


def evaluate(config, run_dir: str) -> dict[str, float]:
    """Validation rollouts of the latest checkpoint in ``run_dir`` (or of the initial policy when none)."""
    run, state = build_run(config)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=config.trainer.keep_checkpoints)
    step = ckpt.latest_step()
    if step is not None:
        tree, _, step = ckpt.restore(state.tree())
        state = TrainState.from_tree(tree)
    ckpt.close()
    metrics = validate(run, state.actor, step or 0)
    metrics["checkpoint_step"] = float(step or 0)
    return metrics
