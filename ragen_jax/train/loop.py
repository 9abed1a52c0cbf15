"""The training loop: rollout -> MI diagnostics -> filtered PPO/GRPO update -> record (RAGEN ``agent_trainer.py::fit``).

Per step s (1-based), everything random is a function of (config.seed, s), so a resumed run repeats
the uninterrupted one exactly:
  1. rollout of n_groups x group_size episodes on env seeds train_seed + (s-1) * n_groups + g;
  2. MI diagnostics at step 1 and every ``mi.every`` steps, on the pre-filter batch, for the
     first-turn and trajectory strategies (``ragen_jax.diagnostics``);
  3. the fused update (``ragen_jax.rl.update``), ``state, metrics = update_step(state, traj, key)``: its
     stages select_and_plan (filter the groups, copy-padded mini-batch plan) -> gather_batch -> score ->
     compute_advantages -> update_critic -> update_actor -> update_metrics;
  4. metrics (JSONL + TensorBoard + progress line), sample conversations, validation every
     ``validation.every`` steps (and before training), early-stopping rules (``early_stop``),
     checkpoints every ``trainer.checkpoint_every`` steps, at the end, at an early stop and on SIGTERM.

No run is damaged by a later command (``train`` on an existing run directory):
  * ``RUN_DIR/config.json`` is written (atomically) only once the run is built and its resume checks
    passed, so a command that fails leaves the run's config, and so ``ragen_jax.export``, intact;
  * every checkpoint's meta holds the config it was trained with; a resume that changes what a step
    computes is refused unless ``trainer.allow_config_change`` accepts it (``train.resume``);
  * a checkpoint that does not restore is reported in one line and the one before it is used;
  * a checkpoint is saved only when its parameters are finite and their largest magnitude grew at most
    ``trainer.max_param_growth`` times since the last good checkpoint (an exploded update stops the run
    unsaved instead); the *last good* checkpoint (the newest whose parameters then produced a finite
    update) is never rotated out;
  * metrics.jsonl and samples.txt are cut back to the restored step before a resume appends to them, and
    the actor / critic metrics of an update whose every mini-batch was skipped are NaN (JSON null), not 0.
The resume and checkpoint rules are in ``train.resume``; this file applies them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable

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
from ragen_jax.rl.state import TrainState
from ragen_jax.rl.train_reward import train_reward
from ragen_jax.rl.update import UpdateConfig, make_update_step
from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.host_stepped import HostRollout
from ragen_jax.rollout.layout import RolloutConfig, rollout_config
from ragen_jax.rollout.validation import episode_metrics, validation_metrics, validation_rollouts
from ragen_jax.setup.build import build_env, build_host_env, build_policy, build_tokenizer, is_host_env
from ragen_jax.setup.compile_memory import release_after_compiles
from ragen_jax.sft.warm_start import load_warm_start
from ragen_jax.train.checkpoint import Checkpointer, PreemptionGuard
from ragen_jax.train.early_stop import EarlyStop
from ragen_jax.train.resume import (CheckpointGate, check_resume_config, mask_untrained_metrics, resume_early_stop,
                                    with_config_hyperparams)
from ragen_jax.train.metrics import read_metrics, truncate_run_logs, write_atomic
from ragen_jax.train.recorder import StepRecorder
from ragen_jax.train.report import summary_lines
from ragen_jax.train.rollouts import build_rollouts, host_error_metrics

MI_STRATEGIES = {"first_turn": "collapse_first_turn_sample", "trajectory": "collapse_trajectory_sample"}
def write_run_config(run_dir: str, config) -> None:
    """``RUN_DIR/config.json`` (what ``ragen_jax.export`` reads), replaced atomically."""
    os.makedirs(run_dir, exist_ok=True)
    write_atomic(os.path.join(run_dir, "config.json"), config.to_json(indent=2) + "\n")


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
    rollout: Rollout | HostRollout
    val_rollout: Rollout | HostRollout
    update_step: Any
    actor_tx: Any
    critic_tx: Any

    def close(self) -> None:
        """Stop the host envs' worker processes (shared by the training and validation rollouts)."""
        for rollout in (self.rollout, self.val_rollout):
            rollout.close()


