"""Fail fast on bad configs: unknown keys (naming the nearest valid one), bad choices, missing paths,
model files that cannot be read (checked from their headers, without loading weights), sizes that do not
fit together, an empty training schedule and a run directory that cannot be written.

Everything here runs before any JAX compilation and before anything is written, and every failure is a
``ConfigError`` whose message is one line that names the fix; ``main`` prints it and exits with status 2.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from typing import Any, Iterable, Mapping

import ml_collections


class ConfigError(ValueError):
    pass


# Allowed values of the string-valued keys; everything else is free-form or numeric.
CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("train", "eval", "sft"),
    "init": ("random", "sft"),
    "model.dtype": ("float32", "bfloat16"),
    "model.tokenizer": ("char", "hf"),
    "model.chat_style": ("qwen", "llama3"),
    "env.prompt_style": ("ragen", "compact"),
    "rollout.mode": ("fused", "host"),
    "rollout.context_mode": ("full", "limited"),
    "algorithm.name": ("ppo", "grpo", "drgrpo", "dapo", "rloo"),
    "algorithm.adv_estimator": ("gae", "grpo", "rloo"),
    "algorithm.kl_type": ("kl", "mse", "low_var_kl"),
    "algorithm.train_reward": ("env", "coin"),
    "algorithm.loss_agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    "filter.metric": ("reward_std", "reward_var", "reward_mean", "reward_sum"),
    "filter.strategy": ("top_p", "top_k", "top_k_abs", "min_p"),
    "filter.top_p_mode": ("linear", "softmax"),
    "filter.loss_scaling": ("none", "linear", "sqrt"),
    "mesh.distributed": ("auto", "on", "off"),
}

_OVERRIDE = re.compile(r"^--config\.([A-Za-z0-9_.]+)(=.*)?$")


def flat_keys(config: Mapping, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf key: ['seed', 'model.preset', ...]."""
    keys = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            keys.extend(flat_keys(value, path + "."))
        else:
            keys.append(path)
    return keys


def nearest_key(key: str, known: Iterable[str]) -> str | None:
    known = list(known)
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if match:
        return match[0]
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.6)
    if by_leaf:
        return next(k for k in known if k.rsplit(".", 1)[-1] == by_leaf[0])
    return None


def check_override_keys(argv: Iterable[str], config: Mapping) -> None:
    """Every ``--config.a.b=v`` in argv must name an existing key (before absl parses anything)."""
    known = flat_keys(config)
    known_set = set(known)
    for arg in argv:
        match = _OVERRIDE.match(arg)
        if not match:
            continue
        key = match.group(1)
        if key in known_set:
            continue
        hint = nearest_key(key, known)
        raise ConfigError(
            f"unknown config key '{key}'" + (f"; did you mean '{hint}'?" if hint else "; see configs/base.py")
        )


def _get(config: Mapping, path: str):
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def run_dir_of(config) -> str:
    """``config.run_dir``, or runs/<env.name>-<algorithm.name>-seed<seed> when it is empty."""
    if config.run_dir:
        return config.run_dir
    return os.path.join("runs", f"{config.env.name}-{config.algorithm.name}-seed{config.seed}")


def check_config(config: Mapping, *, env_names: Iterable[str], model_presets: Iterable[str],
                 host_envs: Mapping[str, Any] | None = None) -> None:
    """Semantic checks of a parsed config (choices, names, model files, sizes, schedule, run directory).
    host_envs: ``envs.registry.HOST_REGISTRY`` (name -> host env class), the envs of ``rollout.mode=host``."""
    _check_choices(config)
    _check_env(config, env_names, host_envs or {})
    _check_model(config, model_presets)
    _check_sizes(config)
    _check_schedule(config)
    _check_compile_cache(config)
    run_dir = run_dir_of(config)
    if config.mode == "train":
        check_run_dir(run_dir)
    elif config.mode == "eval" and os.path.isfile(run_dir):  # eval only reads: a read-only run is fine
        raise ConfigError(f"config.run_dir: {run_dir!r} is a file; eval reads the run directory that "
                          "training wrote")


def _check_choices(config: Mapping) -> None:
    for path, allowed in CHOICES.items():
        value = _get(config, path)
        if value not in allowed:
            raise ConfigError(f"config.{path}={value!r} is not one of {', '.join(allowed)}")


