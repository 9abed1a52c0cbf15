"""Grade a program against a problem's tests, each test in its own sandbox run (``envs/sandbox.py``).

Semantics of RAGEN's DeepCoder harness (``ragen/env/deepcoder/utils.py``, ``run_deepcoder_sandbox``):
  - the program is the answer text with surrounding newlines stripped; starter code is prepended unless
    the program defines ``class Solution`` itself, and a bare ``def`` answer is indented into the
    starter's ``class Solution``;
  - functional test: the arguments are the input's non-empty lines, each one literal (a list input is
    the argument list); the call's ``str(result)`` must equal ``str(expected)``;
  - stdin/stdout test: the program must exit normally and its stripped stdout equal the stripped
    expected output;
  - reward = passed / total, success = all passed (no tests: 0, not a success).
Where this differs from RAGEN, on purpose:
  - an answer holding a fenced code block (three backticks, optionally "python") is graded on the first
    such block: RAGEN passes the fence to Python, a syntax error, and models often fence their code;
  - argument lines are read as JSON, then as Python literals (``ast.literal_eval``), never ``eval``; a
    functional result also passes when it equals the expected output read as JSON (LiveCodeBench writes
    ``true`` / ``null``, which ``str`` of a Python value never equals);
  - each test runs in its own sandbox with its own 3 s wall clock (RAGEN: one process for all tests,
    3 s in total), and the expected outputs stay on the host, so a program cannot read them.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import functools
import json
import re
from typing import Any

from envs.code_data import CodeProblem, CodeTest
from envs.sandbox import RunResult, Sandbox

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
DETAIL_CHARS = 300


def extract_program(answer: str) -> str:
    """The first fenced block of ``answer`` when there is one, else the answer itself."""
    match = FENCE.search(answer)
    return match.group(1) if match else answer


def assemble_program(code: str, starter_code: str = "") -> str:
    """RAGEN's combination of the answer with the problem's starter code."""
    header, body = (starter_code or "").strip("\n"), (code or "").strip("\n")
    if "class Solution" in body:
        header = ""
    elif "class Solution" in header and body.startswith("def "):
        body = "\n".join(("    " + line) if line.strip() else "" for line in body.splitlines())
    return f"{header}\n\n{body}" if header and body else header or body


def _literal(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ast.literal_eval(text)


def call_arguments(raw: Any) -> list[Any]:
    """The argument list of a functional test's input."""
    if isinstance(raw, (list, tuple)):
        return list(raw)
    if not isinstance(raw, str):
        return [raw]
    try:
        return [_literal(line) for line in raw.strip().splitlines() if line.strip()]
    except (ValueError, SyntaxError, RecursionError):
        return [raw]


def _expected_json(expected: Any) -> tuple[bool, Any]:
    if not isinstance(expected, str):
        return True, expected
    try:
        return True, json.loads(expected)
    except ValueError:
        return False, None


def check_functional(run: RunResult, expected: Any) -> tuple[bool, str]:
    if not run.ok:
        return False, _failure(run)
    try:
        report = json.loads(run.stdout.strip().splitlines()[-1])
        got = str(report["str"])
    except (ValueError, IndexError, KeyError, TypeError):
        return False, "no result reported"
    if got == str(expected):
        return True, ""
    decodable, value = _expected_json(expected)
    if decodable and "json" in report and report["json"] == value:
        return True, ""
    return False, f"got {got} expected {expected}"


def check_stdio(run: RunResult, expected: Any) -> tuple[bool, str]:
    if not run.ok:
        return False, _failure(run)
    got, want = run.stdout.strip(), str(expected).strip()
    return (True, "") if got == want else (False, f"got {got} expected {want}")


def _failure(run: RunResult) -> str:
    if run.timed_out:
        return "time limit exceeded"
    if run.output_exceeded:
        return "output limit exceeded"
    lines = run.stderr.strip().splitlines()
    return f"runtime error: {lines[-1] if lines else f'exit status {run.returncode}'}"


@dataclasses.dataclass(frozen=True)
class Grade:
    passed: int
    total: int
    detail: str

    @property
    def reward(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def success(self) -> bool:
        return self.total > 0 and self.passed == self.total


def run_test(sandbox: Sandbox, program: str, test: CodeTest, func_name: str | None) -> tuple[bool, str]:
    if test.functional and func_name:
        run = sandbox.run("call", program, "", (func_name, repr(call_arguments(test.input))))
        return check_functional(run, test.output)
    return check_stdio(sandbox.run("stdio", program, str(test.input if test.input is not None else "")), test.output)


def grade(sandbox: Sandbox, problem: CodeProblem, answer: str, workers: int = 1) -> Grade:
    """Run every test of ``problem`` on the program in ``answer``; detail: RAGEN's summary line.
    workers > 1 runs that many tests at once (each is its own sandbox; the result is the same)."""
    if not problem.tests:
        return Grade(0, 0, "No tests available.")
    program = assemble_program(extract_program(answer), problem.starter_code)
    run = functools.partial(run_test, sandbox, program, func_name=problem.func_name)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(problem.tests))) as pool:
            results = list(pool.map(run, problem.tests))
    else:
        results = [run(test) for test in problem.tests]
    passed, first_failure = 0, ""
    for index, (ok, why) in enumerate(results):
        passed += ok
        if not ok and not first_failure:
            first_failure = f" Test {index}: {why}"[:DETAIL_CHARS]
    total = len(problem.tests)
    detail = "All tests passed." if passed == total else f"Passed {passed}/{total} tests.{first_failure}"
    return Grade(passed, total, detail)
