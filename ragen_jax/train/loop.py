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
  * every checkpoint's meta holds the config it was trained with; a resume whose config differs in a
    key that changes what a step computes is refused (``ConfigError``) unless
    ``trainer.allow_config_change`` accepts it with a warning. Keys that only decide how far the run
    goes, when it stops, what it logs, how often it saves or where it runs (``RESUME_FREE_KEYS``) may
    change freely;
  * a checkpoint that does not restore is reported in one line and the one before it is used;
  * a checkpoint is saved only when its parameters are finite and their largest magnitude grew at most
    ``trainer.max_param_growth`` times since the last good checkpoint (an exploded update stops the run
    unsaved instead); the *last good* checkpoint (the newest whose parameters then produced a finite
    update) is never rotated out;
  * metrics.jsonl and samples.txt are cut back to the restored step before a resume appends to them, and
    the actor / critic metrics of an update whose every mini-batch was skipped are NaN (JSON null), not 0.
The file runs past ~400 lines because these resume rules (small pure functions above ``train``) belong
next to the loop that applies them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
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
from ragen_jax.rl.state import TrainState
from ragen_jax.rl.update import UpdateConfig, make_update_step
from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.layout import RolloutConfig, rollout_config
from ragen_jax.rollout.validation import episode_metrics, validation_metrics, validation_rollouts
from ragen_jax.setup.build import build_env, build_policy, build_tokenizer
from ragen_jax.setup.config_check import ConfigError
from ragen_jax.sft.warm_start import load_warm_start
from ragen_jax.train.checkpoint import Checkpointer, PreemptionGuard
from ragen_jax.train.early_stop import EarlyStop
from ragen_jax.train.metrics import MetricsWriter, Progress, truncate_run_logs, write_atomic

MI_STRATEGIES = {"first_turn": "collapse_first_turn_sample", "trajectory": "collapse_trajectory_sample"}
PROGRESS_KEYS = ("train/success", "val/success", "rollout/in_group_reward_std", "filter/kept_ratio",
                 "collapse_trajectory_sample/mi_estimate")


# Config keys (a trailing "." covers a whole section) that may differ between a checkpoint and its
# resume: they decide how far the run goes, when it stops, what is logged, how often it is saved and on
# which devices it runs, never what a training step computes from the restored state.
RESUME_FREE_KEYS = (
    "mode", "run_dir",
    "trainer.total_steps",  # extend (or shorten) a run
    "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.sample_every",
    "trainer.progress", "trainer.allow_config_change",
    # stopping rules: the resumed run applies the new thresholds to the restored counters
    "trainer.max_nonfinite_in_a_row", "trainer.rv_collapse_baseline_steps", "trainer.rv_collapse_window",
    "trainer.rv_collapse_ratio", "trainer.low_val_success", "trainer.low_val_patience",
    "filter.empty_stop_steps", "trainer.max_param_growth",
    # which steps are validated; validation never touches the training state (it feeds only the
    # low-validation-success stopping rule)
    "validation.every",
    "sft.cache_dir",  # where the warm start is cached, not what it is
    "mesh.",  # the device layout: a preempted run may resume on another topology (sharded == unsharded)
)
# EarlyStop fields that are thresholds (taken from the resumed config) rather than counters.
EARLY_STOP_THRESHOLDS = ("baseline_steps", "window", "ratio", "low_val_success", "low_val_patience",
                         "empty_stop_steps", "max_nonfinite")
# Update metrics that average over the trained mini-batches: meaningless when none trained.
ACTOR_UPDATE_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/entropy", "actor/pg_clipfrac",
                        "actor/pg_clipfrac_upper", "actor/pg_clipfrac_lower", "actor/pg_clipfrac_dual",
                        "actor/ppo_kl", "actor/grad_norm")
CRITIC_UPDATE_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm")


def config_snapshot(config) -> dict:
    """The config as plain JSON data (what every checkpoint's meta holds under "config")."""
    return json.loads(config.to_json())


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_free(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_FREE_KEYS)


