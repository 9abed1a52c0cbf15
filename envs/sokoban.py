"""Sokoban (RAGEN's `CoordSokoban`): pure-JAX dynamics, the `grid_coord` text view, the TextEnv.

Dynamics follow gym_sokoban's push rules and rewards (`SokobanEnv.step` / `_calc_reward`):
  reward = -0.1                                   (every action, even a blocked one)
           + 1   if the number of boxes on targets went up
           - 1   if it went down
           + 10  if every box is now on a target (then the episode terminates).
Action ids are RAGEN's action_lookup {1: Up, 2: Down, 3: Left, 4: Right} (gym_sokoban's push
actions). gym_sokoban's no-op 0 is not in RAGEN's lookup, so a model can never choose it; here 0
and any id outside 1..4 are invalid (the TextEnv contract: no-op, reward 0, time unchanged).

Observation text (`render_text`, RAGEN `_render_text('grid_coord')` at mll-lab-nu/RAGEN 20daedc):
  "Coordinates: \\nBoard size: 6 rows x 6 cols (zero-indexed).\\nTargets: (r, c), ...\\n"
  "Boxes: ...\\nBoxes on target: ...\\nPlayer: (r, c)\\nGrid Map: \\n" + grid rows joined by "\\n",
where a coordinate line is left out when its list is empty, "Player:" becomes "Player on target:"
when the player stands on a target, coordinates are listed in row-major order, walls are not
listed, and grid symbols are # wall, _ empty, O target, √ box on target, X box, P player,
S player on target.

Levels come from `envs.sokoban_generator` (generated inside `reset`, jittable), or from a level
pool built on device with `make_level_pool` and stored in `SokobanParams.level_pool` (reset then
draws a pool index from the key): use the pool for 8x8 with 2 boxes (`larger_params`), whose
per-level state-space search is too heavy to repeat in every reset.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.base import TextEnv, TextEnvParams, TextEnvState, checked_action, select
from envs.sokoban_generator import (
    ACTION_DELTAS,
    TARGET,
    WALL,
    Level,
    SokobanSpec,
    generate_level,
    make_level_pool,
)
from envs.sokoban_solver import SokobanPolicy, solve
from envs.text import Dynamic, Static, TokenFragments

ACTION_LOOKUP = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}  # RAGEN's action_lookup
STEP_PENALTY = -0.1
BOX_ON_TARGET_REWARD = 1.0
BOX_OFF_TARGET_PENALTY = -1.0
SOLVED_REWARD = 10.0

# Grid symbols (RAGEN config grid_lookup) and their meanings (grid_vocab), in RAGEN's order.
GRID_LEGEND = (
    ("#", "wall"),
    ("_", "empty"),
    ("O", "target"),
    ("√", "box on target"),
    ("X", "box"),
    ("P", "player"),
    ("S", "player on target"),
)
SYM_WALL, SYM_EMPTY, SYM_TARGET, SYM_BOX_ON_TARGET, SYM_BOX, SYM_PLAYER, SYM_PLAYER_ON_TARGET = range(7)


@struct.dataclass
class SokobanParams(TextEnvParams):
    """max_actions: the episode's action budget (RAGEN max_actions_per_traj, 10).
    spec: room size, boxes and generator settings (static: it fixes shapes).
    level_pool: None (generate a level inside every reset) or a `Level` with a leading pool axis
    [P] from `make_level_pool(key, P, spec)` (reset draws one of them uniformly from its key)."""

    max_actions: int = 10
    spec: SokobanSpec = struct.field(pytree_node=False, default=SokobanSpec())
    level_pool: Level | None = None


@struct.dataclass
class SokobanState(TextEnvState):
    """time: int32[] actions executed; terminated = success: bool[] every box on a target;
    fixed: int8[R, C] (0 wall, 1 floor, 2 target); boxes: bool[R, C]; player: int32[2] (row, col);
    boxes_on_target: int32[]; solution_length: int32[] (shortest solution of the start state)."""

    fixed: jax.Array
    boxes: jax.Array
    player: jax.Array
    boxes_on_target: jax.Array
    solution_length: jax.Array


def state_from_level(level: Level) -> SokobanState:
    """The start state of a level (time 0)."""
    on_target = jnp.sum(level.boxes & (level.fixed == TARGET)).astype(jnp.int32)
    solved = on_target == jnp.sum(level.boxes)
    return SokobanState(
        time=jnp.zeros((), jnp.int32),
        terminated=solved,
        success=solved,
        fixed=level.fixed,
        boxes=level.boxes,
        player=level.player.astype(jnp.int32),
        boxes_on_target=on_target,
        solution_length=level.solution_length,
    )


def move(state: SokobanState, direction: jax.Array) -> tuple[SokobanState, jax.Array, jax.Array]:
    """One action under gym_sokoban's rules -> (state, reward float32[], moved bool[]).

    direction: int32[] in 0..3 (= action id - 1). A move into floor moves the player; a move into
    a box pushes it when the cell beyond is floor without a box; anything else leaves the board
    as it was (still costing the step penalty). Cells outside the grid count as walls.
    """
    rows, cols = state.fixed.shape
    delta = jnp.asarray(ACTION_DELTAS, jnp.int32)[direction]
    step = state.player + delta
    beyond = step + delta

    def free(cell):
        inside = (cell[0] >= 0) & (cell[0] < rows) & (cell[1] >= 0) & (cell[1] < cols)
        r, c = jnp.clip(cell[0], 0, rows - 1), jnp.clip(cell[1], 0, cols - 1)
        return inside & (state.fixed[r, c] != WALL), (r, c)

    step_free, step_rc = free(step)
    beyond_free, beyond_rc = free(beyond)
    box_ahead = state.boxes[step_rc]
    push = step_free & box_ahead & beyond_free & ~state.boxes[beyond_rc]
    walk = step_free & ~box_ahead
    pushed_boxes = state.boxes.at[step_rc].set(False).at[beyond_rc].set(True)
    boxes = jnp.where(push, pushed_boxes, state.boxes)
    moved = push | walk
    player = jnp.where(moved, step, state.player)

    on_target = jnp.sum(boxes & (state.fixed == TARGET)).astype(jnp.int32)
    solved = on_target == jnp.sum(boxes)
    reward = (
        STEP_PENALTY
        + jnp.where(on_target > state.boxes_on_target, BOX_ON_TARGET_REWARD, 0.0)
        + jnp.where(on_target < state.boxes_on_target, BOX_OFF_TARGET_PENALTY, 0.0)
        + jnp.where(solved, SOLVED_REWARD, 0.0)
    ).astype(jnp.float32)
    new_state = state.replace(
        boxes=boxes,
        player=player,
        boxes_on_target=on_target,
        time=state.time + 1,
        terminated=solved,
        success=solved,
    )
    return new_state, reward, moved


def grid_symbols(state: SokobanState) -> jax.Array:
    """int32[R, C] index into GRID_LEGEND for every cell (RAGEN's room_state, 6 = player on target)."""
    rows, cols = state.fixed.shape
    fixed = jnp.asarray(state.fixed)
    target = fixed == TARGET
    sym = jnp.where(fixed == WALL, SYM_WALL, jnp.where(target, SYM_TARGET, SYM_EMPTY))
    sym = jnp.where(state.boxes, jnp.where(target, SYM_BOX_ON_TARGET, SYM_BOX), sym)
    player = jnp.asarray(state.player)
    is_player = (jnp.arange(rows)[:, None] == player[0]) & (jnp.arange(cols)[None, :] == player[1])
    return jnp.where(is_player, jnp.where(target, SYM_PLAYER_ON_TARGET, SYM_PLAYER), sym).astype(jnp.int32)


def render_text(state: SokobanState, style: str = "ragen") -> str:
    """Host render of one (unbatched) state from numpy arrays. ragen: RAGEN's grid_coord text;
    compact: "P (r, c) X (r, c) √ (r, c) O (r, c)\n" + the grid (player, boxes off target, boxes on
    target, all targets; S instead of P when the player stands on a target; empty lists left out)."""
    fixed = np.asarray(state.fixed)
    boxes = np.asarray(state.boxes)
    pr, pc = (int(v) for v in np.asarray(state.player))
    rows, cols = fixed.shape
    target = fixed == TARGET
    player = np.zeros_like(boxes)
    player[pr, pc] = True
    symbols = np.asarray(grid_symbols(state))
    grid = "\n".join("".join(GRID_LEGEND[s][0] for s in row) for row in symbols.tolist())
    cells = lambda mask: ", ".join(f"({r}, {c})" for r, c in np.argwhere(mask).tolist())  # noqa: E731
    if style != "ragen":
        text = f"{'S' if target[pr, pc] else 'P'} ({pr}, {pc})"
        for label, mask in (("X", boxes & ~target), ("\u221a", boxes & target), ("O", target)):
            if mask.any():
                text += f" {label} " + cells(mask)
        return text + "\n" + grid
    lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
    for label, mask in (
        ("Targets", target),
        ("Boxes", boxes & ~target),
        ("Boxes on target", boxes & target),
        ("Player", player & ~target),
        ("Player on target", player & target),
    ):
        if mask.any():
            lines.append(f"{label}: " + cells(mask))
    return "Coordinates: \n" + "\n".join(lines) + "\nGrid Map: \n" + grid


def render_items(
    state: SokobanState, num_boxes: int, frags: TokenFragments, style: str = "ragen"
) -> list[Static | Dynamic]:
    """Device render of one state as text items (`envs.text.assemble` joins them): the same text
    as `render_text(state, style)`. Coordinates are atoms "(r, c)" (first of a list) and ", (r, c)" (the rest),
    indexed by flat cell; each list holds at most num_boxes entries (targets exactly num_boxes)."""
    rows, cols = state.fixed.shape
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    first = frags.table([f"({r}, {c})" for r, c in cells])
    rest = frags.table([f", ({r}, {c})" for r, c in cells])
    target = (state.fixed == TARGET).reshape(-1)
    boxes = state.boxes.reshape(-1)
    slots = jnp.arange(num_boxes)

    def coord_list(mask: jax.Array) -> list[Dynamic]:
        """The row-major cells of mask: bool[R*C] (at most num_boxes of them), comma-joined."""
        idx = jnp.nonzero(mask, size=num_boxes, fill_value=0)[0].astype(jnp.int32)
        enabled = slots < jnp.sum(mask)
        return [Dynamic(first, idx[:1], enabled[:1]), Dynamic(rest, idx[1:], enabled[1:])]

    player_cell = (state.player[0] * cols + state.player[1]).astype(jnp.int32)
    on_target = target[player_cell]
    # Grid: symbol per cell, "\n" (index 7) between rows.
    symbols = frags.table([s for s, _ in GRID_LEGEND] + ["\n"])
    sym = grid_symbols(state)
    newline = jnp.full((rows, 1), len(GRID_LEGEND), jnp.int32)
    grid_idx = jnp.concatenate([sym, newline], axis=1).reshape(-1)[:-1]
    grid = Dynamic(symbols, grid_idx, jnp.ones(grid_idx.shape, bool))
    if style != "ragen":
        items = [frags.choice(["P ", "S "], on_target.astype(jnp.int32)),
                 Dynamic(first, player_cell[None], jnp.ones((1,), bool))]
        for header, mask in ((" X ", boxes & ~target), (" \u221a ", boxes & target), (" O ", target)):
            items += [frags.optional(header, jnp.any(mask)), *coord_list(mask)]
        return items + [frags.static("\n"), grid]
    in_box_lists = [("\nBoxes: ", boxes & ~target), ("\nBoxes on target: ", boxes & target)]
    items: list[Static | Dynamic] = [
        frags.static(f"Coordinates: \nBoard size: {rows} rows x {cols} cols (zero-indexed).\nTargets: "),
        *coord_list(target),
    ]
    for header, mask in in_box_lists:
        items += [frags.optional(header, jnp.any(mask)), *coord_list(mask)]
    items += [
        frags.choice(["\nPlayer: ", "\nPlayer on target: "], on_target.astype(jnp.int32)),
        Dynamic(first, player_cell[None], jnp.ones((1,), bool)),
        frags.static("\nGrid Map: \n"),
        grid,
    ]
    return items


def solution_names(state: SokobanState, max_depth: int = 100) -> list[str] | None:
    """Host: a shortest solution of one (unbatched) state as action names ("Up", ...), by the BFS
    solver; None when no solution within max_depth. For demonstrations and tests."""
    actions = solve(np.asarray(state.fixed), np.asarray(state.boxes), np.asarray(state.player), max_depth)
    return None if actions is None else [ACTION_LOOKUP[a] for a in actions]


def instruction_text(spec: SokobanSpec, style: str = "ragen") -> str:
    """ragen: RAGEN's CoordSokoban env_instruction (config/envs.yaml, trailing spaces kept), with
    the corner coordinate taken from the room size ((5, 5) for 6x6). compact: the same facts, short."""
    corner = f"({spec.rows - 1}, {spec.cols - 1})"
    if style == "compact":
        return (
            f"Sokoban {spec.rows}x{spec.cols}: push each box X onto a target O (no pulling); # is a wall. "
            "Up: row - 1, Left: col - 1.\n"
        )
    return (
        "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\n"
        "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. \n"
        f"Coordinates range from the top-left corner (0, 0) to the bottom-right corner {corner}. \n"
        "When you are exactly next to a box, you can push it by moving in the same direction. \n"
        "You cannot push a box through a wall, and you cannot pull a box.\n"
        "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
    )


class SokobanEnv(TextEnv):
    """RAGEN's CoordSokoban as a gymnax environment with the on-device text layer.

    The task is set by `SokobanParams`: default 6x6 with 1 box, every level solvable within 10
    actions; `larger_params(key)` gives the 8x8, 2-box variant with a level pool.
    """

    action_lookup = ACTION_LOOKUP
    reward_decimals = 1
    default_max_response_tokens = 120  # CoordSokoban max_tokens

    @property
    def default_params(self) -> SokobanParams:
        return SokobanParams()

    @staticmethod
    def pool_params(pool: Level, spec: SokobanSpec, max_actions: int = 10) -> SokobanParams:
        """Params whose resets draw from `pool = make_level_pool(key, n, spec)`."""
        if pool.fixed.ndim != 3 or pool.fixed.shape[1:] != (spec.rows, spec.cols):
            raise ValueError(
                f"level pool of shape {pool.fixed.shape} does not match {spec.rows}x{spec.cols} "
                "rooms; build it with make_level_pool(key, n, spec) for the same spec."
            )
        return SokobanParams(max_actions=max_actions, spec=spec, level_pool=pool)

    def reset_env(self, key: jax.Array, params: SokobanParams) -> tuple[jax.Array, SokobanState]:
        if params.level_pool is None:
            level = generate_level(key, params.spec)
        else:
            pool_size = params.level_pool.fixed.shape[0]
            index = jax.random.randint(key, (), 0, pool_size)
            level = jax.tree.map(lambda leaf: leaf[index], params.level_pool)
        state = state_from_level(level)
        return grid_symbols(state), state

    def step_env(
        self, key: jax.Array, state: SokobanState, action: jax.Array, params: SokobanParams
    ) -> tuple[jax.Array, SokobanState, jax.Array, jax.Array, dict]:
        """action: RAGEN id (1..4). Invalid ids and terminated states: no change, reward 0."""
        del key, params
        action, valid = checked_action(action, state, 4)
        moved_state, reward, moved = move(state, jnp.clip(action - 1, 0, 3))
        state = select(valid, moved_state, state)
        reward = jnp.where(valid, reward, 0.0).astype(jnp.float32)
        info = {"action_is_effective": valid & moved, "action_is_valid": valid, "success": state.success}
        return grid_symbols(state), state, reward, state.terminated, info

    def get_obs(self, state: SokobanState, params: Any = None, key: Any = None) -> jax.Array:
        return grid_symbols(state)

    def demo_policy(self) -> SokobanPolicy:
        return SokobanPolicy(self.action_lookup)

    def instruction_text(self, params: Any, style: str) -> str:
        return instruction_text(params.spec, style)

    def symbol_legend(self) -> Sequence[tuple[str, str]]:
        return GRID_LEGEND

    def render_state_text(self, state: SokobanState, params: Any, style: str = "ragen") -> str:
        return render_text(state, style)

    def render_state_items(
        self, state: SokobanState, params: Any, frags: TokenFragments, style: str = "ragen"
    ) -> list[Static | Dynamic]:
        return render_items(state, params.spec.num_boxes, frags, style)


# RAGEN's LargerSokoban: 8x8 rooms with 2 boxes (its state space, 64^3 states, calls for a pool).
LARGER_SOKOBAN = SokobanSpec(rows=8, cols=8, num_boxes=2)


def larger_params(key: jax.Array, num_levels: int = 1024, chunk_size: int = 32) -> SokobanParams:
    """SokobanParams for LARGER_SOKOBAN with a pool of num_levels levels built on device."""
    return SokobanEnv.pool_params(make_level_pool(key, num_levels, LARGER_SOKOBAN, chunk_size), LARGER_SOKOBAN)
