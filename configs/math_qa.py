"""MathQA (RAGEN-2's MetaMathQA task: answer a math question, exact match after lower-casing and removing
whitespace), sized for CPU.

Generated grade-school word problems of 1-4 steps (envs/math_qa_data.py) by default; a local MetaMathQA
or GSM8K file with --config.env.params.data_path=/path/to/MetaMathQA-395K.json (num_items: how many items
the table keeps, a seeded subset; max_question_bytes: the longest question kept, 0 = any; max_steps: 1-3
keeps only the generated problems of at most that many steps; max_number: 10-98 redraws the generated
problems until every number in the question and its worked steps is at most that; README "MathQA" has
the learning runs).
Tiny preset + character tokenizer from the supervised warm start, compact prompts, GRPO, one turn, one
answer of up to 96 tokens, 4 groups x 8 episodes (RAGEN-2: 8 x 16).
"""

from configs.base import cpu_task_config


def get_config(algorithm: str = ""):
    env_params = {"max_actions": 1, "data_path": "", "num_items": 4096, "data_seed": 0, "max_question_bytes": 0,
                  "max_steps": 4, "max_number": 99}
    return cpu_task_config("math_qa", max_turns=1, max_new_tokens=96, total_steps=30, env_params=env_params,
                           max_actions_per_turn=1, algorithm=algorithm)
