"""FrozenLake 4x4 (RAGEN-2 main table: deterministic, success_rate 1.0), sized for the CPU default.

The tiny preset with the character tokenizer (random initial weights: the supervised warm start has
not landed yet), compact prompts, a smaller batch and shorter responses than RAGEN's
8 x 16 x 400 tokens (those stay one flag away: --config.rollout.n_groups=8 ...).
"""

from configs.base import get_config as base_config


def get_config():
    c = base_config()
    c.env.name = "frozen_lake"
    c.env.prompt_style = "compact"
    c.env.params = {"max_actions": 10, "success_rate": 1.0}
    c.model.preset = "tiny"
    c.init = "random"  # the supervised warm start (init="sft") has not landed yet
    c.rollout.n_groups = 4
    c.rollout.group_size = 8
    c.rollout.max_turns = 5
    c.rollout.max_new_tokens = 64
    c.algorithm.mini_batch_size = 16
    c.algorithm.micro_batch_size = 8
    c.optim.actor_lr = 1e-4
    c.optim.critic_lr = 1e-3
    c.trainer.total_steps = 40
    c.trainer.checkpoint_every = 10
    c.validation.every = 10
    c.validation.episodes = 64
    c.mi.num_samples = 16
    return c