def build_run(config, warm_start: Callable[[Any, nnx.Module], nnx.State] = load_warm_start) -> tuple[Run, TrainState]:
    """The run of ``config`` and its initial state. ``warm_start(config, actor)``: the actor's parameters
    when ``config.init == "sft"`` (``setup.build.build_policy``)."""
    tokenizer = build_tokenizer(config)
    env, env_params = (build_host_env(config), None) if is_host_env(config) else build_env(config)
    actor, critic = build_policy(config, tokenizer, warm_start=warm_start)
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
    rollout, val_rollout = build_rollouts(config, tokenizer, actor_graphdef, actor.cfg, env, env_params)
    update_step = make_update_step(actor_graphdef, critic_graphdef, update_cfg, actor_tx, critic_tx)
    ref = jax.tree.map(jnp.copy, actor_params) if config.algorithm.use_kl_loss else None
    labels = tuple(MI_STRATEGIES.values())
    state = TrainState(actor=actor_params, critic=critic_params, actor_opt=actor_tx.init(actor_params),
                       critic_opt=critic_opt, ref=ref, mi_ema={k: init_marginal_std_ema() for k in labels})
    run = Run(config, tokenizer, env, env_params, actor_graphdef, critic_graphdef, r_cfg, rollout, val_rollout,
              update_step, actor_tx, critic_tx)
    return run, state


def rollout_metrics(traj) -> dict[str, float]:
    """train/*: the episode means (``rollout.validation.episode_metrics``), the mean sequence length and
    the number of generated (loss) tokens of the training batch."""
    t = traj.to_numpy()
    metrics = {f"train/{k}": v for k, v in episode_metrics(t).items()}
    metrics["train/sequence_length"] = float(t.lengths.mean())
    metrics["train/generated_tokens"] = float(t.loss_mask.sum())
    return metrics


def mi_pairs(run: Run, traj, key, strategy: str) -> mi_sampling.MIPairs:
    """The (prompt, reasoning) pairs one MI strategy ("first_turn" | "trajectory") scores on ``traj``."""
    cfg, r = run.config, run.rollout_cfg
    common = dict(prompt_len=run.rollout.cache_len, reasoning_len=r.max_new_tokens)
    if strategy == "first_turn":
        return mi_sampling.sample_first_turn_pairs(
            key, traj.tokens, traj.valid, traj.reasoning_mask, traj.turn_ids, traj.group_ids,
            num_samples=cfg.mi.num_samples, num_groups=r.n_groups, **common)
    if strategy == "trajectory":
        return mi_sampling.sample_trajectory_pairs(
            key, traj.tokens, traj.valid, traj.reasoning_mask, traj.turn_ids,
            num_samples=cfg.mi.num_samples, max_turns=r.max_turns, **common)
    raise ValueError(f"unknown MI strategy {strategy!r}: one of {sorted(MI_STRATEGIES)}")


def mi_diagnostics(run: Run, state: TrainState, traj, key) -> tuple[dict[str, float], dict]:
    """Both MI strategies on the pre-filter batch; returns (metrics, new EMA states)."""
    cfg = run.config
    model = nnx.merge(run.actor_graphdef, state.actor)
    metrics, ema = {}, dict(state.mi_ema)
    strategies = [s for s in ("first_turn", "trajectory") if getattr(cfg.mi, s)]
    for i, name in enumerate(strategies):
        pairs = mi_pairs(run, traj, jax.random.fold_in(key, i), name)
        label = MI_STRATEGIES[name]
        out, ema[label] = score_pairs(model, pairs, ema[label], run.rollout_cfg.temperature, std_eps=cfg.mi.std_eps,
                                      ema_decay=cfg.mi.ema_decay, width_buckets=cfg.mi.width_buckets)
        metrics.update({f"{label}/{k2}": v for k2, v in out.items()})
    return metrics, ema


def validate(run: Run, params, step: int) -> dict[str, float]:
    """Validation rollouts on seeds validation.seed + i, i < validation.episodes (RAGEN: 512 x 1 from 123)."""
    cfg, r = run.config, run.val_rollout.config
    key = jax.random.fold_in(jax.random.key(cfg.seed + 7919), step)
    trajs = validation_rollouts(run.val_rollout, params, key, cfg.validation.episodes, r.val_temperature,
                                r.val_greedy)
    metrics = {f"val/{k}": v for k, v in validation_metrics(trajs, group_size=1).items()}
    if r.mode == "host":
        metrics.update(host_error_metrics(trajs, "val"))
    return metrics


def _block(tree):
    jax.block_until_ready(tree)
    return tree


