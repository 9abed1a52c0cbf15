"""Sokoban 6x6 with one box (RAGEN-2's main-table task), sized for the CPU default.

Tiny preset + character tokenizer from the supervised warm start, compact prompts, GRPO, 4 groups x 8
episodes of up to 5 turns of 120 tokens (RAGEN's CoordSokoban response budget; RAGEN-2 trains 8 x 16 x 400).

One change from RAGEN's rewards: an invalid turn costs -1.0 (``rollout.format_penalty``), not -0.1.
With -0.1 a turn in the wrong format is cheaper than a valid turn of two moves (-0.2, and -1 for a box
pushed off a target), so a policy that rarely solves a level is rewarded for breaking the format; the
tiny warm start did exactly that (valid-action rate 0.80 -> 0.00 in 20 GRPO steps, README "Learning").
RAGEN's value is one flag away: ``--config.rollout.format_penalty=-0.1``.
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    c = cpu_task_config("sokoban", max_turns=5, max_new_tokens=120, total_steps=40,
                        env_params={"max_actions": 10}, algorithm=algorithm, micro_batch_size=4)
    c.rollout.format_penalty = -1.0
    return c
