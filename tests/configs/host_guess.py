"""A test-sized run of a plain-Python host env: ``--config=tests/configs/host_guess.py``.

Registers ``tests/_host_envs.py``'s GuessNumber as the host env "guess_number" (a user's own env
registers the same way, docs/host_envs.md) and shrinks the run as ``small.py`` does; the seed 10000 (the
first group of step 1) raises in its first step, so the metrics show one host error kind.
"""

import functools
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (TESTS, os.path.join(TESTS, "configs")) if p not in sys.path]

import ml_collections  # noqa: E402
from _host_envs import FaultyGuess  # noqa: E402
from small import get_config as small_config  # noqa: E402

from envs.registry import HOST_REGISTRY  # noqa: E402


def get_config(workers: str = "2"):
    HOST_REGISTRY["guess_number"] = functools.partial(FaultyGuess, faults={10000: ("raise", 1)})
    c = small_config("frozen_lake")
    c.env.name = "guess_number"
    c.env.params = ml_collections.ConfigDict({"high": 5})
    c.rollout.mode = "host"
    c.rollout.max_user_tokens = 40
    c.rollout.host_workers = int(workers)
    c.rollout.host_step_timeout_s = 5.0
    c.trainer.total_steps = 2
    c.validation.every = 2
    c.validation.episodes = 4  # one validation chunk of the training batch's shape: no new compile
    # GRPO: no critic to compile (small.py's PPO covers the critic's code paths)
    c.algorithm.update(name="grpo", adv_estimator="grpo", norm_adv_by_std=True, loss_agg_mode="seq-mean-token-mean")
    return c
