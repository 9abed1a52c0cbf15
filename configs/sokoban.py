"""Sokoban 6x6 with one box (RAGEN-2's main-table task), sized for the CPU default.

Tiny preset + character tokenizer (random initial weights: the supervised warm start has not landed
yet), compact prompts, a smaller batch and shorter responses than RAGEN's 8 x 16 x 400 tokens.
"""

from configs.base import cpu_task_config


def get_config():
    return cpu_task_config("sokoban", max_turns=5, max_new_tokens=64, total_steps=40,
                           env_params={"max_actions": 10})
