"""Code execution (RAGEN-2's DeepCoder task, ``ragen/env/deepcoder/env.py``) as a host env.

One turn, one action: the answer is a Python program (a fenced block inside the answer is accepted,
``envs/code_grading.py``; RAGEN's parse splits every answer on "||" and keeps the first piece, so a
program must not contain "||"), run against the problem's tests in a bubblewrap sandbox
(``envs/sandbox.py``), 3 s of wall clock per test. Turn reward = passed tests / total tests, success =
all passed, the episode ends after the graded answer (RAGEN ``max_steps`` 1). A response that does
not parse gives no action: reward 0, the rollout's format penalty, the episode goes on (RAGEN: the env
is not stepped), which with RAGEN's ``max_turn`` 1 ends it.

Problem of seed s: ``problems[s % len(problems)]`` (RAGEN draws a random index under the seed; the
modulo, as its SearchQA does, makes every problem reachable in order). Data: the shipped
``envs/data/code_problems.jsonl`` or any DeepCoder-format file (``data_path``, ``envs/code_data.py``).

Without a working ``bwrap`` the constructor raises ``SandboxUnavailable`` naming the install command:
untrusted code is never run unsandboxed.
"""

from __future__ import annotations

from typing import Any

from envs.code_data import DEFAULT_PATH, CodeProblem, load_code_problems
from envs.code_grading import Grade, grade
from envs.host import HostStep
from envs.host_text import HostPrompt, parse_answer
from envs.sandbox import Sandbox, SandboxLimits

# RAGEN config/envs.yaml, DeepCoder: env_instruction and max_tokens.
INSTRUCTION = ("You are solving a coding task. Provide a complete Python function solution only. "
               "Format: <answer>...</answer>")
MAX_RESPONSE_TOKENS = 8000


class CodeExecEnv:
    """One episode of the code task (``envs.host.HostEnv``).

    data_path: a DeepCoder-format .jsonl / .json file (default: the shipped problems);
    prompt_style: "ragen" | "compact"; max_response_tokens: shown in the turn text;
    limits: ``SandboxLimits`` fields to change (e.g. {"wall_seconds": 5.0});
    python / bwrap: the sandbox's interpreter and bwrap binary (defaults: the system's);
    test_workers: tests of one answer run at once (1: one after the other).
    """

    def __init__(self, data_path: str = "", prompt_style: str = "ragen",
                 max_response_tokens: int = MAX_RESPONSE_TOKENS, limits: dict[str, Any] | None = None,
                 python: str = "", bwrap: str = "", test_workers: int = 1) -> None:
        self.problems = load_code_problems(data_path or DEFAULT_PATH)
        self.sandbox = Sandbox(SandboxLimits(**(limits or {})), python or None, bwrap or None)
        self.prompt = HostPrompt(INSTRUCTION, prompt_style, max_response_tokens)
        self.test_workers = test_workers
        self.problem: CodeProblem | None = None
        self.turn = 0
        self.last_grade: Grade | None = None

    def system_text(self) -> str:
        return self.prompt.system_text()

    def reset(self, seed: int) -> str:
        self.problem = self.problems[seed % len(self.problems)]
        self.turn, self.last_grade = 1, None
        return self.prompt.turn_text(1, self.problem.question, actions_left=1)

    def step(self, response_text: str) -> HostStep:
        assert self.problem is not None, "reset before step"
        _, pieces = parse_answer(response_text, max_actions=1)
        self.turn += 1
        if not pieces:
            next_text = self.prompt.reward_text(0.0) + self.prompt.turn_text(
                self.turn, self.problem.question, actions_left=1, warning=True)
            return HostStep(reward=0.0, done=False, success=False, format_ok=False, n_valid=0, n_executed=0,
                            next_user_text=next_text)
        self.last_grade = grade(self.sandbox, self.problem, pieces[0], self.test_workers)
        reward = self.last_grade.reward
        observation = "Correct!" if self.last_grade.success else "Incorrect."
        next_text = self.prompt.reward_text(reward) + self.prompt.turn_text(self.turn, observation, actions_left=0)
        return HostStep(reward=reward, done=True, success=self.last_grade.success, format_ok=True, n_valid=1,
                        n_executed=1, next_user_text=next_text)