def _check_env(config: Mapping, env_names: Iterable[str], host_envs: Mapping[str, Any]) -> None:
    env_names = sorted(set(env_names) | set(host_envs))
    if config.env.name not in env_names:
        hint = difflib.get_close_matches(config.env.name, env_names, n=1)
        raise ConfigError(
            f"unknown environment '{config.env.name}' (config.env.name); known: {', '.join(env_names)}"
            + (f"; did you mean '{hint[0]}'?" if hint else "")
        )
    _check_host_keys(config)
    if config.env.name in host_envs:
        _check_host_env(config, host_envs[config.env.name])


# ---- host environments (envs.registry.HOST_REGISTRY, docs/host_envs.md) ----
def _check_host_keys(config: Mapping) -> None:
    r = config.rollout
    if r.get("host_workers", 0) < 0:
        raise ConfigError(f"config.rollout.host_workers={r.host_workers} must be >= 0 (0: step the envs in this process)")
    if not r.get("host_step_timeout_s", 1.0) > 0:
        raise ConfigError(f"config.rollout.host_step_timeout_s={r.host_step_timeout_s} must be > 0 (seconds)")


def _check_host_env(config: Mapping, env_class: Any) -> None:
    name, r = config.env.name, config.rollout
    if r.mode != "host":
        raise ConfigError(f"env '{name}' is a host environment (plain Python, envs.registry.HOST_REGISTRY): it runs "
                          f"with --config.rollout.mode=host, not {r.mode}")
    if r.get("max_user_tokens", 0) < 1:
        raise ConfigError(f"host env '{name}' needs config.rollout.max_user_tokens >= 1: the static width in tokens "
                          "of one user message (its longest observation), e.g. --config.rollout.max_user_tokens=256")
    if config.init == "sft" or config.mode == "sft":
        raise ConfigError(f"host env '{name}' has no solver demonstrations for the supervised warm start: set "
                          "config.init=random (or start from model.hf_path)")
    try:
        accepted = inspect.signature(env_class).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
        return
    names = [p.name for p in accepted if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in config.env.params:
        if key not in names:
            hint = difflib.get_close_matches(key, names, n=1)
            raise ConfigError(
                f"config.env.params.{key}: host env '{name}' takes no parameter {key!r}"
                + (f"; did you mean '{hint[0]}'?" if hint else f"; its parameters: {', '.join(names) or 'none'}")
                + " (set config.env.params to its own, e.g. --config.env.params={})"
            )


def _check_model(config: Mapping, model_presets: Iterable[str]) -> None:
    if config.model.hf_path:
        _check_hf_path(config.model.hf_path)
    elif config.model.gguf_path:
        _check_gguf_path(config.model.gguf_path)
    elif config.model.preset not in set(model_presets):
        hint = difflib.get_close_matches(config.model.preset, list(model_presets), n=1)
        raise ConfigError(
            f"unknown model preset '{config.model.preset}' (config.model.preset)"
            + (f"; did you mean '{hint[0]}'?" if hint else "")
        )
    elif config.model.tokenizer == "hf":
        raise ConfigError("config.model.tokenizer='hf' takes the tokenizer from config.model.hf_path; set "
                          "model.hf_path or use model.tokenizer=char")
    if (config.init == "sft" or config.mode == "sft") and (config.model.hf_path or config.model.gguf_path):
        raise ConfigError(
            "the supervised warm start trains a preset model from scratch; with model.hf_path / gguf_path "
            "the pretrained weights are the start: set config.init=random"
        )
    if config.model.overrides:
        _check_overrides(config.model.overrides)


def _check_hf_path(path: str) -> None:
    """The whole checkpoint as far as it can be checked without reading weights (config.json, tokenizer,
    safetensors headers, tensor names and shapes), so a bad file fails before the run directory is touched."""
    if not os.path.isdir(path):
        raise ConfigError(f"config.model.hf_path: directory {path!r} does not exist")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"config.model.hf_path: {path!r} has no config.json (not a HF checkpoint)")
    from ragen_jax.models.hf_io import CheckpointError, check_hf_checkpoint  # deferred: imports JAX

    try:
        check_hf_checkpoint(path)
    except CheckpointError as e:
        raise ConfigError(f"config.model.hf_path: {e}") from None
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise ConfigError(f"config.model.hf_path: {path!r} has no tokenizer.json; the policy uses the "
                          "checkpoint's own tokenizer (save it with tokenizer.save_pretrained into that directory)")


