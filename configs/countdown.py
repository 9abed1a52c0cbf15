"""Countdown (3-4 numbers, reach the target with + - * /; RAGEN-2's single-turn task), sized for CPU.

Tiny preset + character tokenizer from the supervised warm start, compact prompts, GRPO, one turn, one
action of up to 96 tokens, 4 groups x 8 episodes (RAGEN-2: 8 x 16).
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    return cpu_task_config("countdown", max_turns=1, max_new_tokens=96, total_steps=30,
                           env_params={"max_actions": 1}, max_actions_per_turn=1, algorithm=algorithm)
