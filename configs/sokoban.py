"""Sokoban 6x6 with one box (RAGEN-2's main-table task), sized for the CPU default.

Tiny preset + character tokenizer from the supervised warm start, compact prompts, GRPO, 4 groups x 8
episodes of up to 5 turns of 120 tokens (RAGEN's CoordSokoban response budget; RAGEN-2 trains 8 x 16 x 400).
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    return cpu_task_config("sokoban", max_turns=5, max_new_tokens=120, total_steps=40,
                           env_params={"max_actions": 10}, algorithm=algorithm)
