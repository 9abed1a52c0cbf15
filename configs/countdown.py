"""Countdown (3-4 numbers, reach the target with + - * /; RAGEN-2's single-turn task), sized for CPU.

Tiny preset + character tokenizer (random initial weights: the supervised warm start has not landed
yet), compact prompts, one turn, one action, a smaller batch than RAGEN's 8 x 16.
"""

from configs.base import cpu_task_config


def get_config():
    return cpu_task_config("countdown", max_turns=1, max_new_tokens=64, total_steps=30,
                           env_params={"max_actions": 1}, max_actions_per_turn=1)
