"""FrozenLake as RAGEN-2's ``CoordFrozenLake``: random solvable maps, gymnasium transitions, grid_coord text.

Map generation (``reset_env``, inside jit): every cell is frozen with probability ``p_frozen`` (0.9),
otherwise a hole; start and goal are uniform random cells; the map is redrawn (``lax.while_loop``)
until start != goal, a path of non-hole cells leads from start to goal, AND the shortest such path
is at most ``max_actions`` (10) moves, so every map is solvable within the action budget. (RAGEN
only checks that a path exists; on 4x4 maps a shortest path above 10 moves is very rare.)

Transitions follow gymnasium's ``FrozenLakeEnv`` (>= 1.0): the intended move (0 Left, 1 Down, 2 Right,
3 Up in gymnasium; RAGEN's action ids 1 Left, 2 Down, 3 Right, 4 Up map to these) succeeds with
probability ``success_rate``; otherwise the move is (a-1)%4 or (a+1)%4 (the two perpendicular ones),
each with (1 - success_rate) / 2. Moves into the border leave the player in place. Reward +1 on
reaching the goal; the episode terminates on the goal or a hole. ``success_rate = 1.0`` (the default
here and RAGEN-2's main table; RAGEN's config default is 0.8) is deterministic.

Tiles: 0 frozen "F", 1 hole "H", 2 start "S", 3 goal "G" (int32[size, size]); ``to_desc`` gives
gymnasium's ``desc`` strings. Observation text = RAGEN's ``grid_coord`` format (``render_state_text``).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.base import TextEnv, TextEnvParams, TextEnvState, checked_action, select
from envs.demos import TurnChoice, coord, pick
from envs.solvers import FROZEN_LAKE_MOVES, frozen_lake_bfs
from envs.text import Dynamic, Static, TokenFragments

FROZEN, HOLE, START, GOAL = 0, 1, 2, 3
TILE_LETTERS = "FHSG"
# Grid symbols (RAGEN grid_lookup): index 0..5.
SYMBOLS = ("P", "_", "O", "G", "X", "\u221a")
LEGEND = (
    ("P", "player"), ("_", "empty"), ("O", "hole"), ("G", "goal"),
    ("X", "player in hole"), ("\u221a", "player on goal"),
)
PLAYER_LABELS = ("Player", "Player on goal", "Player in hole")
# compact style: "P (r, c) G (r, c) O (r, c), (r, c)" (the coordinates without the grid, which repeats them)
COMPACT_PLAYER_LABELS = ("P", "P on G", "P in O")

RAGEN_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. The observation includes both a symbol grid and zero-indexed "
    "coordinates for the start, goal, player, and any holes.\n"
    # RAGEN's text says (5, 5) although the map is 4x4; kept verbatim for fidelity.
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5).\n"
    "Beware that the ice is slippery, so the agent might slide and end up in an unintended tile.\n"
    "Respond with a sequence of actions such as <answer>Left || Up || Up</answer>.\n"
)


@struct.dataclass
class FrozenLakeParams(TextEnvParams):
    size: int = struct.field(pytree_node=False, default=4)
    p_frozen: float = 0.9
    success_rate: float = 1.0
    max_actions: int = 10


@struct.dataclass
class FrozenLakeState(TextEnvState):
    grid: jax.Array  # int32[size, size] tile codes
    pos: jax.Array  # int32[] flat index row * size + col (gymnasium's state s)


def neighbor_table(size: int) -> np.ndarray:
    """int32[size*size, 4]: the cell reached by gymnasium action 0..3 (Left, Down, Right, Up)."""
    table = np.zeros((size * size, 4), np.int32)
    for r in range(size):
        for c in range(size):
            table[r * size + c] = [
                r * size + max(c - 1, 0),
                min(r + 1, size - 1) * size + c,
                r * size + min(c + 1, size - 1),
                max(r - 1, 0) * size + c,
            ]
    return table


def shortest_path_length(grid: jax.Array, start: jax.Array, goal: jax.Array) -> jax.Array:
    """Moves from start to goal through non-hole cells (int32[], a large number if unreachable).

    Bellman-Ford relaxation: d[n] = min(d[n], 1 + min over neighbours c that can be left (not hole, not
    goal) of d[c]); holes are never entered. size*size - 1 rounds reach every cell.
    """
    size = grid.shape[0]
    cells = size * size
    flat = grid.reshape(-1)
    nbr = jnp.asarray(neighbor_table(size))
    unreachable = jnp.int32(10 * cells)
    dist = jnp.where(jnp.arange(cells) == start, 0, unreachable).astype(jnp.int32)
    can_leave = (flat != HOLE) & (flat != GOAL)

    def relax(_, d):
        from_here = jnp.where(can_leave, d, unreachable)
        best = jnp.min(from_here[nbr], axis=1) + 1  # neighbours are symmetric, so nbr lists sources
        d = jnp.minimum(d, best)
        return jnp.where(flat == HOLE, unreachable, d)

    dist = jax.lax.fori_loop(0, cells - 1, relax, dist)
    return dist[goal]


class FrozenLake(TextEnv):
    action_lookup = {1: "Left", 2: "Down", 3: "Right", 4: "Up"}
    reward_decimals = 0  # gymnasium's rewards are ints, so RAGEN prints "Reward:\n1"
    default_max_response_tokens = 120

    @property
    def default_params(self) -> FrozenLakeParams:
        return FrozenLakeParams()

    # ----- dynamics ---------------------------------------------------------------------------------
    def sample_map(self, key: jax.Array, params: FrozenLakeParams) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(grid int32[size, size], start, goal): one map satisfying the generation rule."""
        size = params.size

        def draw(k):
            k_tiles, k_ends = jax.random.split(k)
            frozen = jax.random.uniform(k_tiles, (size * size,)) < params.p_frozen
            start, goal = jax.random.randint(k_ends, (2,), 0, size * size)
            flat = jnp.where(frozen, FROZEN, HOLE).at[start].set(START).at[goal].set(GOAL)
            grid = flat.reshape(size, size).astype(jnp.int32)
            ok = (start != goal) & (shortest_path_length(grid, start, goal) <= params.max_actions)
            return grid, start.astype(jnp.int32), goal.astype(jnp.int32), ok

        def body(carry):
            k, *_ = carry
            k, sub = jax.random.split(k)
            return (k, *draw(sub))

        key, first = jax.random.split(key)
        init = (key, *draw(first))
        _, grid, start, goal, _ = jax.lax.while_loop(lambda c: ~c[4], body, init)
        return grid, start, goal

    def reset_env(self, key: jax.Array, params: FrozenLakeParams) -> tuple[jax.Array, FrozenLakeState]:
        grid, start, _ = self.sample_map(key, params)
        state = FrozenLakeState(
            time=jnp.zeros((), jnp.int32), terminated=jnp.zeros((), bool), success=jnp.zeros((), bool),
            grid=grid, pos=start,
        )
        return self.get_obs(state), state

    def get_obs(self, state: FrozenLakeState, params: Any = None, key: Any = None) -> jax.Array:
        return state.pos

    def step_env(
        self, key: jax.Array, state: FrozenLakeState, action: jax.Array, params: FrozenLakeParams
    ) -> tuple[jax.Array, FrozenLakeState, jax.Array, jax.Array, dict]:
        """One move. action: RAGEN id 1..4 (anything else is invalid: nothing happens)."""
        action, valid = checked_action(action, state, 4)
        intended = jnp.clip(action - 1, 0, 3)
        # gymnasium: categorical over [(a-1)%4, a, (a+1)%4] with [fail, success, fail] via cumsum > u.
        fail = (1.0 - params.success_rate) / 2.0
        u = jax.random.uniform(key)
        move = jnp.where(u < fail, (intended - 1) % 4, jnp.where(u < fail + params.success_rate, intended, (intended + 1) % 4))
        nbr = jnp.asarray(neighbor_table(params.size))
        new_pos = nbr[state.pos, move]
        tile = state.grid.reshape(-1)[new_pos]
        moved = FrozenLakeState(
            time=state.time + 1, terminated=(tile == GOAL) | (tile == HOLE), success=tile == GOAL,
            grid=state.grid, pos=new_pos,
        )
        new_state = select(valid, moved, state)
        reward = jnp.where(valid & (tile == GOAL), 1.0, 0.0).astype(jnp.float32)
        info = {"action_is_effective": new_state.pos != state.pos, "action_is_valid": valid}
        return self.get_obs(new_state), new_state, reward, new_state.terminated, info

    def demo_policy(self) -> "FrozenLakePolicy":
        return FrozenLakePolicy()

    # ----- text -------------------------------------------------------------------------------------
    def instruction_text(self, params: FrozenLakeParams, style: str) -> str:
        if style == "ragen":
            return RAGEN_INSTRUCTION
        return f"FrozenLake {params.size}x{params.size}: move P to goal G, avoid holes O. Up: row - 1, Left: col - 1.\n"

    def symbol_legend(self) -> Sequence[tuple[str, str]]:
        return LEGEND

    @staticmethod
    def _symbol_index(grid: Any, pos: Any, xp: Any) -> Any:
        """Per cell, the index into SYMBOLS (RAGEN: start shows as "_"; player P / X in hole / √ on goal)."""
        flat = grid.reshape(-1)
        base = xp.where(flat == HOLE, 2, xp.where(flat == GOAL, 3, 1))
        player_symbol = xp.where(flat[pos] == HOLE, 4, xp.where(flat[pos] == GOAL, 5, 0))
        return xp.where(xp.arange(flat.shape[0]) == pos, player_symbol, base)

    def render_state_text(self, state: FrozenLakeState, params: FrozenLakeParams, style: str = "ragen") -> str:
        size = params.size
        grid = np.asarray(state.grid)
        pos = int(state.pos)
        cells = [(r, c) for r in range(size) for c in range(size)]
        coord = lambda rc: f"({rc[0]}, {rc[1]})"  # noqa: E731
        find = lambda code: [cells[i] for i in np.flatnonzero(grid.reshape(-1) == code)]  # noqa: E731
        tile = grid.reshape(-1)[pos]
        if style != "ragen":
            label = COMPACT_PLAYER_LABELS[1 if tile == GOAL else 2 if tile == HOLE else 0]
            holes = find(HOLE)
            text = f"{label} {coord(cells[pos])} G {coord(find(GOAL)[0])}"
            return text + (" O " + ", ".join(coord(rc) for rc in holes) if holes else "")
        lines = [f"Board size: {size} rows x {size} cols (zero-indexed)."]
        lines.append("Start: " + ", ".join(coord(rc) for rc in find(START)))
        lines.append("Goal: " + ", ".join(coord(rc) for rc in find(GOAL)))
        label = "Player on goal" if tile == GOAL else "Player in hole" if tile == HOLE else "Player"
        lines.append(f"{label}: {coord(cells[pos])}")
        holes = find(HOLE)
        if holes:
            lines.append("Holes: " + ", ".join(coord(rc) for rc in holes))
        symbols = self._symbol_index(grid, pos, np)
        rows = ["".join(SYMBOLS[symbols[r * size + c]] for c in range(size)) for r in range(size)]
        return "Coordinates: \n" + "\n".join(lines) + "\n" + "Grid Map: \n" + "\n".join(rows)

    def render_state_items(
        self, state: FrozenLakeState, params: FrozenLakeParams, frags: TokenFragments, style: str = "ragen"
    ) -> list[Static | Dynamic]:
        size = params.size
        cells = size * size
        flat = state.grid.reshape(-1)
        coords = [f"({i // size}, {i % size})" for i in range(cells)]
        start = jnp.argmax(flat == START)
        goal = jnp.argmax(flat == GOAL)
        tile = flat[state.pos]
        label = jnp.where(tile == GOAL, 1, jnp.where(tile == HOLE, 2, 0))
        hole = flat == HOLE
        first_hole = jnp.argmax(hole)
        # Holes list: per cell [", " if a hole and not the first hole, "(r, c)" if a hole].
        hole_table = frags.table([", "] + coords)
        hole_idx = jnp.stack([jnp.zeros((cells,), jnp.int32), jnp.arange(1, cells + 1, dtype=jnp.int32)], 1)
        hole_on = jnp.stack([hole & (jnp.arange(cells) != first_hole), hole], 1)
        holes = Dynamic(hole_table, hole_idx.reshape(-1), hole_on.reshape(-1))
        if style != "ragen":
            return [
                frags.choice(COMPACT_PLAYER_LABELS, label), frags.static(" "), frags.choice(coords, state.pos),
                frags.static(" G "), frags.choice(coords, goal), frags.optional(" O ", jnp.any(hole)), holes,
            ]
        # Grid: per cell its symbol, then "\n" after every row but the last.
        grid_table = frags.table(list(SYMBOLS) + ["\n"])
        symbols = self._symbol_index(state.grid, state.pos, jnp).astype(jnp.int32)
        grid_idx = jnp.stack([symbols, jnp.full((cells,), len(SYMBOLS), jnp.int32)], 1)
        row_end = (jnp.arange(cells) % size == size - 1) & (jnp.arange(cells) < cells - 1)
        grid_on = jnp.stack([jnp.ones((cells,), bool), row_end], 1)
        return [
            frags.static(f"Coordinates: \nBoard size: {size} rows x {size} cols (zero-indexed).\nStart: "),
            frags.choice(coords, start),
            frags.static("\nGoal: "),
            frags.choice(coords, goal),
            frags.static("\n"),
            frags.choice(PLAYER_LABELS, label),
            frags.static(": "),
            frags.choice(coords, state.pos),
            frags.optional("\nHoles: ", jnp.any(hole)),
            holes,
            frags.static("\nGrid Map: \n"),
            Dynamic(grid_table, grid_idx.reshape(-1), grid_on.reshape(-1)),
        ]


