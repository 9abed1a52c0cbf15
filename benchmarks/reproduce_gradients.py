"""Gradient decomposition by reward-std bucket at every checkpoint of a finished run (RAGEN-2 fig12).

    python benchmarks/reproduce_gradients.py --config=configs/sokoban.py [--config.KEY=VALUE ...] \
        --out=runs/reproduce/gradients.json [--rounds=4]

The same ``--config`` flags as the training command (so the same run directory). For the initial policy
(step 0) and each checkpoint kept in ``<run_dir>/checkpoints``: ``rounds`` training-shaped rollouts (n_groups
x group_size episodes each, on env seeds no training step uses), then, with no update,
``diagnostics.gradients.gradient_decomposition``: the norms of the task (clipped PG), entropy and KL
gradients per quantile bucket of the groups' reward std (min(6, groups) buckets, RAGEN's default 6).

Advantages are GRPO's, A = (R - mean_g) / (std_g + 1e-6) (unbiased std over the group), whatever the
run's estimator: critic-free, so a checkpoint's bucket norms do not depend on a value net's fit; the
task gradient of a zero-std group is then exactly 0, the Cauchy-Schwarz bound ||g_task|| <= c sqrt(Var(R|x))
at its extreme. old_logp = the current policy's log-probs (the first PPO epoch, ratio 1); the KL term is
to the initial policy (RAGEN's reference), with RAGEN's probe coefficients (entropy 0.001, KL 0.001
low_var_kl). Writes {"run_dir", "num_buckets", "probes": [{"step", <grad_norm/... metrics>}]} to --out;
a checkpoint already in --out is not probed again.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_OUT = flags.DEFINE_string("out", None, "JSON file of the probes (appended to across calls).")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "rollout batches per checkpoint (groups = rounds x n_groups)")

PROBE_SEED_OFFSET = 7_000_000  # env seeds far from the training (train_seed + ...) and validation seeds


def group_advantages(rewards, group_ids):
    """GRPO advantages and the group std per row: f32[B], int[B] -> (f32[B], f32[B])."""
    import numpy as np

    rewards = np.asarray(rewards, np.float64)
    adv, std = np.zeros_like(rewards), np.zeros_like(rewards)
    for g in np.unique(group_ids):
        rows = group_ids == g
        s = rewards[rows].std(ddof=1) if rows.sum() > 1 else 0.0
        adv[rows] = (rewards[rows] - rewards[rows].mean()) / (s + 1e-6)
        std[rows] = s
    return adv.astype(np.float32), std.astype(np.float32)


def probe_batch(run, actor, ref, rounds: int, step: int):
    """(batch, group_ids, reward_std) of ``rounds`` rollouts of ``actor`` (numpy, groups renumbered)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ragen_jax.models.logprobs import sequence_logprobs

    r = run.rollout_cfg
    parts = []
    for i in range(rounds):
        seeds = (PROBE_SEED_OFFSET + (step * rounds + i) * r.n_groups + np.arange(r.n_groups)).astype(np.int32)
        parts.append(run.rollout.run(actor, jax.random.key(step * rounds + i), seeds).to_numpy())
    cat = lambda name: np.concatenate([getattr(t, name) for t in parts])  # noqa: E731
    group_ids = np.concatenate([t.group_ids + i * r.n_groups for i, t in enumerate(parts)])
    adv, std = group_advantages(cat("episode_reward"), group_ids)
    tokens, valid, loss_mask = jnp.asarray(cat("tokens")), jnp.asarray(cat("valid")), jnp.asarray(cat("loss_mask"))
    logp = lambda params: sequence_logprobs(nnx.merge(run.actor_graphdef, params), tokens, valid, r.temperature)[0]  # noqa: E731
    batch = {"tokens": tokens, "valid": valid, "loss_mask": loss_mask, "old_logp": logp(actor),
             "ref_logp": logp(ref), "advantages": jnp.asarray(adv[:, None] * np.asarray(loss_mask, np.float32))}
    return batch, group_ids, std


def _main(argv) -> None:
    del argv
    import jax
    from flax import nnx

    from ragen_jax.diagnostics.gradients import GradientAnalysisConfig, gradient_decomposition, make_component_grad_norms
    from ragen_jax.models.logprobs import sequence_logprobs
    from ragen_jax.setup.config_check import run_dir_of
    from ragen_jax.train.checkpoint import Checkpointer
    from ragen_jax.train.loop import build_run

    config = _CONFIG.value
    run_dir = run_dir_of(config)
    out = Path(_OUT.value)
    done = json.loads(out.read_text()) if out.exists() else {"run_dir": run_dir, "probes": []}
    probed = {p["step"] for p in done["probes"]}
    run, initial = build_run(config)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=10**6)
    try:
        steps = [0, *ckpt.all_steps()]
        groups = _ROUNDS.value * run.rollout_cfg.n_groups
        cfg = GradientAnalysisConfig(num_buckets=min(6, groups))
        temperature = run.rollout_cfg.temperature

        def logprob_fn(params, batch):
            return sequence_logprobs(nnx.merge(run.actor_graphdef, params), batch["tokens"], batch["valid"], temperature)

        fn = make_component_grad_norms(logprob_fn, cfg)
        for step in steps:
            if step in probed:
                continue
            actor = initial.actor if step == 0 else ckpt.restore(initial.tree(), step)[0]["actor"]
            batch, group_ids, std = probe_batch(run, actor, initial.actor, _ROUNDS.value, step)
            metrics = gradient_decomposition(actor, batch, group_ids, std, config=cfg, grad_norms_fn=fn)
            done["probes"].append({"step": step, **metrics})
            done["num_buckets"] = cfg.num_buckets
            done["probes"].sort(key=lambda p: p["step"])
            out.write_text(json.dumps(done, indent=1) + "\n")
            print(f"step {step}: task norm by bucket "
                  + " ".join(f"{metrics.get(f'grad_norm/bucket_{i}/task', float('nan')):.3g}"
                             for i in range(1, cfg.num_buckets + 1)), flush=True)
    finally:
        ckpt.close()
        run.close()


if __name__ == "__main__":
    app.run(_main)
