"""Coding problems for the code_exec env: the shipped set and a loader of DeepCoder-format files.

A row of DeepCoder (``agentica-org/DeepCoder-Preview-Dataset``, as RAGEN's ``ragen/env/deepcoder/utils.py``
prepares it) has ``problem`` (or ``question`` / ``prompt``), ``tests`` (or ``ground_truth``: a list, or its
JSON string, or a ``{"inputs": [...], "outputs": [...]}`` dict of stdin/stdout pairs), ``metadata`` (a dict
or its JSON string; ``func_name`` makes "functional" tests call that function) and ``starter_code``.
Each test is ``{"input", "output", "testtype"}``: "functional" (the input is one argument per line)
or anything else, read as stdin/stdout. RAGEN's prompt is the problem, plus "\\n\\nStarter code:\\n..."
when there is starter code (its fallback of rllm's LiveCodeBench prompt).

``envs/data/code_problems.jsonl`` holds 25 small problems written for this project in the same format
(15 functional, 10 stdin/stdout, 4-5 tests each, with a reference ``solution``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "code_problems.jsonl")


@dataclasses.dataclass(frozen=True)
class CodeTest:
    """One test. functional: ``input`` is one JSON / Python literal per line (the arguments)."""

    input: Any
    output: Any
    functional: bool


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    question: str
    tests: tuple[CodeTest, ...]
    func_name: str | None = None
    starter_code: str = ""
    solution: str = ""


def _json_or_value(value: Any, default: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return default
    return default if value is None else value


def problem_from_row(row: dict[str, Any]) -> CodeProblem:
    """RAGEN's ``preprocess_fn`` + ``_sample_problem`` for one DeepCoder-format row."""
    problem = row.get("problem", row.get("question", row.get("prompt", "")))
    starter = row.get("starter_code") or ""
    question = f"{problem}\n\nStarter code:\n{starter}" if starter else str(problem)
    metadata = _json_or_value(row.get("metadata"), {})
    func_name = metadata.get("func_name") if isinstance(metadata, dict) else None
    tests = _json_or_value(row.get("tests", row.get("ground_truth")), [])
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        tests = [{"input": i, "output": o, "testtype": "stdin_stdout"} for i, o in zip(tests["inputs"], tests["outputs"])]
    if not isinstance(tests, list):
        tests = [tests] if tests else []
    parsed = tuple(
        CodeTest(t.get("input", ""), t.get("output"), t.get("testtype") == "functional" and func_name is not None)
        for t in tests if isinstance(t, dict)
    )
    return CodeProblem(question, parsed, str(func_name) if func_name is not None else None, starter,
                       str(row.get("solution", row.get("canonical_solution", "")) or ""))


def _rows(path: str) -> list[dict[str, Any]]:
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, list) else list(data.values())[0]
    raise ValueError(f"{path}: expected a .jsonl or .json file of DeepCoder-format rows (convert a parquet "
                     "shard with `datasets.load_dataset('parquet', ...)['train'].to_json(path)`)")


@functools.lru_cache(maxsize=8)
def load_code_problems(path: str = DEFAULT_PATH) -> tuple[CodeProblem, ...]:
    """All problems of a DeepCoder-format file (cached: every episode's env reads the same tuple)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"code problems file {path!r} does not exist")
    problems = tuple(problem_from_row(row) for row in _rows(path))
    if not problems:
        raise ValueError(f"{path} holds no problems")
    return problems
