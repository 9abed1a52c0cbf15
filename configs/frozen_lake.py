"""FrozenLake 4x4 (RAGEN-2 main table: deterministic, success_rate 1.0), sized for the CPU default.

The tiny preset with the character tokenizer, started from the supervised warm start (built on first
use and cached under runs/warm_starts), compact prompts, GRPO, 4 groups x 8 episodes of up to 5 turns
of 96 tokens (RAGEN's 8 x 16 x 400 tokens and PPO stay one flag away: --config=configs/frozen_lake.py:ppo
--config.rollout.n_groups=8 ...).
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    return cpu_task_config("frozen_lake", max_turns=5, max_new_tokens=96, total_steps=40,
                           env_params={"max_actions": 10, "success_rate": 1.0}, algorithm=algorithm)
