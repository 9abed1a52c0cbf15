"""Fail fast on bad configs: unknown keys (naming the nearest valid one), bad choices, missing paths.

Everything here runs before any JAX compilation, and every failure is a ``ConfigError`` whose message
is one line that names the fix; ``main`` prints it and exits with status 2.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Iterable, Mapping

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
    "algorithm.name": ("ppo", "grpo", "drgrpo", "dapo"),
    "algorithm.adv_estimator": ("gae", "grpo", "rloo"),
    "algorithm.kl_type": ("kl", "mse", "low_var_kl"),
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


def check_config(config: Mapping, *, env_names: Iterable[str], model_presets: Iterable[str]) -> None:
    """Semantic checks of a parsed config (choices, names, paths, sizes)."""
    for path, allowed in CHOICES.items():
        value = _get(config, path)
        if value not in allowed:
            raise ConfigError(f"config.{path}={value!r} is not one of {', '.join(allowed)}")
    env_names = sorted(env_names)
    if config.env.name not in env_names:
        hint = difflib.get_close_matches(config.env.name, env_names, n=1)
        raise ConfigError(
            f"unknown environment '{config.env.name}' (config.env.name); known: {', '.join(env_names)}"
            + (f"; did you mean '{hint[0]}'?" if hint else "")
        )
    if config.model.hf_path:
        if not os.path.isdir(config.model.hf_path):
            raise ConfigError(f"config.model.hf_path: directory {config.model.hf_path!r} does not exist")
        if not os.path.exists(os.path.join(config.model.hf_path, "config.json")):
            raise ConfigError(f"config.model.hf_path: {config.model.hf_path!r} has no config.json (not a HF checkpoint)")
    elif config.model.gguf_path:
        if not os.path.isfile(config.model.gguf_path):
            raise ConfigError(f"config.model.gguf_path: file {config.model.gguf_path!r} does not exist")
    elif config.model.preset not in set(model_presets):
        hint = difflib.get_close_matches(config.model.preset, list(model_presets), n=1)
        raise ConfigError(
            f"unknown model preset '{config.model.preset}' (config.model.preset)"
            + (f"; did you mean '{hint[0]}'?" if hint else "")
        )
    if (config.init == "sft" or config.mode == "sft") and (config.model.hf_path or config.model.gguf_path):
        raise ConfigError(
            "the supervised warm start trains a preset model from scratch; with model.hf_path / gguf_path "
            "the pretrained weights are the start: set config.init=random"
        )
    if config.model.overrides:
        import dataclasses

        from ragen_jax.models.config import ModelConfig

        fields = [f.name for f in dataclasses.fields(ModelConfig)]
        for key in config.model.overrides:
            if key not in fields:
                hint = difflib.get_close_matches(key, fields, n=1)
                raise ConfigError(
                    f"config.model.overrides.{key} is not a ModelConfig field"
                    + (f"; did you mean '{hint[0]}'?" if hint else f"; fields: {', '.join(fields)}")
                )
    batch = config.rollout.n_groups * config.rollout.group_size
    if min(config.rollout.n_groups, config.rollout.group_size) < 1:
        raise ConfigError("config.rollout.n_groups and group_size must be >= 1")
    if config.algorithm.mini_batch_size < 1 or config.algorithm.micro_batch_size < 1:
        raise ConfigError("config.algorithm.mini_batch_size and micro_batch_size must be >= 1")
    if config.algorithm.mini_batch_size % config.algorithm.micro_batch_size:
        raise ConfigError(
            f"config.algorithm.mini_batch_size ({config.algorithm.mini_batch_size}) must be a multiple of "
            f"micro_batch_size ({config.algorithm.micro_batch_size})"
        )
    if config.algorithm.mini_batch_size > batch:
        raise ConfigError(
            f"config.algorithm.mini_batch_size ({config.algorithm.mini_batch_size}) is larger than the rollout "
            f"batch n_groups*group_size ({batch})"
        )
    if config.rollout.max_turns < 1 or config.rollout.max_new_tokens < 1:
        raise ConfigError("config.rollout.max_turns and max_new_tokens must be >= 1")
