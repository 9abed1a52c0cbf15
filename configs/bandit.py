"""RAGEN's two-armed bandit (v1 task): one turn, pick the high-risk arm by its name.

Tiny preset + character tokenizer (random initial weights: the supervised warm start has not landed
yet), compact prompts.
"""

from configs.base import get_config as base_config


def get_config():
    c = base_config()
    c.env.name = "bandit"
    c.env.prompt_style = "compact"
    c.env.max_actions_per_turn = 1
    c.env.params = {"max_actions": 1}
    c.model.preset = "tiny"
    c.init = "random"  # the supervised warm start (init="sft") has not landed yet
    c.rollout.n_groups = 4
    c.rollout.group_size = 8
    c.rollout.max_turns = 1
    c.rollout.max_new_tokens = 48
    c.algorithm.mini_batch_size = 16
    c.algorithm.micro_batch_size = 8
    c.optim.actor_lr = 1e-4
    c.optim.critic_lr = 1e-3
    c.trainer.total_steps = 30
    c.trainer.checkpoint_every = 10
    c.validation.every = 10
    c.validation.episodes = 64
    c.mi.num_samples = 16
    return c
