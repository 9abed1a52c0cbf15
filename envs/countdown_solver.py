"""Countdown search solver (plain Python) and solver demonstrations for the supervised warm start.

A Countdown answer must use every given number exactly once (RAGEN checks the multiset of numbers in
the equation), so the solver searches equations over *all* numbers:

- ``+-`` search: every sign pattern s in {+1, -1}^n with sum(s_i n_i) = target (RAGEN's
  ``has_solution`` filter, which defines the paper's data), written positives first
  (``44 + 35 - 19``), so no unary minus is needed when the target is positive.
- full search: repeatedly pick an ordered pair of the remaining values and replace it by a + b,
  a - b, a * b or a / b (exact ``Fraction`` arithmetic, b != 0), until one value is left; this
  enumerates every binary expression tree over the numbers. 4 numbers: at most 6*6 * 3*6 * 1*6 = 3,888
  leaves, a few milliseconds.

Equations are written with the fewest parentheses that keep Python's evaluation order, so
``eval(equation) == target`` (within RAGEN's 1e-5; exact for these integers and fractions).

``CountdownPolicy`` is the env's demonstration policy (``Countdown.demo_policy``, ``envs.demos``).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

import numpy as np

from envs.demos import TurnChoice

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3
_APPLY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


@dataclass(frozen=True)
class Step:
    """One arithmetic step ``left op right = result`` of a solution, in the order a person computes it."""

    left: Fraction
    op: str
    right: Fraction
    result: Fraction

    def text(self) -> str:
        return f"{format_value(self.left)} {self.op} {format_value(self.right)} = {format_value(self.result)}"


@dataclass(frozen=True)
class Solution:
    """equation: a Python-evaluable string using every number once; steps: how it is computed."""

    equation: str
    steps: tuple[Step, ...]


def format_value(value: Fraction) -> str:
    """Integers as "12", other fractions as "7/3"."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _check_task(numbers: Sequence[int], target: int) -> list[int]:
    nums = [int(n) for n in numbers]
    if not nums:
        raise ValueError("Countdown needs at least one number; got an empty list.")
    if any(n < 0 for n in nums):
        raise ValueError(f"Countdown numbers must be non-negative integers, got {nums}.")
    if int(target) != target:
        raise ValueError(f"Countdown targets are integers, got {target!r}.")
    return nums


def solve_add_sub(numbers: Sequence[int], target: int) -> Solution | None:
    """An equation ``a + b - c ...`` over all numbers equal to target, or None (RAGEN's ``has_solution``)."""
    nums = _check_task(numbers, target)
    for signs in itertools.product((1, -1), repeat=len(nums)):
        if sum(s * n for s, n in zip(signs, nums)) != target:
            continue
        # Positives first keeps the leading term non-negative when target >= 0.
        order = sorted(range(len(nums)), key=lambda i: signs[i] < 0)
        terms = [(signs[i], nums[i]) for i in order]
        first_sign, first = terms[0]
        equation = f"{'-' if first_sign < 0 else ''}{first}"
        total = Fraction(first_sign * first)
        steps = []
        for sign, n in terms[1:]:
            op = "+" if sign > 0 else "-"
            result = total + sign * n
            steps.append(Step(total, op, Fraction(n), result))
            equation += f" {op} {n}"
            total = result
        return Solution(equation, tuple(steps))
    return None


def _wrap(expr: str, need: bool) -> str:
    return f"({expr})" if need else expr


def _combine(a, b, op: str):
    """(value, expr, precedence, steps) of a op b, or None for division by zero."""
    (va, ea, pa, sa), (vb, eb, pb, sb) = a, b
    if op == "/" and vb == 0:
        return None
    value = _APPLY[op](va, vb)
    prec = _PRECEDENCE[op]
    left = _wrap(ea, pa < prec)
    # Same precedence on the right changes the value for - and / (a - (b - c) != a - b - c).
    right = _wrap(eb, pb < prec or (pb == prec and op in "-/"))
    return value, f"{left} {op} {right}", prec, sa + sb + (Step(va, op, vb, value),)


def _search(items: list, target: Fraction):
    if len(items) == 1:
        return items[0] if items[0][0] == target else None
    for i, j in itertools.permutations(range(len(items)), 2):
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        for op in ("+", "-", "*", "/"):
            if op in "+*" and i > j:
                continue  # commutative: the (j, i) order already covered it
            combined = _combine(items[i], items[j], op)
            if combined is None:
                continue
            found = _search(rest + [combined], target)
            if found is not None:
                return found
    return None