def _check_gguf_path(path: str) -> None:
    """Open the file and read its model metadata (no weights): a directory, a non-GGUF or truncated file
    and an unsupported architecture fail here, before the run directory is touched."""
    try:
        from ragen_jax.models.gguf import GGUFError, config_from_gguf, open_gguf  # deferred: imports JAX
    except ModuleNotFoundError as e:
        if e.name != "gguf":
            raise
        raise ConfigError("config.model.gguf_path needs the gguf package: pip install -e \".[gguf]\"") from None
    try:
        config_from_gguf(open_gguf(path))
    except GGUFError as e:
        raise ConfigError(f"config.model.gguf_path: {e}") from None


def _check_overrides(overrides: Mapping) -> None:
    import dataclasses

    from ragen_jax.models.config import ModelConfig

    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    for key in overrides:
        if key not in fields:
            hint = difflib.get_close_matches(key, fields, n=1)
            raise ConfigError(
                f"config.model.overrides.{key} is not a ModelConfig field"
                + (f"; did you mean '{hint[0]}'?" if hint else f"; fields: {', '.join(fields)}")
            )


def _check_sizes(config: Mapping) -> None:
    batch = config.rollout.n_groups * config.rollout.group_size
    mini, micro = config.algorithm.mini_batch_size, config.algorithm.micro_batch_size
    if min(config.rollout.n_groups, config.rollout.group_size) < 1:
        raise ConfigError("config.rollout.n_groups and group_size must be >= 1")
    if mini < 1 or micro < 1:
        raise ConfigError("config.algorithm.mini_batch_size and micro_batch_size must be >= 1")
    if mini % micro:
        raise ConfigError(
            f"config.algorithm.mini_batch_size ({mini}) must be a multiple of micro_batch_size ({micro})"
        )
    if mini > batch:
        raise ConfigError(
            f"config.algorithm.mini_batch_size ({mini}) is larger than the rollout batch n_groups*group_size ({batch})"
        )
    if batch % mini:
        raise ConfigError(
            f"config.algorithm.mini_batch_size ({mini}) must divide the rollout batch n_groups*group_size "
            f"({batch}){_mini_batch_hint(batch, mini, micro)}"
        )
    if config.rollout.max_turns < 1 or config.rollout.max_new_tokens < 1:
        raise ConfigError("config.rollout.max_turns and max_new_tokens must be >= 1")


def _mini_batch_hint(batch: int, mini: int, micro: int) -> str:
    """The largest valid mini-batch size below ``mini`` (a divisor of the batch and a multiple of micro)."""
    fits = [size for size in range(micro, mini, micro) if batch % size == 0]
    return f"; e.g. --config.algorithm.mini_batch_size={fits[-1]}" if fits else ""


def _check_schedule(config: Mapping) -> None:
    # eval and sft never read the training schedule, so a 0 there is harmless.
    if config.mode == "train" and config.trainer.total_steps < 1:
        raise ConfigError(
            f"config.trainer.total_steps={config.trainer.total_steps} must be >= 1 "
            "(to validate a checkpoint without training use --config.mode=eval)"
        )
    if config.trainer.checkpoint_every < 1:
        raise ConfigError(f"config.trainer.checkpoint_every={config.trainer.checkpoint_every} must be >= 1")
    if config.mi.enabled and config.mi.every < 1:
        raise ConfigError(f"config.mi.every={config.mi.every} must be >= 1 (or set config.mi.enabled=False)")
    if config.mi.width_buckets < 1:
        raise ConfigError(f"config.mi.width_buckets={config.mi.width_buckets} must be >= 1 (1 = the static widths)")


def _check_compile_cache(config: Mapping) -> None:
    # An unwritable cache directory is not an error: the run goes on uncached (setup/runtime.py warns).
    cache = config.compile_cache
    if cache.min_compile_time_secs < 0:
        raise ConfigError(f"config.compile_cache.min_compile_time_secs={cache.min_compile_time_secs} must be >= 0")
    if cache.enabled and cache.dir and os.path.isfile(os.path.expanduser(cache.dir)):
        raise ConfigError(f"config.compile_cache.dir: {cache.dir!r} is a file, not a directory; choose another "
                          "directory or set config.compile_cache.enabled=False")


def check_run_dir(path: str) -> None:
    """The run directory must be a writable directory, or creatable as one: checked before anything is
    written, so a bad path fails in a line rather than in the middle of a run."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"config.run_dir: {path!r} is a file, not a directory; choose another config.run_dir")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"config.run_dir: cannot create {path!r}: {existing!r} is a file; "
                          "choose another config.run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"config.run_dir: {existing!r} is not writable; choose a writable config.run_dir "
                          "or fix its permissions")