def restore(run: Run, state: TrainState, ckpt: Checkpointer, *, is_main: bool) -> tuple[TrainState, int, dict | None]:
    """(state, first step to run, the restored checkpoint's meta or None): the newest checkpoint that
    restores, with the current config's optimizer hyperparameters. Raises ConfigError when the resume
    changes what the run computes (see ``train.resume``) before anything is restored."""
    config = run.config
    newest = ckpt.newest_meta()
    warning = check_resume_config(config, *newest) if newest else None
    if not ckpt.all_steps():
        return state, 1, None
    tree, meta, step, damaged = ckpt.restore_newest(state.tree(), log=_warn if is_main else lambda _: None)
    if newest and step != newest[1]:
        warning = check_resume_config(config, meta, step) or warning
    restored = TrainState.from_tree(tree)
    restored = restored.replace(actor_opt=with_config_hyperparams(restored.actor_opt, state.actor_opt),
                                critic_opt=with_config_hyperparams(restored.critic_opt, state.critic_opt))
    if is_main:
        if warning:
            _warn(warning)
        moved = ckpt.quarantine(damaged)
        if moved:
            _warn(f"warning: moved damaged checkpoint step(s) {damaged} to {moved}")
        print(f"resuming from checkpoint step {step} in {ckpt.directory}", flush=True)
    return restored, step + 1, meta


def training_step(run: Run, state: TrainState, step: int, base_key) -> tuple[TrainState, dict[str, Any], Any]:
    """One step: rollout, MI diagnostics (when due), the update; returns (state, metrics, trajectories)."""
    config = run.config
    k_roll, k_mi, k_upd = jax.random.split(jax.random.fold_in(base_key, step), 3)
    metrics: dict[str, Any] = {}
    t0 = time.time()
    traj = _block(run.rollout.run(state.actor, k_roll, run.rollout_cfg.train_seeds(step - 1)))
    metrics["timing/rollout_s"] = time.time() - t0
    check_finite_rewards(np.asarray(traj.episode_reward), "episode rewards")
    metrics.update(rollout_metrics(traj))
    if run.rollout_cfg.mode == "host":
        metrics.update(host_error_metrics(traj, "rollout"))

    if config.mi.enabled and should_compute_mi(step, config.mi.every) and config.rollout.context_mode == "full":
        t1 = time.time()
        mi_metrics, mi_ema = mi_diagnostics(run, state, traj, k_mi)
        state = state.replace(mi_ema=mi_ema)
        metrics.update(_block(mi_metrics))
        metrics["timing/mi_s"] = time.time() - t1

    t2 = time.time()
    learned = train_reward(traj, k_upd, config.algorithm.train_reward)
    result = run.update_step(state, learned, k_upd)  # filter -> plan -> score -> advantages -> critic, actor
    _block(result.metrics)
    metrics["timing/update_s"] = time.time() - t2
    metrics.update(result.metrics)
    metrics["timing/step_s"] = time.time() - t0
    metrics["throughput/generated_tokens_per_s"] = metrics["train/generated_tokens"] / max(
        metrics["timing/rollout_s"], 1e-9)
    metrics["throughput/update_tokens_per_s"] = float(result.metrics.get("update/tokens", 0.0)) / max(
        metrics["timing/update_s"], 1e-9)
    return result.state, mask_untrained_metrics(metrics, config.algorithm.ppo_epochs), traj


def open_run(config, run_dir: str, is_main: bool):
    """Build the run on its mesh and restore it: (run, state, ckpt, start step, EarlyStop, CheckpointGate).

    Nothing in ``run_dir`` changes before the resume checks passed; then the logs are cut back to the
    restored step and the config is written."""
    run, state = build_run(config)
    # Place the state on the ('data', 'fsdp', 'tensor') mesh before restoring, so that a checkpoint
    # comes back with the same shardings.
    run, state = sharding.shard_run(run, state, sharding.make_mesh(config))
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=config.trainer.keep_checkpoints)
    try:
        state, start, meta = restore(run, state, ckpt, is_main=is_main)
        early = resume_early_stop(config, meta["early_stop"]) if meta else EarlyStop.from_config(config)
        gate = CheckpointGate(ckpt, config, state, start, meta)
        if is_main:
            truncate_run_logs(run_dir, start - 1 if start > 1 else -1)
            write_run_config(run_dir, config)
    except BaseException:
        ckpt.close()
        run.close()
        raise
    return run, state, ckpt, start, early, gate


def step_checks(run: Run, state: TrainState, step: int, metrics: dict, early: EarlyStop,
                gate: CheckpointGate) -> str:
    """After a step's update: the checkpoint gate's bookkeeping, RAGEN-2's early-stopping rules, the
    validation when due; adds their metrics to ``metrics`` and returns the stop reason ("" to go on)."""
    config = run.config
    gate.after_update(step, metrics)
    empty = float(metrics.get("filter/empty", 0.0)) > 0
    nonfinite = float(metrics.get("update/nonfinite_skipped", 0.0)) > 0
    stop_reason = early.after_step(float(metrics.get("rollout/in_group_reward_std", np.nan)), empty, nonfinite)
    done = step == config.trainer.total_steps
    if config.validation.every > 0 and (step % config.validation.every == 0 or done):
        metrics.update(validate(run, state.actor, step))
        stop_reason = stop_reason or early.after_validation(metrics["val/success"])
    metrics["early_stop/reward_std_baseline"] = early.baseline if early.baseline is not None else np.nan
    return stop_reason


