"""The Python API: what the command line does, callable from a notebook or a script.

    from ragen_jax import api

    config = api.load_config("frozen_lake", {"trainer.total_steps": 5, "run_dir": "runs/fl"})
    summary = api.train(config, on_step=lambda step, m: print(step, m.get("train/success")))
    policy = api.load_policy(config)                  # the run's newest checkpoint
    print(api.sample_conversations(policy, n=1)[0])
    scores = api.mi_scores(policy)                    # the MI cross-scoring matrix of one batch
    path, sft_metrics = api.warm_start(config)        # the supervised warm start of init="sft"
    api.export(config, "exported/fl")                 # a Hugging Face directory

``python -m ragen_jax.main`` is this module behind flags: the same checks, the same run directory, the
same files written. Every function raises ``ConfigError`` (a one-line message) for a config it cannot
use, before it builds anything. Every function that compiles turns on the config's persistent
compilation cache (``compile_cache.*``, on by default) as the command line does, so a notebook's second
run of the same shapes (the filter comparison after the main run, a policy loaded after training, the
same cell run again) loads its programs instead of compiling them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import ml_collections
import numpy as np
from flax import nnx

from envs.registry import HOST_REGISTRY, REGISTRY
from ragen_jax.diagnostics.cross_scoring import cross_score, pair_metrics
from ragen_jax.diagnostics.mi import init_marginal_std_ema
from ragen_jax.export import export_hf
from ragen_jax.models.config import PRESETS
from ragen_jax.parallel import distributed
from ragen_jax.setup import runtime
from ragen_jax.setup.config_check import ConfigError, check_config, run_dir_of
from ragen_jax.setup.config_file import load_config_file
from ragen_jax.sft.warm_start import build_warm_start, read_metrics
from ragen_jax.train.loop import mi_pairs
from ragen_jax.train.loop import train as train_run
from ragen_jax.train.saved_run import evaluate as evaluate_run
from ragen_jax.train.saved_run import load_run

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def load_config(task: str, overrides: Mapping[str, Any] | None = None, *,
                preset: str = "") -> ml_collections.ConfigDict:
    """The checked config of ``configs/<task>.py`` (or of a config file's path) with ``overrides``.

    Args:
      task: a task name ("countdown", "frozen_lake", "sokoban", "bandit") or a path to a config file.
      overrides: dotted keys and their values, e.g. {"trainer.total_steps": 5, "rollout.temperature": 0.7}
        (the ``--config.a.b=v`` flags of the CLI).
      preset: an algorithm preset ("ppo" | "grpo" | "drgrpo" | "dapo" | "rloo"), the CLI's ``configs/<task>.py:grpo``.
    """
    path = task if task.endswith(".py") else str(CONFIG_DIR / f"{task}.py")
    if not os.path.isfile(path):
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "base")
        raise ConfigError(f"no config file for task {task!r}: one of {names}, or a path to a configs/*.py file")
    config = load_config_file(f"{path}:{preset}" if preset else path)
    for key, value in (overrides or {}).items():
        if key == "algorithm.name":
            raise ConfigError("choose an algorithm with preset=..., not the algorithm.name key")
        parent, _, leaf = key.rpartition(".")
        try:
            node = config
            for part in filter(None, parent.split(".")):
                node = node[part]
            if leaf not in node:
                raise KeyError(key)
            node[leaf] = value
        except KeyError:
            raise ConfigError(f"unknown config key {key!r}; see configs/base.py") from None
        except TypeError as e:  # ConfigDict refuses a value of another type
            raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
    check_config(config, env_names=REGISTRY, model_presets=PRESETS, host_envs=HOST_REGISTRY)
    return config


def train(config: ml_collections.ConfigDict, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Train (or resume) the run of ``config`` in its run directory (``run_dir``, or runs/<env>-<alg>-seed<s>).

    ``on_step(step, metrics)`` is called after each step (step 0: the validation before training) with the
    metrics row written to ``metrics.jsonl``, e.g. to draw live curves. Returns the run's summary: stop
    reason, wall time, the last metrics.
    """
    runtime.use_compilation_cache(config)
    distributed.maybe_initialize(config)
    return train_run(config, run_dir_of(config), on_step=on_step)


def evaluate(config: ml_collections.ConfigDict) -> dict[str, float]:
    """The validation metrics (``val/*``) of the run's newest checkpoint, or of the initial policy."""
    runtime.use_compilation_cache(config)
    return evaluate_run(config, run_dir_of(config))


def warm_start(config: ml_collections.ConfigDict) -> tuple[str, dict]:
    """Build (or find in ``sft.cache_dir``) the supervised warm start that ``init="sft"`` starts from;
    returns (its directory, its metrics: validation success, final loss, ...)."""
    runtime.use_compilation_cache(config)
    path = build_warm_start(config)
    return path, {k: v for k, v in read_metrics(path).items() if k != "loss_curve"}


@dataclasses.dataclass
class Policy:
    """A run's policy at one checkpoint: ``run`` (tokenizer, env, compiled rollouts) and ``state`` (the
    actor's parameters and the rest of the training state)."""

    run: Any
    state: Any
    step: int

    @property
    def model(self) -> nnx.Module:
        """The actor as a ``models.transformer.Transformer``."""
        return nnx.merge(self.run.actor_graphdef, self.state.actor)


def load_policy(config: ml_collections.ConfigDict) -> Policy:
    """The policy of the run's newest checkpoint that restores (step 0, the initial policy, when none)."""
    runtime.use_compilation_cache(config)
    run, state, step = load_run(config, run_dir_of(config))
    return Policy(run, state, step)


def rollout(policy: Policy, seed: int = 0):
    """One training-shaped batch of episodes (``rollout.trajectories.Trajectories``, numpy): n_groups x
    group_size episodes on the validation seeds, sampled at the rollout temperature with key ``seed``."""
    r = policy.run.rollout_cfg
    seeds = r.val_seed + np.arange(r.n_groups, dtype=np.int32)
    return policy.run.rollout.run(policy.state.actor, jax.random.key(seed), seeds).to_numpy()


def sample_conversations(policy: Policy, n: int = 2, seed: int = 0) -> list[str]:
    """``n`` conversations (prompt, reasoning, actions, the environment's replies) of one rollout batch."""
    traj = rollout(policy, seed)
    return [traj.to_text(i, policy.run.tokenizer) for i in range(min(n, traj.num_rows))]


@dataclasses.dataclass
class MIScores:
    """The MI diagnostic of one batch: ``log_prob[m, n]`` = mean log-probability of reasoning m under
    prompt n (``diagnostics.cross_scoring``); ``true_col[m]`` is reasoning m's own prompt. A policy
    whose reasoning depends on its input scores each reasoning highest under its own prompt (the
    diagonal stands out); template collapse flattens the rows. ``metrics``: the trainer's MI metrics
    (mi_estimate, retrieval accuracy, ...) of this batch."""

    log_prob: np.ndarray  # f32[M, N]
    true_col: np.ndarray  # int32[M]
    row_valid: np.ndarray  # bool[M]
    col_valid: np.ndarray  # bool[N]
    metrics: dict[str, float]


def mi_scores(policy: Policy, strategy: str = "trajectory", seed: int = 0) -> MIScores:
    """Cross-score the (prompt, reasoning) pairs of ``strategy`` ("trajectory" | "first_turn") on one
    rollout batch of ``policy``."""
    run, mi = policy.run, policy.run.config.mi
    pairs = mi_pairs(run, rollout(policy, seed), jax.random.key(seed + 1), strategy)
    logp_sum, logp_mean = cross_score(policy.model, pairs.x_tokens, pairs.x_valid, pairs.z_tokens, pairs.z_valid,
                                      run.rollout_cfg.temperature)
    metrics, _ = pair_metrics(logp_sum, logp_mean, pairs, init_marginal_std_ema(), mi.std_eps, mi.ema_decay)
    return MIScores(np.asarray(logp_mean), np.asarray(pairs.true_col), np.asarray(pairs.row_valid),
                    np.asarray(pairs.col_valid), {k: float(v) for k, v in metrics.items()})


def export(config: ml_collections.ConfigDict, out_dir: str, *, overwrite: bool = False) -> str:
    """The run's newest checkpoint as a Hugging Face directory (``ragen_jax.export``); returns ``out_dir``."""
    return export_hf(run_dir_of(config), out_dir, overwrite=overwrite, verbose=False)