def solve_any(numbers: Sequence[int], target: int) -> Solution | None:
    """An equation with + - * / and parentheses over all numbers equal to target, or None."""
    nums = _check_task(numbers, target)
    leaves = [(Fraction(n), str(n), _ATOM, ()) for n in nums]
    found = _search(leaves, Fraction(int(target)))
    return None if found is None else Solution(found[1], found[3])


def solve(numbers: Sequence[int], target: int, only_add_sub: bool = False) -> str | None:
    """An equation string using every number once that evaluates to target, or None.

    The +- search runs first (its equations are the simplest); ``only_add_sub`` stops there.
    """
    solution = solve_add_sub(numbers, target)
    if solution is None and not only_add_sub:
        solution = solve_any(numbers, target)
    return None if solution is None else solution.equation


def demonstration(
    numbers: Sequence[int], target: int, rng: random.Random | None = None, only_add_sub: bool = False
) -> tuple[str, str] | None:
    """(reasoning, answer) for a solvable task, in the style of RAGEN's Countdown instruction example:

    "To find an equation using [3, 5, 2] to get 4. Let's check 2 + 5 = 7, 7 - 3 = 4. So the answer is
    2 + 5 - 3 = 4."

    The text depends on the input (the numbers, the target, the solver's steps). With ``rng``, the
    reasoning first tries a random +- combination that misses the target (when one exists), so
    demonstrations vary in length and contain a checked dead end. Returns None when unsolvable.
    """
    solution = solve_add_sub(numbers, target)
    if solution is None and not only_add_sub:
        solution = solve_any(numbers, target)
    if solution is None:
        return None
    nums = [int(n) for n in numbers]
    parts = [f"To find an equation using {nums} to get {int(target)}."]
    if rng is not None and len(nums) > 1:
        order = nums[:]
        rng.shuffle(order)
        ops = [rng.choice("+-") for _ in order[1:]]
        total = Fraction(order[0])
        tried = []
        for op, n in zip(ops, order[1:]):
            result = total + n if op == "+" else total - n
            tried.append(Step(total, op, Fraction(n), result).text())
            total = result
        if total != target:
            parts.append(f"Try {', '.join(tried)}, not {int(target)}.")
    parts.append(f"Let's check {', '.join(step.text() for step in solution.steps)}.")
    parts.append(f"So the answer is {solution.equation} = {int(target)}.")
    return " ".join(parts), solution.equation


class CountdownPolicy:
    """Demonstrations: the solver above (+- first, then + - * /). Reasoning = the numbers, the target
    and the solver's steps, e.g. "[3, 5, 2] to 4: 5 + 2 = 7, 7 - 3 = 4." with the answer "5 + 2 - 3". A
    noisy answer is a random +- combination of all numbers that misses the target (computed truthfully;
    it scores 0.1)."""

    def plan_length(self, state: Any, params: Any) -> int:
        return 1

    @staticmethod
    def _task(state: Any) -> tuple[list[int], int]:
        return [int(x) for x in np.asarray(state.numbers)[: int(state.n_numbers)]], int(state.target)

    @staticmethod
    def _random_miss(nums: list[int], target: int, rng: np.random.Generator) -> Solution | None:
        for _ in range(20):
            order = [nums[i] for i in rng.permutation(len(nums))]
            total, steps, equation = Fraction(order[0]), [], str(order[0])
            for n in order[1:]:
                op = "+" if rng.random() < 0.5 else "-"
                result = total + n if op == "+" else total - n
                steps.append(Step(total, op, Fraction(n), result))
                equation += f" {op} {n}"
                total = result
            if total != target:
                return Solution(equation, tuple(steps))
        return None

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        nums, target = self._task(state)
        solution = self._random_miss(nums, target, rng) if noisy else None
        if solution is None:
            solution = solve_add_sub(nums, target)
        if solution is None and not params.only_add_sub_solvable:
            solution = solve_any(nums, target)
        if solution is None:
            raise ValueError(f"Countdown task {nums} -> {target} has no solution; the demo cannot be written")
        steps = ", ".join(step.text() for step in solution.steps) or solution.equation
        return TurnChoice(f"{nums} to {target}: {steps}.", (solution.equation,))
