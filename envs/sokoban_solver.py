"""Plain-Python breadth-first Sokoban solver (host side; for tests and solver demonstrations).

Independent of the JAX code on purpose: it re-implements gym_sokoban's push rules over
(player cell, frozenset of box cells) states, so the tests can check the on-device generator and
dynamics against it. Actions are RAGEN's ids (the env's action ids): 1 Up, 2 Down, 3 Left, 4 Right.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

_DELTAS = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}  # Up, Down, Left, Right
_WALL, _TARGET = 0, 2

Cell = tuple[int, int]


def push_step(
    fixed: np.ndarray, boxes: frozenset[Cell], player: Cell, action: int
) -> tuple[frozenset[Cell], Cell]:
    """gym_sokoban's move/push for one action (1..4): returns (boxes, player) after it.

    Move into a free cell; push a box when the cell beyond it is floor without a box; otherwise
    stay. Cells outside the grid count as walls.
    """
    rows, cols = fixed.shape
    dr, dc = _DELTAS[action]

    def free(cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < rows and 0 <= c < cols and fixed[r, c] != _WALL

    step = (player[0] + dr, player[1] + dc)
    if not free(step):
        return boxes, player
    if step not in boxes:
        return boxes, step
    beyond = (step[0] + dr, step[1] + dc)
    if not free(beyond) or beyond in boxes:
        return boxes, player
    return (boxes - {step}) | {beyond}, step


def solve(
    fixed: np.ndarray, boxes: np.ndarray, player: Sequence[int], max_depth: int = 100
) -> list[int] | None:
    """Shortest action list that puts every box on a target, or None if none within max_depth.

    fixed: int[R, C] (0 wall, 1 floor, 2 target); boxes: bool[R, C]; player: (row, col).
    Returns RAGEN action ids (1 Up, 2 Down, 3 Left, 4 Right); ties between shortest solutions go
    to the lowest action id first (BFS expansion order).
    """
    fixed = np.asarray(fixed)
    targets = frozenset(map(tuple, np.argwhere(fixed == _TARGET).tolist()))
    start_boxes = frozenset(map(tuple, np.argwhere(np.asarray(boxes)).tolist()))
    start = (start_boxes, (int(player[0]), int(player[1])))
    if start_boxes <= targets:
        return []
    parents: dict = {start: None}
    frontier = deque([(start, 0)])
    while frontier:
        state, depth = frontier.popleft()
        if depth >= max_depth:
            continue
        for action in (1, 2, 3, 4):
            nxt = push_step(fixed, state[0], state[1], action)
            if nxt in parents:
                continue
            parents[nxt] = (state, action)
            if nxt[0] <= targets:
                return _backtrack(parents, nxt)
            frontier.append((nxt, depth + 1))
    return None


def _backtrack(parents: dict, state) -> list[int]:
    actions = []
    while parents[state] is not None:
        state, action = parents[state]
        actions.append(action)
    return actions[::-1]
