"""Countdown (RAGEN-2's single-turn task: reach the target with + - * / using every number once), sized
for the CPU default.

Tiny preset + character tokenizer from the supervised warm start, compact prompts, GRPO, one turn, one
action of up to 64 tokens, 4 groups x 8 episodes (RAGEN-2: 8 x 16), 100 steps, validation on 512 episodes
(RAGEN-2's count) every 20 steps.

The differences from RAGEN-2 and the CPU choices, each measured (README "Learning"):
- The data: 2-3 numbers from 1-9 and targets 1-20 (``CPU_DATA``) instead of RAGEN's 3-4 numbers from
  1-99 and targets 1-100. On RAGEN's data the tiny warm start never solves an item (it does not even copy
  two-digit numbers exactly, with 120 or 320 supervised steps), so every group's rewards are equal and RL
  has no signal; on the small numbers its warm start solves a fifth to a third (T = 0.5), leaving RL room.
  RAGEN's data is one option away: ``--config=configs/countdown.py:ragen`` (or ``:ragen,ppo``).
- Rollouts sample at temperature 0.7 (RAGEN: 1.0) and the actor learning rate is 3e-5 (the other CPU
  tasks: 1e-4): with 1.0 and 1e-4 the tiny model's samples leave the answer format and RL takes the
  format apart faster than it learns the task (the bandit measurements in the README).
- The warm start trains 400 supervised steps (the other tasks: 120): good but clearly imperfect, so RL has
  room. It reaches loss 0.23 and solves 0.19 at T = 0.5 (greedy 0.28, 64 episodes); 100 GRPO steps take
  validation success from 0.19 to RESULT400 (3 seeds, 512 episodes). With 600 steps the warm start solves
  0.38 (loss 0.14) and RL gains less and not on every seed (0.383 -> 0.430: +0.092, +0.058, -0.010): it
  mostly closes the gap between sampled and greedy success. With 300 steps the success the warm start
  reaches hangs on float rounding (0.20 and 0.08 at T = 0.5 for the same seed and batches built by two
  versions of the code).
- Its batches are padded to one width, 208 (``sft.bucket``), so each batch mixes 2- and 3-number items:
  with widths 192 and 208 (``sft.bucket=16``, a batch is drawn from one width) the loss stalled near
  0.56-0.58 and the warm start solved 0-2% (sft seeds 0 and 1), where one width reaches loss 0.29 and 20%
  (T = 0.5, 300 steps, the same seed-0 batches).
- Attention is one block (``model.overrides.attention_block=0``: rows of about 200 tokens) and the warm
  start's micro-batches hold 8 episodes: a warm-start step takes 0.92 s instead of 1.21 s (blocks of 128,
  micro-batches of 4) on a 2-core AMD EPYC (Zen 3) machine.
"""

from configs.base import apply_algorithm_preset, cpu_task_config, split_options

RAGEN_DATA = {"min_count": 3, "max_count": 4, "max_number": 99, "min_target": 1, "max_target": 100}
CPU_DATA = {"min_count": 2, "max_count": 3, "max_number": 9, "min_target": 1, "max_target": 20}


def get_config(options: str = ""):
    """options: comma-separated; "ragen" selects RAGEN's data, any other is an algorithm preset."""
    ragen, algorithms = split_options(options, "ragen")
    data = RAGEN_DATA if ragen else CPU_DATA
    c = cpu_task_config("countdown", max_turns=1, max_new_tokens=64 if data is CPU_DATA else 96, total_steps=100,
                        env_params={"max_actions": 1, **data}, max_actions_per_turn=1)
    for name in algorithms:
        apply_algorithm_preset(c, name)
    c.rollout.temperature = 0.7
    c.optim.actor_lr = 3e-5
    c.sft.steps = 400
    c.sft.micro_batch_size = 8
    c.model.overrides.attention_block = 0  # rows of about 200 tokens: one block, 20% faster than blocks of 128
    c.sft.bucket = 208  # every episode (180-207 tokens) in one width: mixed batches, 19% narrower than 256
    c.validation.episodes = 512  # RAGEN's count: two standard errors of a before/after difference ~0.06
    c.validation.every = 20
    return c
