"""The demonstration contract: what an env's solver gives the supervised warm start.

An env that can be demonstrated returns a ``DemoPolicy`` from ``TextEnv.demo_policy()``; the
library's demonstration writer (``ragen_jax.sft.demos``) calls only these two methods, turn by turn,
on one host-side (numpy) state, and writes ``"{reasoning}</think><answer>{A1} || {A2}</answer>"``.
The reasoning states the facts the actions depend on, taken from the state, so a noisy turn is still
described truthfully. Plain Python and numpy only: the solvers run on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TurnChoice:
    """One demonstrated turn: the reasoning text and the answer pieces (action names / an equation)."""

    reasoning: str
    actions: tuple[str, ...]


class DemoPolicy(Protocol):
    """An env's solver for demonstrations. ``state`` is one host-side (numpy) env state."""

    def plan_length(self, state: Any, params: Any) -> int:
        """Actions the solver's plan from ``state`` takes (sets which turn a noisy episode perturbs)."""

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        """Up to k actions from ``state``; noisy: the first one is a random non-solver action."""


def coord(cell: Sequence[int]) -> str:
    """A grid cell as the observations write it: "(r, c)"."""
    return f"({int(cell[0])}, {int(cell[1])})"


def pick(rng: np.random.Generator, preferred: list[int], fallback: list[int]) -> int:
    """A uniform draw from ``preferred``, or from ``fallback`` when nothing is preferred (one rng call)."""
    options = preferred or fallback
    return int(options[int(rng.integers(len(options)))])
