"""Host-side solvers (plain Python/numpy) used by tests and by the supervised warm start.

``frozen_lake_bfs(grid, start, goal)``: the shortest action sequence (RAGEN ids 1 Left, 2 Down,
3 Right, 4 Up) from start to goal through non-hole cells on a deterministic map, or None when the
goal cannot be reached. ``grid`` is the tile array of ``envs.frozen_lake`` (int[size, size], 1 = hole)
or gymnasium ``desc`` rows ("SFFH", ...); ``start``/``goal`` are (row, col). Ties between equally
short paths are broken by the action order Left, Down, Right, Up (first found by BFS).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

# RAGEN action id -> (d_row, d_col).
FROZEN_LAKE_MOVES = {1: (0, -1), 2: (1, 0), 3: (0, 1), 4: (-1, 0)}


def _holes(grid: np.ndarray | Sequence[str]) -> np.ndarray:
    if len(grid) and isinstance(grid[0], str):
        return np.array([[ch == "H" for ch in row] for row in grid], bool)
    return np.asarray(grid) == 1


def frozen_lake_bfs(
    grid: np.ndarray | Sequence[str], start: tuple[int, int], goal: tuple[int, int]
) -> list[int] | None:
    holes = _holes(grid)
    rows, cols = holes.shape
    start, goal = (int(start[0]), int(start[1])), (int(goal[0]), int(goal[1]))
    parent: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            break
        for action, (dr, dc) in FROZEN_LAKE_MOVES.items():
            # Moving into the border leaves the player in place; such moves never shorten a path.
            nxt = (min(max(cell[0] + dr, 0), rows - 1), min(max(cell[1] + dc, 0), cols - 1))
            if nxt in parent or holes[nxt]:
                continue
            parent[nxt] = (cell, action)
            queue.append(nxt)
    if goal not in parent:
        return None
    actions: list[int] = []
    cell = goal
    while parent[cell] is not None:
        cell, action = parent[cell]
        actions.append(action)
    return actions[::-1]
