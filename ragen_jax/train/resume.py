"""The resume and checkpoint rules of a run: which config changes a resume accepts, how the restored
state takes the current config's hyperparameters and thresholds, and the parameter-scale test a
checkpoint passes before it is saved (``train.loop`` applies them).

A checkpoint's meta holds the config it was trained with; a resume whose config differs in a key that
changes what a step computes is refused (``ConfigError``) unless ``trainer.allow_config_change`` accepts
it with a warning. Keys that only decide how far the run goes, when it stops, what it logs, how often it
saves or where it runs (``RESUME_FREE_KEYS``) may change freely.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rl.state import TrainState
from ragen_jax.setup.config_check import ConfigError
from ragen_jax.train.checkpoint import Checkpointer
from ragen_jax.train.early_stop import EarlyStop

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
    "rollout.host_workers",  # where host envs run, not what they compute
    "sft.cache_dir",  # where the warm start is cached, not what it is
    "mesh.",  # the device layout: a preempted run may resume on another topology (sharded == unsharded)
    "compile_cache.",  # where compiled programs are cached, not what they compute
    # how the update lays out its arrays and its backward pass: the same numbers up to float rounding
    "algorithm.width_buckets", "algorithm.remat", "model.overrides.attention_block", "algorithm.micro_batch_size",
    "algorithm.pack_rows", "mi.width_buckets",
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


class CheckpointGate:
    """Which checkpoints a run saves and which one it never rotates out.

    A checkpoint is saved only when its parameters are finite and their largest magnitude grew at most
    ``trainer.max_param_growth`` times since the *last good* checkpoint: the newest checkpoint whose
    parameters then produced a finite update (before there is one, the run's initial parameters). The
    last good checkpoint is protected from rotation, so a streak of bad-but-finite checkpoints cannot
    push it out.
    """

    def __init__(self, ckpt: Checkpointer, config, state: TrainState, start: int, meta: dict | None = None):
        self.ckpt = ckpt
        self.config = config
        self.ppo_epochs = config.algorithm.ppo_epochs
        self.max_growth = config.trainer.get("max_param_growth", 10.0)
        scale = param_scale(state)
        self.last_good: dict = (meta or {}).get("last_good") or {"step": None, "scale": scale}  # {"step", "scale"}
        self.saved_step = start - 1 if start > 1 else None  # the newest checkpoint's step
        self.saved_scale = scale if self.saved_step is not None else None
        ckpt.protect(self.last_good["step"])

    def after_update(self, step: int, update_metrics: dict) -> None:
        """The checkpoint of step - 1 becomes the last good one once the update from it trained."""
        if self.saved_step == step - 1 and trained_from_start(update_metrics, self.ppo_epochs):
            self.last_good = {"step": self.saved_step, "scale": self.saved_scale}
            self.ckpt.protect(self.saved_step)

    def growth(self, state: TrainState) -> tuple[dict[str, float], float]:
        """(parameter scale, its growth since the last good checkpoint)."""
        scale = param_scale(state)
        return scale, param_growth(scale, self.last_good["scale"])

    def explosion_message(self, step: int, growth: float) -> str:
        good = self.last_good["step"]
        since = f"checkpoint step {good}" if good is not None else "the start"
        return (f"early stop at step {step}: parameter_explosion: the largest |parameter| grew {growth:.3g}x since "
                f"{since} (limit trainer.max_param_growth={self.max_growth:g}); not saved (lower the learning rate)"
                + (f"; the last good checkpoint is step {good}" if good is not None else ""))

    def save(self, step: int, state: TrainState, early: EarlyStop, scale: dict[str, float]) -> None:
        self.ckpt.save(step, state.tree(), {"step": step, "early_stop": early.to_json(),
                                            "config": config_snapshot(self.config), "scale": scale,
                                            "last_good": self.last_good})
        self.saved_step, self.saved_scale = step, scale
