"""FrozenLake 4x4 (RAGEN-2 main table: deterministic, success_rate 1.0), sized for the CPU default.

The tiny preset with the character tokenizer (random initial weights: the supervised warm start has
not landed yet), compact prompts, a smaller batch and shorter responses than RAGEN's
8 x 16 x 400 tokens (those stay one flag away: --config.rollout.n_groups=8 ...).
"""

from configs.base import cpu_task_config


def get_config():
    return cpu_task_config("frozen_lake", max_turns=5, max_new_tokens=64, total_steps=40,
                           env_params={"max_actions": 10, "success_rate": 1.0})
