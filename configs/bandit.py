"""RAGEN's two-armed bandit (v1 task): one turn, pick the high-risk arm by its name.

Tiny preset + character tokenizer from the supervised warm start, compact prompts, RLOO, 8 groups x 8
episodes, 40 steps, validation on 256 episodes of the same 12 training arm pairs (RAGEN's
``BanditTest`` has 8 other pairs; the trainer validates on the training env's parameters, so those
are not measured). The check (RAGEN's): RL moves the policy toward the arm with the higher mean reward, the
high-risk one (1.0 with probability 0.25 against the low-risk arm's sure 0.1).

The CPU choices, each measured (README "Learning"):
- The warm start imitates demonstrations that pick each arm half the time (``sft.noisy_fraction=0.5``:
  a noisy demonstration pulls the low-risk arm), so it starts near indifferent (validation success
  0.49-0.55) and the arm choice is left to RL. With the default 0.3 it already picks the high-risk arm
  92% of the time.
- RLOO (``configs/bandit.py:grpo`` for GRPO): GRPO's division by the group's reward std favours the
  low-risk arm on this reward (``benchmarks/bandit_advantage.py``: E[A | risky] - E[A | safe] < 0 for
  groups of 8 at every P(risky) up to 0.9), RLOO's leave-one-out advantage favours the high-risk arm.
- 8 groups per step (the other CPU tasks: 4; a reasoned choice, not measured against 4): a group sees
  one arm pair, and the high-risk arm's 0/1 payoff makes one group's verdict noisy.
- Rollouts at temperature 0.7 and actor lr 3e-5: at 1.0 only 41% of a warm start's answers name an
  arm (the 0.3-noisy one), and with lr 1e-4 (T = 0.7) the valid answers fell 0.91 -> 0.16 in two steps.
- An invalid answer costs -1.0 (``rollout.format_penalty``; RAGEN: -0.1): with -0.1 a misspelled name
  costs about what a losing high-risk pull does, and as RL favours the high-risk names their spellings
  drift (valid answers 0.99 -> 0.70-0.76 in 40 steps, seeds 0 and 1).
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    c = cpu_task_config("bandit", max_turns=1, max_new_tokens=96, total_steps=40,
                        env_params={"max_actions": 1}, max_actions_per_turn=1, algorithm=algorithm or "rloo")
    c.rollout.n_groups = 8
    c.rollout.temperature = 0.7
    c.rollout.format_penalty = -1.0
    c.optim.actor_lr = 3e-5
    c.sft.noisy_fraction = 0.5
    c.validation.episodes = 256
    return c
