"""The run's rollouts from its config: on-device envs (fused, or host-stepped) and host envs (plain Python,
``envs.registry.HOST_REGISTRY``), whose envs run in one pool shared by training and validation
(``rollout.host_pool``, docs/host_envs.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.host_envs import TextEnvHostFactory
from ragen_jax.rollout.host_pool import error_counts, make_env_batch
from ragen_jax.rollout.host_stepped import HostRollout
from ragen_jax.rollout.layout import rollout_config


def build_rollouts(config, tokenizer, actor_graphdef, model_cfg, env, env_params) -> tuple[Any, Any]:
    """(training rollout, validation rollout): validation runs n_groups x 1 sample per chunk, as many
    chunks as validation.episodes needs; built once so that every validation reuses one compiled program.
    A host env (``env`` its factory) or ``rollout.host_workers`` > 0 steps the envs in one shared
    ``host_pool`` (worker processes, ``rollout.host_step_timeout_s`` per call)."""
    r_cfg = rollout_config(config)
    val_cfg = dataclasses.replace(r_cfg, n_groups=min(config.validation.episodes, r_cfg.batch), group_size=1)
    r = config.rollout
    if env_params is None:  # a host env
        envs = make_env_batch(env, r.host_workers, r.host_step_timeout_s)
        return tuple(HostRollout(actor_graphdef, tokenizer, env, c, envs=envs, model_cfg=model_cfg)
                     for c in (r_cfg, val_cfg))
    envs = None
    if r.mode == "host" and r.get("host_workers", 0) > 0:
        factory = TextEnvHostFactory(config.env.name, tokenizer, dict(config.env.params), r_cfg.prompt_style,
                                     r_cfg.max_actions_per_turn, r_cfg.max_new_tokens)
        envs = make_env_batch(factory, r.host_workers, r.host_step_timeout_s)
    return tuple(Rollout(actor_graphdef, tokenizer, env, c, env_params=env_params, model_cfg=model_cfg, host_envs=envs)
                 for c in (r_cfg, val_cfg))


def host_error_metrics(traj: Any, prefix: str) -> dict[str, float]:
    """``{prefix}/host_errors`` and ``{prefix}/host_errors/<kind>``: episodes of ``traj`` a failed host-env
    call ended (timeout, exception, crash)."""
    return {f"{prefix}/{k}": v for k, v in error_counts(traj.host_error, traj.sample_turn).items()}