def to_desc(grid: np.ndarray) -> list[str]:
    """gymnasium's ``desc`` rows ("SFFH", ...) for a tile grid."""
    return ["".join(TILE_LETTERS[int(t)] for t in row) for row in np.asarray(grid)]


class FrozenLakePolicy:
    """Demonstrations (``envs.demos``): the BFS shortest path (``envs.solvers.frozen_lake_bfs``). Reasoning, e.g.

    "P (0, 1) G (3, 2); hole Down. Right to (0, 2), Down to (1, 2)."
    = player and goal cells, the neighbours of the player that are holes, each chosen move and the
    cell it leads to (intended cell: on a slippery lake the env may move elsewhere; the next turn
    re-plans from where the player really is). A noisy first move avoids holes when it can."""

    names = FrozenLake.action_lookup

    @staticmethod
    def _layout(state: Any, params: Any) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        grid = np.asarray(state.grid)
        cell = divmod(int(state.pos), int(params.size))
        goal = tuple(int(v) for v in np.argwhere(grid == GOAL)[0])
        return grid, cell, goal

    @staticmethod
    def _move(grid: np.ndarray, cell: tuple[int, int], action: int) -> tuple[int, int]:
        dr, dc = FROZEN_LAKE_MOVES[action]
        rows, cols = grid.shape
        return min(max(cell[0] + dr, 0), rows - 1), min(max(cell[1] + dc, 0), cols - 1)

    def plan_length(self, state: Any, params: Any) -> int:
        grid, cell, goal = self._layout(state, params)
        plan = frozen_lake_bfs(grid, cell, goal)
        return len(plan) if plan else 0

    def turn(self, state: Any, params: Any, k: int, noisy: bool, rng: np.random.Generator) -> TurnChoice:
        grid, cell, goal = self._layout(state, params)
        near = [self.names[a] for a in sorted(self.names) if
                self._move(grid, cell, a) != cell and grid[self._move(grid, cell, a)] == HOLE]
        holes = ("holes " if len(near) > 1 else "hole ") + ", ".join(near) if near else "no hole near"
        plan = frozen_lake_bfs(grid, cell, goal) or []
        trace: list[tuple[int, tuple[int, int]]] = []
        cur = cell
        if noisy:
            options = [a for a in sorted(self.names) if not plan or a != plan[0]]
            safe = [a for a in options if self._move(grid, cur, a) != cur and grid[self._move(grid, cur, a)] != HOLE]
            action = pick(rng, safe, options)
            cur = self._move(grid, cur, action)
            trace.append((action, cur))
            plan = [] if grid[cur] in (HOLE, GOAL) else frozen_lake_bfs(grid, cur, goal) or []
        for action in plan:
            if len(trace) >= k:
                break
            cur = self._move(grid, cur, action)
            trace.append((action, cur))
        if not trace:  # no path (cannot happen on generated maps): any move, still described truthfully
            action = pick(rng, [], sorted(self.names))
            trace.append((action, self._move(grid, cur, action)))
        moves = ", ".join(f"{self.names[a]} to {coord(c)}" for a, c in trace)
        reasoning = f"P {coord(cell)} G {coord(goal)}; {holes}. {moves}."
        return TurnChoice(reasoning, tuple(self.names[a] for a, _ in trace))
