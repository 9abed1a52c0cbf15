"""FrozenLake 4x4 (RAGEN-2 main table: deterministic, success_rate 1.0), sized for the CPU default.

The tiny preset with the character tokenizer, started from the supervised warm start (built on first
use and cached under runs/warm_starts), compact prompts, GRPO with RAGEN-2's SNR-Aware Filtering (top-p
0.9, linear mode, as in RAGEN's README command), 4 groups x 8 episodes of up to 5 turns of 96 tokens
(RAGEN's 8 x 16 x 400 tokens and PPO stay one flag away: --config=configs/frozen_lake.py:ppo
--config.rollout.n_groups=8 ...; no filter: --config.filter.value=1.0).

Where it differs from the other tasks' CPU defaults, each measured (README "Learning"):
- 600 supervised steps (``sft.steps``; 120 elsewhere). Every demonstration's reasoning restates the
  prompt's "P (r, c) G (r, c)"; the warm start restates it right in 0.00 / 0.12 / 0.80 of first turns
  with 120 / 360 / 600 steps and solves 0.18 / 0.20 / 0.42 of 128 validation episodes at T=0.5
  (``benchmarks/grid_diagnosis.py``). Built by the current code it solves 0.61-0.65 of the trainer's 256
  validation episodes.
- The filter on (``filter.value`` 0.9; RAGEN's base config: 1.0, no filter). Groups whose 8 episodes all
  succeed or all fail (about half of them) have zero GRPO advantage; unfiltered, they cost half the
  update, and a mini-batch holding only such groups still makes a full Adam step, on the entropy bonus
  alone. From the same warm start, 40 RL steps add +0.086, +0.109, +0.102 on 256 validation episodes
  with the filter (each beyond two standard errors; update 7.0-7.8 s per step, runs of 17.8-21.7
  minutes) and +0.078, +0.141, +0.074 without (one seed beyond; update 11.3-12.9 s, 22.7-25.9 minutes;
  README "Learning").
- Rollouts at temperature 0.7 (``rollout.temperature``; RAGEN: 1.0) and actor lr 3e-5 (``optim.actor_lr``),
  as Countdown's and the bandit's: from the 600-step warm start, lr 1e-4 lowered validation success on
  every seed within 10 steps (0.45 / 0.43 / 0.45 -> 0.39 / 0.36 / 0.28).
- Validation on 256 episodes every 20 steps: one standard error of a success rate near 0.45 is 0.031.
- Update micro-batches of 4 rows (``algorithm.micro_batch_size``): the same gradient up to rounding,
  half the working memory of the update's widest rows.
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    c = cpu_task_config("frozen_lake", max_turns=5, max_new_tokens=96, total_steps=40,
                        env_params={"max_actions": 10, "success_rate": 1.0}, algorithm=algorithm,
                        micro_batch_size=4)
    c.sft.steps = 600
    c.rollout.temperature = 0.7
    c.optim.actor_lr = 3e-5
    c.validation.episodes = 256
    c.validation.every = 20
    c.filter.value = 0.9
    return c
