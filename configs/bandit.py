"""RAGEN's two-armed bandit (v1 task): one turn, pick the high-risk arm by its name.

Tiny preset + character tokenizer (random initial weights: the supervised warm start has not landed
yet), compact prompts.
"""

from configs.base import cpu_task_config


def get_config():
    return cpu_task_config("bandit", max_turns=1, max_new_tokens=48, total_steps=30,
                           env_params={"max_actions": 1}, max_actions_per_turn=1)
