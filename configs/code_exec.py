"""Code execution (RAGEN-2's DeepCoder task) for a real model: ``--config.model.hf_path=/path/to/Qwen2.5-Coder-7B``.

A host env (``envs/code_exec.py``, ``rollout.mode = "host"``): one turn, the answer is a Python program,
reward = passed tests / total tests, each test run in a bubblewrap sandbox (``apt-get install
bubblewrap``; the env refuses to start without it). Not for the tiny CPU default: the character-level
model cannot write programs, so there is no warm start (``init = "random"`` loads the checkpoint's weights).

RAGEN-2's DeepCoder run (``config/_10_deepcoder.yaml``, ``scripts`` of the paper): Qwen2.5-Coder-7B, GRPO,
16 groups x 8, 200 steps, no KL, responses up to 4000 tokens, MI metrics off. Data: the 25 shipped
problems by default; a DeepCoder-format .jsonl (``agentica-org/DeepCoder-Preview-Dataset`` exported with
``datasets``) via ``--config.env.params.data_path=...``.
"""

import ml_collections

from configs.base import get_config as base_config


def get_config(algorithm: str = ""):
    c = base_config(algorithm or "grpo")
    c.env.name = "code_exec"
    c.env.prompt_style = "ragen"
    c.env.max_actions_per_turn = 1
    # Keyword arguments of envs.code_exec.CodeExecEnv (through envs.registry.make_host).
    c.env.params = ml_collections.ConfigDict({"data_path": "", "max_response_tokens": 4000})
    c.model.tokenizer = "hf"
    c.model.dtype = "bfloat16"
    c.init = "random"
    c.rollout.mode = "host"
    c.rollout.n_groups = 16
    c.rollout.group_size = 8
    c.rollout.max_turns = 1
    c.rollout.max_new_tokens = 4000
    # The longest user message in tokens: the shipped problems are <= 430 characters; DeepCoder's own
    # problem statements run to a few thousand tokens (raise it with data_path).
    c.rollout.max_user_tokens = 512
    c.algorithm.use_kl_loss = False
    c.mi.enabled = False
    c.trainer.total_steps = 200
    return c
