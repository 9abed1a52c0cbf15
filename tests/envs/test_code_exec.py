"""code_exec: RAGEN's DeepCoder semantics (reward = passed / total, success = all pass), the answer parse,
the DeepCoder-format loader and the shipped problems. Expected values are written by hand."""

from __future__ import annotations

import json
import pickle

import pytest

from envs.code_data import DEFAULT_PATH, load_code_problems, problem_from_row
from envs.code_exec import CodeExecEnv
from envs.code_grading import assemble_program, call_arguments, extract_program, grade
from envs.host import HostEnv
from envs.registry import HOST_REGISTRY, make_host
from envs.sandbox import Sandbox, SandboxUnavailable

# A functional problem in LiveCodeBench's format: one JSON argument per line, JSON outputs.
CLAMP_ROW = {
    "problem": "Write clamp(x, lo, hi).",
    "tests": json.dumps([
        {"input": "5\n0\n10", "output": "5", "testtype": "functional"},
        {"input": "-3\n0\n10", "output": "0", "testtype": "functional"},
        {"input": "12\n0\n10", "output": "10", "testtype": "functional"},
        {"input": "0\n0\n10", "output": "0", "testtype": "functional"},
        {"input": "11\n0\n10", "output": "10", "testtype": "functional"},
    ]),
    "metadata": json.dumps({"func_name": "clamp"}),
    "starter_code": "",
}
RIGHT = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"
LOW_ONLY = "def clamp(x, lo, hi):\n    return max(lo, x)\n"  # wrong exactly when x > hi: tests 3 and 5 fail


@pytest.fixture(scope="module")
def box() -> Sandbox:
    try:
        return Sandbox()
    except SandboxUnavailable as error:
        pytest.skip(f"bubblewrap cannot run on this machine: {error}")


@pytest.fixture(scope="module")
def env(box) -> CodeExecEnv:
    return CodeExecEnv()


def test_loader_reads_deepcoder_rows():
    clamp = problem_from_row(CLAMP_ROW)
    assert clamp.func_name == "clamp" and len(clamp.tests) == 5 and all(t.functional for t in clamp.tests)
    # primeintellect / taco rows: an {"inputs", "outputs"} dict of stdin/stdout pairs, metadata without func_name.
    taco = problem_from_row({"question": "Sum.", "tests": {"inputs": ["1 2\n"], "outputs": ["3\n"]}, "metadata": "{}",
                             "starter_code": "class Solution:\n    pass"})
    assert taco.tests[0].functional is False and taco.tests[0].output == "3\n"
    assert taco.question == "Sum.\n\nStarter code:\nclass Solution:\n    pass"
    # A functional test without a func_name is read as stdin/stdout (RAGEN).
    untyped = problem_from_row({"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "functional"}]})
    assert not untyped.tests[0].functional


def test_answer_program_extraction():
    assert extract_program("print(1)") == "print(1)"
    assert extract_program("Here:\n```python\nprint(2)\n```\nand ```py\nprint(3)\n```") == "print(2)\n"
    assert extract_program("```\nprint(4)\n```") == "print(4)\n"
    starter = "class Solution:\n    def f(self, x):\n        pass"
    assert assemble_program("def f(self, x):\n    return x", starter) == (
        starter + "\n\n    def f(self, x):\n        return x")
    own_class = "class Solution:\n    def f(self, x): return x"
    assert assemble_program(own_class, starter) == own_class
    assert call_arguments("[1, 2]\n\"a\"\ntrue\nNone") == [[1, 2], "a", True, None]
    assert call_arguments([1, 2]) == [1, 2]
    assert call_arguments("not a literal ((") == ["not a literal (("]


def test_correct_wrong_and_partial(box):
    clamp = problem_from_row(CLAMP_ROW)
    right = grade(box, clamp, RIGHT)
    assert (right.passed, right.total, right.reward, right.success) == (5, 5, 1.0, True)
    partial = grade(box, clamp, LOW_ONLY)
    assert (partial.passed, partial.reward, partial.success) == (3, 3 / 5, False)
    assert partial.detail.startswith("Passed 3/5 tests. Test 2: got 12 expected 10")
    assert grade(box, clamp, LOW_ONLY, workers=3) == partial  # tests run at once: the same grade
    wrong = grade(box, clamp, "def clamp(x, lo, hi):\n    return None\n")
    assert (wrong.passed, wrong.reward, wrong.success) == (0, 0.0, False)
    assert grade(box, clamp, "def clamp(x, lo, hi) syntax error").reward == 0.0
    assert grade(box, clamp, "def other(x, lo, hi):\n    return x\n").reward == 0.0


def test_stdio_semantics(box):
    problem = problem_from_row({"problem": "Double.", "tests": [
        {"input": "2\n", "output": "4\n", "testtype": "stdin_stdout"},
        {"input": "5\n", "output": "10", "testtype": "stdin_stdout"},
    ]})
    assert grade(box, problem, "print(2 * int(input()))").reward == 1.0  # outputs compared stripped
    assert grade(box, problem, "n = int(input())\nprint(4 if n == 2 else 0)").reward == 0.5
    # Right output, then a crash: a runtime error fails the test (RAGEN).
    assert grade(box, problem, "print(2 * int(input()))\nraise ValueError").reward == 0.0


def test_episode_text_and_rewards(env):
    assert isinstance(env, HostEnv) and HOST_REGISTRY["code_exec"] is CodeExecEnv
    problems = load_code_problems(DEFAULT_PATH)
    seed = next(i for i, p in enumerate(problems) if p.func_name == "add_digits")
    first = env.reset(seed + 2 * len(problems))  # seed modulo the number of problems
    assert first.startswith("\nTurn 1:\nState:\nWrite a function add_digits(n)")
    assert "You have 1 actions left." in first and "Max response length: 8000 words" in first
    assert env.system_text() == ("You're a helpful assistant. You are solving a coding task. Provide a complete "
                                 "Python function solution only. Format: <answer>...</answer>")
    solution = problems[seed].solution
    step = env.step(f"I sum the digits.</think><answer>\n```python\n{solution}```\n</answer>")
    assert (step.reward, step.done, step.success, step.format_ok, step.n_valid) == (1.0, True, True, True, 1)
    assert step.next_user_text.startswith("Reward:\n1.0\n\nTurn 2:\nState:\nCorrect!\n")
    env.reset(seed)
    half = "def add_digits(n):\n    return n if n < 10 else -1\n"  # right on 0 and 7 only: 2 of 5
    step = env.step(f"t</think><answer>{half}</answer>")
    assert (step.reward, step.success, step.done) == (2 / 5, False, True)
    env.reset(seed)
    step = env.step("no answer tags here")
    assert (step.reward, step.done, step.format_ok, step.n_valid, step.n_executed) == (0.0, False, False, 0, 0)
    assert "No valid action provided previously." in step.next_user_text


def test_factory_pickles(box):
    factory = pickle.loads(pickle.dumps(make_host("code_exec", prompt_style="compact", limits={"wall_seconds": 2.0})))
    env = factory()
    assert env.sandbox.limits.wall_seconds == 2.0 and env.reset(0).startswith("\nTurn 1:\n")


@pytest.mark.slow
def test_every_shipped_problem_is_solved_by_its_reference(box):
    problems = load_code_problems(DEFAULT_PATH)
    assert len(problems) == 25 and sum(p.func_name is not None for p in problems) == 15
    for problem in problems:
        assert 4 <= len(problem.tests) <= 5
        result = grade(box, problem, problem.solution)
        assert result.success, (problem.question, result.detail)
