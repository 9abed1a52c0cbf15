"""RAGEN's two-armed bandit (v1 task): one turn, pick the high-risk arm by its name.

Tiny preset + character tokenizer from the supervised warm start, compact prompts, GRPO.
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    return cpu_task_config("bandit", max_turns=1, max_new_tokens=96, total_steps=30,
                           env_params={"max_actions": 1}, max_actions_per_turn=1, algorithm=algorithm)
