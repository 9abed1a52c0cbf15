"""SearchQA (RAGEN-2's HotpotQA search task) for a real model: ``--config.model.hf_path=/path/to/Qwen2.5-3B-Instruct``.

A host env (``envs/search_qa.py``, ``rollout.mode = "host"``): ``search[query]`` returns the top 5
passages of a local BM25 index (RAGEN uses a dense retrieval server), ``finish[answer]`` is scored by
exact match / F1. Not for the tiny CPU default (no warm start for free-text search; ``init = "random"``
loads the checkpoint's weights).

RAGEN-2's run (``config/_9_search.yaml``): Qwen2.5-3B-Instruct, PPO, 16 groups x 8, 5 turns of one action,
200 steps, mini-batch 32. Data: the shipped invented-world corpus and questions by default; a HotpotQA
JSON file (``--config.env.params.hotpotqa_path=...``: its questions, its contexts as the corpus) or
your own JSONL files (``questions_path``, ``corpus_path``). A turn after a search carries up to
``max_total_chars`` (4000) characters of results: size the host rollout's user-message width for it.
"""

from configs.base import host_task_config


def get_config(algorithm: str = ""):
    # Keyword arguments of envs.search_qa.SearchQAEnv (through envs.registry.make_host). A search result
    # holds 5 passages (up to ~4,000 characters, about 1,000 BPE tokens) plus the turn text.
    c = host_task_config("search_qa", env_params={"questions_path": "", "corpus_path": "", "hotpotqa_path": "",
                                                  "max_steps": 10, "top_k": 5},
                         max_turns=5, max_new_tokens=300, max_user_tokens=1280, total_steps=200,
                         algorithm=algorithm or "ppo")
    c.algorithm.mini_batch_size = 32
    return c
