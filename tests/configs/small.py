"""A task config shrunk for tests: ``--config=tests/configs/small.py:frozen_lake`` (any task name).

Same code paths as the real task config (rollout, MI, filter, PPO + critic, validation, checkpoints),
with a 2-layer d=64 model, 2 groups x 2 samples, 2 turns of 16 tokens, random init (no warm start;
tests/test_sft.py covers init=sft).
"""

import importlib.util
import os


def get_config(task: str = "frozen_lake"):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"{task}.py")
    spec = importlib.util.spec_from_file_location(f"_task_{task}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("ppo")  # PPO: the critic's code paths too
    c.init = "random"
    # No filter (RAGEN's base config): from random weights a group's rewards mostly tie, and a task config
    # that filters (FrozenLake's) would leave most test steps with nothing to train on.
    c.filter.value = 1.0
    c.model.overrides = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                         "num_kv_heads": 2, "head_dim": 16}
    c.rollout.n_groups = 2
    c.rollout.group_size = 2
    c.rollout.max_turns = min(c.rollout.max_turns, 2)
    c.rollout.max_new_tokens = 16
    c.algorithm.mini_batch_size = 2
    c.algorithm.micro_batch_size = 2
    c.trainer.total_steps = 3
    c.trainer.checkpoint_every = 1
    c.trainer.sample_every = 2
    c.trainer.progress = False
    c.validation.every = 3
    c.validation.episodes = 2
    c.mi.every = 2
    c.mi.num_samples = 4
    # One cross-scoring program per strategy: a few-step run meets a new width bucket at almost every
    # MI step, each a compile of seconds (tests/diagnostics/test_mi_width.py covers the buckets).
    c.mi.width_buckets = 1
    return c
