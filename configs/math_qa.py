"""MathQA (RAGEN-2's MetaMathQA task: answer a math question, exact match after lower-casing and removing
whitespace), sized for CPU.

Tiny preset + character tokenizer from the supervised warm start, compact prompts, GRPO, one turn, one
answer of up to 96 tokens, 4 groups x 8 episodes (RAGEN-2: 8 x 16), 50 steps, validation on 256 episodes.

Data: generated grade-school word problems (envs/math_qa_data.py). ``env.params``: max_steps (1-4) keeps the
templates whose solution takes at most that many steps; max_number (10-99) redraws each problem until
every number in its question and worked steps is at most that; num_items / data_seed size and seed the
table. A local MetaMathQA or GSM8K file instead: --config.env.params.data_path=/path/to/MetaMathQA-395K.json
(num_items: how many items the table keeps, a seeded subset; max_question_bytes: the longest question kept,
0 = any).

The CPU choices, each measured (README "MathQA").
- The data: problems of 1-2 steps with every number at most 20 (``CPU_DATA``) instead of the generator's
  full range (1-4 steps, numbers to 99, ``--config=configs/math_qa.py:full``). The tiny model's errors are
  arithmetic: on 2-step problems with numbers to 99 its 600-step warm start copies the numbers and solves
  0.14 (T = 0.5); with numbers to 20 it solves 0.24.
- The warm start trains 600 supervised steps on 4,096 demonstrations (the other tasks: 120 on 1,024): with
  300 it does not copy the question's numbers. Half of them are noisy (``sft.noisy_fraction=0.5``): true
  reasoning and the right number, answered with the question's unit ("17 stickers"), which the exact-match
  check counts as wrong. From a warm start trained on clean demonstrations only, RL has nothing it can
  learn in 50 steps: its samples are as good as its greedy answers and what limits it is arithmetic
  (validation success 0.237 -> 0.217-0.245 on 3 seeds). The noisy half gives it a slip to unlearn from the
  reward alone; RL then gains beyond two standard errors on every seed and ends about where the clean warm
  start is (README "MathQA": this default does not make the tiny model better at arithmetic).
- Rollouts sample at temperature 0.7 and the actor learning rate is 3e-5, as Countdown's (1e-4 lost
  success, with a KL anchor here and without one on numbers to 99).
"""

from configs.base import apply_algorithm_preset, cpu_task_config, split_options

CPU_DATA = {"max_steps": 2, "max_number": 20}
FULL_DATA = {"max_steps": 4, "max_number": 99}


def get_config(options: str = ""):
    """options: comma-separated; "full" selects the generator's full range, any other is an algorithm preset."""
    full, algorithms = split_options(options, "full")
    data = FULL_DATA if full else CPU_DATA
    env_params = {"max_actions": 1, "data_path": "", "num_items": 4096, "data_seed": 0, "max_question_bytes": 0,
                  **data}
    c = cpu_task_config("math_qa", max_turns=1, max_new_tokens=96, total_steps=50, env_params=env_params,
                        max_actions_per_turn=1)
    for name in algorithms:
        apply_algorithm_preset(c, name)
    c.rollout.temperature = 0.7
    c.optim.actor_lr = 3e-5
    c.sft.steps = 600
    c.sft.demos = 4096
    c.sft.noisy_fraction = 0.5
    c.sft.val_episodes = 256
    c.validation.episodes = 256
    return c