def altering_changes(saved: dict, current: dict) -> list[str]:
    """``key (saved -> current)`` for every key outside RESUME_FREE_KEYS whose value differs (a key on one
    side only counts: a dropped model override changes the model as much as a changed one)."""
    old, new = flatten(saved), flatten(current)
    missing = "<absent>"
    return [f"{k} ({old.get(k, missing)!r} -> {new.get(k, missing)!r})" for k in sorted(set(old) | set(new))
            if not _is_free(k) and old.get(k, missing) != new.get(k, missing)]


def check_resume_config(config, meta: dict, step: int) -> str | None:
    """Raise ConfigError (one line) when ``config`` changes what the run checkpointed at ``step`` computes;
    with ``trainer.allow_config_change`` return the warning line instead. None when nothing changed (or
    the checkpoint holds no config)."""
    if "config" not in meta:
        return None
    changes = altering_changes(meta["config"], config_snapshot(config))
    if not changes:
        return None
    listed = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    if not config.trainer.get("allow_config_change", False):
        raise ConfigError(
            f"the run in this run_dir was trained to step {step} with a different config: {listed}; resume with "
            "the same values, choose a new run_dir, or pass --config.trainer.allow_config_change=True to continue "
            "it with the new ones")
    return f"warning: resuming step {step} with a changed config (trainer.allow_config_change=True): {listed}"


@jax.jit
def _leaves_max_abs(leaves: list) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in leaves]))