def checkpoint_or_stop(step: int, state: TrainState, stop_reason: str, scale, growth: float,
                       gate: CheckpointGate, early: EarlyStop, preempted: bool, say) -> str:
    """On a step that checkpoints (``scale`` not None): refuse an exploded state, else save. Returns the
    final stop reason ("" to go on) and says why the run stops. ``preempted``: the SIGTERM flag as read
    when the step decided to checkpoint (a signal that comes later is the next step's)."""
    if scale is not None and growth > gate.max_growth:
        say(gate.explosion_message(step, growth))
        return "parameter_explosion"
    if scale is not None:
        gate.save(step, state, early, scale)
    if stop_reason:
        good = gate.last_good["step"]
        say(f"early stop at step {step}: {stop_reason}: {early.explain()}"
            + (f"; the last good checkpoint is step {good}" if stop_reason == "nonfinite_updates"
               and good is not None else ""))
        return stop_reason
    if preempted:
        say(f"SIGTERM: checkpoint written at step {step}; exiting")
        return "preempted"
    return ""


def end_of_run_report(run_dir: str, config, is_main: bool) -> list[str]:
    """Plots and the end-of-run summary (train/report.py), printed with the progress line on."""
    if not (is_main and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))):
        return []
    from ragen_jax.train.plots import make_plots

    make_plots(run_dir)
    report = summary_lines(run_dir, read_metrics(run_dir))
    if config.trainer.progress:
        print("\n".join(report), flush=True)
    return report


def train(config, run_dir: str, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) in ``run_dir``; returns a summary (last metrics, stop reason, wall time).

    ``on_step(step, metrics)`` is called after each step's metrics are written (step 0: the validation
    before training), on the main process only. Raises ConfigError for a resume with a run-altering
    config change and CheckpointRestoreError when no checkpoint restores; nothing in ``run_dir`` is
    changed before those checks passed.
    """
    t_start = time.time()
    is_main = distributed.is_main_process()
    release_after_compiles()
    run, state, ckpt, start, early, gate = open_run(config, run_dir, is_main)
    recorder = StepRecorder(run_dir, config, start, is_main, on_step)
    guard = PreemptionGuard()
    base_key = jax.random.key(config.seed)
    last: dict[str, float] = {}
    stop_reason = ""
    try:
        if start == 1 and config.validation.every > 0:
            last = recorder.record(0, validate(run, state.actor, 0))
        for step in range(start, config.trainer.total_steps + 1):
            state, metrics, traj = training_step(run, state, step, base_key)
            stop_reason = step_checks(run, state, step, metrics, early, gate)
            recorder.samples(step, traj, run.tokenizer)
            # Read the flag once: a SIGTERM between deciding not to save and stopping would end the run
            # without the checkpoint the message promises.
            preempted = guard.requested
            due = stop_reason or step == config.trainer.total_steps or preempted or (
                step % config.trainer.checkpoint_every == 0)
            scale, growth = gate.growth(state) if due else (None, np.nan)
            if due:
                metrics["checkpoint/param_growth"] = growth
            last = recorder.record(step, metrics)
            stop_reason = checkpoint_or_stop(step, state, stop_reason, scale, growth, gate, early, preempted,
                                             recorder.say)
            if stop_reason:
                break
    finally:
        guard.close()
        recorder.close()
        ckpt.close()
        run.close()
    return {
        "run_dir": run_dir,
        "stop_reason": stop_reason or "completed",
        "wall_time_s": time.time() - t_start,
        "traces": trace_counts(run),
        "last": {k: v for k, v in last.items() if k.startswith(("train/", "val/", "filter/", "rollout/"))},
        "report": end_of_run_report(run_dir, config, is_main),
    }


def trace_counts(run: Run) -> dict[str, int]:
    """How often each jitted program of the run was traced (each should be 1; the update's count is per
    bucket width, and ``update_widths`` is how many widths it compiled for)."""
    counts = {"rollout": run.rollout.trace_count, "validation_rollout": run.val_rollout.trace_count,
              "update": run.update_step.traces, "update_widths": len(_update_step_of(run).traces_by_width)}
    counts.update({f"mi/{k}": v for k, v in TRACE_COUNTS.items()})
    return counts


def _update_step_of(run: Run):
    """The run's ``UpdateStep`` (inside a ``ShardedUpdateStep`` on a mesh)."""
    return getattr(run.update_step, "inner", run.update_step)
