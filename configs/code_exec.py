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

from configs.base import host_task_config


def get_config(algorithm: str = ""):
    # Keyword arguments of envs.code_exec.CodeExecEnv (through envs.registry.make_host). The shipped
    # problems are <= 430 characters; DeepCoder's own statements run to a few thousand tokens (raise
    # rollout.max_user_tokens with data_path).
    c = host_task_config("code_exec", env_params={"data_path": "", "max_response_tokens": 4000},
                         max_turns=1, max_new_tokens=4000, max_user_tokens=512, total_steps=200,
                         algorithm=algorithm or "grpo")
    c.algorithm.use_kl_loss = False
    c.mi.enabled = False
    return c