def _max_abs(tree) -> float:
    """max |x| over the floating-point leaves of ``tree`` (0 for none), as one jitted reduction (compiled
    once per run) that also works on arrays spread over several processes."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return 0.0
    return float(np.asarray(_leaves_max_abs(leaves).addressable_data(0)))


def param_scale(state: TrainState) -> dict[str, float]:
    """Largest |parameter| of the actor and (when trained) the critic."""
    out = {"actor": _max_abs(state.actor)}
    if state.critic is not None:
        out["critic"] = _max_abs(state.critic)
    return out


def param_growth(scale: dict[str, float], reference: dict[str, float]) -> float:
    """max over the models of scale / reference: how many times the largest |parameter| grew since the
    reference (the last good checkpoint, or the run's initial parameters). An optimizer step of sane size
    moves each parameter by about the learning rate, so between checkpoints the largest magnitude barely
    moves; a growth by an order of magnitude is an exploded update (a NaN, infinity or growth over an
    absent reference counts as infinite)."""
    growth = 1.0
    for name, value in scale.items():
        ref = reference.get(name)
        if not np.isfinite(value) or ref is None or not np.isfinite(ref):
            return float("inf")
        growth = max(growth, value / max(ref, 1e-12))
    return growth


def mask_untrained_metrics(metrics: dict, ppo_epochs: int) -> dict:
    """Replace the actor (critic) update metrics by NaN when none of its mini-batches trained (every one
    skipped as non-finite, or an empty filtered batch): their 0 would read like a real value (entropy 0
    looks like entropy collapse)."""
    out = dict(metrics)
    slots = float(out.get("update/minibatches_used", 0.0)) * ppo_epochs
    for prefix, keys in (("actor", ACTOR_UPDATE_METRICS), ("critic", CRITIC_UPDATE_METRICS)):
        skipped = f"{prefix}/nonfinite_skipped"
        if skipped in out and slots - float(out[skipped]) <= 0:
            out.update({k: np.float32(np.nan) for k in keys if k in out})
    return out


def trained_from_start(metrics: dict, ppo_epochs: int) -> bool:
    """Whether the parameters a step began with passed the test of a finite update: its actor trained at
    least one mini-batch (skipped mini-batches leave the parameters unchanged, so the first one trained
    starts from exactly those). The newest checkpoint whose next step passes is the last good one."""
    slots = float(metrics.get("update/minibatches_used", 0.0)) * ppo_epochs
    return slots - float(metrics.get("actor/nonfinite_skipped", 0.0)) > 0


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
    rollout: Rollout
    val_rollout: Rollout
    update_step: Any
    actor_tx: Any
    critic_tx: Any


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
    """train/*: the episode means (``rollout.validation.episode_metrics``), the mean sequence length and
    the number of generated (loss) tokens of the training batch."""
    t = traj.to_numpy()
    metrics = {f"train/{k}": v for k, v in episode_metrics(t).items()}
    metrics["train/sequence_length"] = float(t.lengths.mean())
    metrics["train/generated_tokens"] = float(t.loss_mask.sum())
    return metrics


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
    trajs = validation_rollouts(run.val_rollout, params, key, cfg.validation.episodes, r.val_temperature,
                                r.val_greedy)
    return {f"val/{k}": v for k, v in validation_metrics(trajs, group_size=1).items()}


def _block(tree):
    jax.block_until_ready(tree)
    return tree


def with_config_hyperparams(restored, fresh):
    """The restored optimizer state with the hyperparameters (learning rate, betas, weight decay, clip)
    of the current config: ``optim.make_optimizer`` keeps them in the optax state (inject_hyperparams),
    so without this a resume accepted with a changed ``optim.*`` would silently keep the old ones."""
    if restored is None or not hasattr(restored, "hyperparams"):
        return restored
    return restored._replace(hyperparams=fresh.hyperparams)


def resume_early_stop(config, saved: dict) -> EarlyStop:
    """The checkpoint's early-stop counters under the current config's thresholds."""
    fresh = EarlyStop.from_config(config)
    return EarlyStop.from_json({**saved, **{k: getattr(fresh, k) for k in EARLY_STOP_THRESHOLDS}})


def train(config, run_dir: str) -> dict:
    """Train (or resume) in ``run_dir``; returns a summary (last metrics, stop reason, wall time).

    Raises ConfigError for a resume with a run-altering config change and CheckpointRestoreError when
    no checkpoint restores; nothing in ``run_dir`` is changed before those checks passed.
    """
    t_start = time.time()
    run, state = build_run(config)
    is_main = distributed.is_main_process()
    # Place the state on the ('data', 'fsdp', 'tensor') mesh before restoring, so that a checkpoint
    # comes back with the same shardings.
    run, state = sharding.shard_run(run, state, sharding.make_mesh(config))
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=config.trainer.keep_checkpoints)
    early = EarlyStop.from_config(config)
    start = 1
    # The last good checkpoint: {"step", "scale"}; before there is one, the initial parameters' scale.
    last_good: dict = {"step": None, "scale": param_scale(state)}
    try:
        newest = ckpt.newest_meta()
        warning = check_resume_config(config, *newest) if newest else None
        if ckpt.all_steps():
            tree, meta, step, damaged = ckpt.restore_newest(state.tree(), log=_warn if is_main else lambda _: None)
            if newest and step != newest[1]:
                warning = check_resume_config(config, meta, step) or warning
            fresh = state
            state = TrainState.from_tree(tree)
            state = state.replace(actor_opt=with_config_hyperparams(state.actor_opt, fresh.actor_opt),
                                  critic_opt=with_config_hyperparams(state.critic_opt, fresh.critic_opt))
            early = resume_early_stop(config, meta["early_stop"])
            last_good = meta.get("last_good") or {"step": None, "scale": param_scale(state)}
            ckpt.protect(last_good["step"])
            start = step + 1
            if is_main:
                if warning:
                    _warn(warning)
                moved = ckpt.quarantine(damaged)
                if moved:
                    _warn(f"warning: moved damaged checkpoint step(s) {damaged} to {moved}")
                print(f"resuming from checkpoint step {step} in {ckpt.directory}", flush=True)
        if is_main:
            truncate_run_logs(run_dir, start - 1 if start > 1 else -1)
            write_run_config(run_dir, config)
    except BaseException:
        ckpt.close()
        raise
    writer = MetricsWriter(run_dir, enabled=is_main)
    progress = Progress(config.trainer.total_steps, start - 1, enabled=is_main and config.trainer.progress,
                        keys=PROGRESS_KEYS)
    guard = PreemptionGuard()
    base_key = jax.random.key(config.seed)
    last: dict[str, float] = {}
    stop_reason = ""
    saved_step = start - 1 if start > 1 else None  # the newest checkpoint's step
    saved_scale = param_scale(state) if saved_step is not None else None
    ppo_epochs = config.algorithm.ppo_epochs
    max_growth = config.trainer.get("max_param_growth", 10.0)

    def save(step: int, scale: dict[str, float]) -> None:
        ckpt.save(step, state.tree(), {"step": step, "early_stop": early.to_json(), "config": config_snapshot(config),
                                        "scale": scale, "last_good": last_good})

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
                mi_metrics, mi_ema = mi_diagnostics(run, state, traj, k_mi)
                state = state.replace(mi_ema=mi_ema)
                metrics.update(_block(mi_metrics))
                metrics["timing/mi_s"] = time.time() - t1

            t2 = time.time()
            result = run.update_step(state, traj, k_upd)  # filter -> plan -> score -> advantages -> critic, actor
            _block(result.metrics)
            state = result.state
            metrics["timing/update_s"] = time.time() - t2
            metrics.update(result.metrics)
            metrics["timing/step_s"] = time.time() - t0
            metrics["throughput/generated_tokens_per_s"] = metrics["train/generated_tokens"] / max(
                metrics["timing/rollout_s"], 1e-9)
            metrics["throughput/update_tokens_per_s"] = float(result.metrics.get("update/tokens", 0.0)) / max(
                metrics["timing/update_s"], 1e-9)

            metrics = mask_untrained_metrics(metrics, ppo_epochs)

            empty = float(result.metrics.get("filter/empty", 0.0)) > 0
            nonfinite = float(result.metrics.get("update/nonfinite_skipped", 0.0)) > 0
            if saved_step is not None and saved_step == step - 1 and trained_from_start(result.metrics, ppo_epochs):
                last_good = {"step": saved_step, "scale": saved_scale}
                ckpt.protect(saved_step)
            stop_reason = early.after_step(float(metrics.get("rollout/in_group_reward_std", np.nan)), empty, nonfinite)

            if config.validation.every > 0 and (step % config.validation.every == 0 or step == config.trainer.total_steps):
                metrics.update(validate(run, state.actor, step))
                stop_reason = stop_reason or early.after_validation(metrics["val/success"])
            if config.trainer.sample_every > 0 and (step == 1 or step % config.trainer.sample_every == 0):
                for i in range(min(2, traj.num_rows)):
                    writer.write_text(step, f"train sample {i} (reward {float(traj.episode_reward[i]):.3g})",
                                      traj.to_text(i, run.tokenizer))
            metrics["early_stop/reward_std_baseline"] = early.baseline if early.baseline is not None else np.nan

            done = step == config.trainer.total_steps
            due = stop_reason or done or guard.requested or step % config.trainer.checkpoint_every == 0
            if due:
                scale = param_scale(state)
                growth = param_growth(scale, last_good["scale"])
                metrics["checkpoint/param_growth"] = growth
            last = writer.write(step, metrics)
            progress.update(step, last)

            if due and growth > max_growth:
                since = f"checkpoint step {last_good['step']}" if last_good["step"] is not None else "the start"
                stop_reason = "parameter_explosion"
                if is_main:
                    print(f"early stop at step {step}: parameter_explosion: the largest |parameter| grew {growth:.3g}x "
                          f"since {since} (limit trainer.max_param_growth={max_growth:g}); not saved (lower the "
                          "learning rate)" + (f"; the last good checkpoint is step {last_good['step']}"
                                              if last_good["step"] is not None else ""), flush=True)
                break
            if due:
                save(step, scale)
                saved_step, saved_scale = step, scale
            if stop_reason:
                if is_main:
                    good = (f"; the last good checkpoint is step {last_good['step']}"
                            if stop_reason == "nonfinite_updates" and last_good["step"] is not None else "")
                    print(f"early stop at step {step}: {stop_reason}: {early.explain()}{good}", flush=True)
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
    step = None
    try:
        if ckpt.all_steps():
            tree, _, step, _ = ckpt.restore_newest(state.tree())
            state = TrainState.from_tree(tree)
    finally:
        ckpt.close()
    metrics = validate(run, state.actor, step or 0)
    metrics["checkpoint_step"] = float(step or 0)
    return metrics
