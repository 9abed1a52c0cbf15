"""MathQA demonstrations for the supervised warm start (``MathQA.demo_policy``, ``envs/demos.py``).

The reasoning is the item's worked solution: for a generated problem its steps
("3 * 4 = 12, 12 + 5 = 17."), for a file the dataset's own (MetaMathQA's response before "The answer
is: ", GSM8K's before "####" without the calculator annotations); the answer is the label.

A noisy demonstration keeps the true reasoning and the right number but writes the answer with the
question's unit ("17 stickers" for "How many stickers ..."), which RAGEN's exact-match check counts
as wrong: a slip in the answer's form that a policy can only unlearn from the reward, since the
reasoning gives nothing away. A question that names no unit (a file's, say) gets the other noisy
demonstration: it stops one step early, when the solution has steps of the form "a op b = c", and
answers that intermediate result (the steps it shows stay true); otherwise, or when that result
happens to equal the label, it answers a wrong value: the label plus one when it is an integer, else
the label with "0" appended (a different normalised string either way).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from envs.demos import TurnChoice
from envs.math_qa_data import ItemTable, normalize

_STEP = re.compile(r"^-?\d+ [-+*/] -?\d+ = (-?\d+)$")
_UNIT = re.compile(r"\bHow many ([a-z]+)\b")


def wrong_answer(label: str) -> str:
    """An answer whose normalised form differs from the label's."""
    try:
        return str(int(label.strip()) + 1)
    except ValueError:
        return label + "0"


def noisy_choice(solution: str, label: str, question: str = "") -> TurnChoice:
    """The noisy demonstration of one item: the label with the question's unit, or (no unit named) the
    early-stopping or wrong-valued one."""
    unit = _UNIT.search(question)
    if unit:
        return TurnChoice(solution, (f"{label} {unit.group(1)}",))
    steps = [part.strip() for part in solution.rstrip(".").split(",")]
    if len(steps) >= 2 and all(_STEP.match(step) for step in steps):
        shown = steps[:-1]
        answer = _STEP.match(shown[-1]).group(1)
        if normalize(answer) != normalize(label):
            return TurnChoice(", ".join(shown) + ".", (answer,))
    return TurnChoice(solution, (wrong_answer(label),))


class MathQAPolicy:
    """Demonstrations from the item table: ``table_of(params)`` gives the table of the env's settings."""

    def __init__(self, table_of: Callable[[Any], ItemTable]) -> None:
        self.table_of = table_of

    def plan_length(self, state: Any, params: Any) -> int:
        return 1

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        del k, rng
        table = self.table_of(params)
        item = int(np.asarray(state.item))
        solution, label = table.solutions[item], table.labels[item]
        if noisy:
            return noisy_choice(solution, label, table.questions[item])
        return TurnChoice(solution, (label,))
