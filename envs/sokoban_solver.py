"""Plain-Python breadth-first Sokoban solver (host side; for tests and solver demonstrations).

Independent of the JAX code on purpose: it re-implements gym_sokoban's push rules over
(player cell, frozenset of box cells) states, so the tests can check the on-device generator and
dynamics against it. Actions are RAGEN's ids (the env's action ids): 1 Up, 2 Down, 3 Left, 4 Right.
``SokobanPolicy`` is the env's demonstration policy (``SokobanEnv.demo_policy``, ``envs.demos``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from envs.demos import TurnChoice, coord, pick

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


class SokobanPolicy:
    """Demonstrations: the BFS shortest solution (``solve``). Reasoning, e.g.

    "P (4, 3) X (3, 3) O (1, 3); X goes Up. Up pushes X to (2, 3), Up pushes X to (1, 3)."
    = player, box and target cells, the direction of the solver's next push (why the moves go that
    way), then each action as a move ("Left to (r, c)"), a push ("Up pushes X to (r, c)") or "Up is
    blocked" (a wall or a box that cannot move). A noisy
    first action prefers moves that change the board and keep the level solvable.
    names: the env's action_lookup (id -> name)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    @staticmethod
    def _parts(state) -> tuple[np.ndarray, frozenset, Cell]:
        boxes = frozenset(tuple(int(v) for v in rc) for rc in np.argwhere(np.asarray(state.boxes)))
        return np.asarray(state.fixed), boxes, tuple(int(v) for v in np.asarray(state.player))

    @staticmethod
    def _solve(fixed: np.ndarray, boxes: frozenset, player: Cell) -> list[int] | None:
        mask = np.zeros(fixed.shape, bool)
        for rc in boxes:
            mask[rc] = True
        return solve(fixed, mask, player)

    def plan_length(self, state, params) -> int:
        fixed, boxes, player = self._parts(state)
        plan = self._solve(fixed, boxes, player)
        return len(plan) if plan else 0

    def turn(self, state, params, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        fixed, boxes, player = self._parts(state)
        targets = frozenset(tuple(int(v) for v in rc) for rc in np.argwhere(fixed == _TARGET))
        plan = self._solve(fixed, boxes, player) or []
        why = ""
        b, p = boxes, player
        for action in plan:  # the direction of the solver's next push
            nb, p = push_step(fixed, b, p, action)
            if nb != b:
                why = f"; X goes {self.names[action]}"
                break
            b = nb
        trace: list[str] = []  # one phrase per action
        actions: list[int] = []
        b, p = boxes, player

        def act(action: int) -> None:
            nonlocal b, p
            nb, np_ = push_step(fixed, b, p, action)
            name = self.names[action]
            if nb != b:
                trace.append(f"{name} pushes X to {coord(sorted(nb - b)[0])}")
            elif np_ == p:
                trace.append(f"{name} is blocked")
            else:
                trace.append(f"{name} to {coord(np_)}")
            actions.append(action)
            b, p = nb, np_

        if noisy:
            options = [a for a in sorted(self.names) if not plan or a != plan[0]]
            good = [a for a in options if push_step(fixed, b, p, a) != (b, p)
                    and self._solve(fixed, *push_step(fixed, b, p, a)) is not None]
            act(pick(rng, good, options))
            plan = [] if b <= targets else self._solve(fixed, b, p) or []
        for action in plan:
            if len(actions) >= k or b <= targets:
                break
            act(action)
        if not actions:  # unsolvable from here (a box is stuck): any action, described truthfully
            act(pick(rng, [], sorted(self.names)))
        box_text = ", ".join(coord(c) for c in sorted(boxes))
        target_text = ", ".join(coord(c) for c in sorted(targets))
        reasoning = f"P {coord(player)} X {box_text} O {target_text}{why}. {', '.join(trace)}."
        return TurnChoice(reasoning, tuple(self.names[a] for a in actions))
