"""Sokoban level generation as pure JAX functions (jit- and vmap-able).

Semantics follow RAGEN's generator (`ragen/env/sokoban/utils.py::generate_room`, itself adapted
from gym_sokoban's `room_utils.py`):

1. Room topology by a random walk (`room_topology`): start at a random interior cell with a random
   direction; for `num_gen_steps = int(1.7 * (rows + cols))` steps, change direction with
   probability 0.35, move one cell (clamped to the interior), and stamp one of five 3x3 masks
   (centred on the walker) as floor. The border is always wall.
2. Targets are placed uniformly on distinct floor cells, with the boxes on them (the solved
   state). As in RAGEN, a room needs more than `num_boxes + 1` floor cells.
3. Reverse play from the solved state picks the start. RAGEN runs a depth-first search over pulls
   (depth 300) and keeps the state with the best `box_swaps * box displacement`, requiring every
   target to be uncovered (no box and no player on a target). Here the search is exact and
   vectorised instead: the whole state space (player cell x box cells, `cells^(num_boxes + 1)`
   states) is enumerated as a dense grid, and `solution_lengths` runs `max_solution_steps`
   relaxation sweeps of the Bellman equation  d(s) = 0 if s is solved, else
   1 + min_a d(next(s, a)),  which gives the exact shortest forward solution length of every state
   that can be solved within the budget.
   Among those states with every target uncovered, the start maximises the displacement score:
   the minimum over box-to-target assignments of the summed Manhattan distances. For one box this
   is exactly RAGEN's score (its `box_swaps` is 1 once the box has been pulled). For more boxes
   RAGEN multiplies its (identity-tracking) displacement by `box_swaps`, the number of times the
   pulled box changed along the DFS path, which is path-dependent, not a function of the state
   (it is at least num_boxes for every candidate); the state-function score drops that factor.
   Ties are broken uniformly at random by the key. So every generated level is solvable within
   the action budget by construction.
4. A try with no candidate (too little floor, or no pull possible within the budget) is retried
   with a fresh key, up to `max_tries`; after that the documented fallback level is used
   (`fallback_level`: an open room, each box one cell below its target, solvable in
   `4 * num_boxes - 3` actions).

Deviations from RAGEN, on purpose: (a) the distances are to ANY solved state (every player
cell), not to the one solved state with RAGEN's randomly placed player, so that player's region
does not restrict the start; (b) `add_random_player_movement` (1 to 3 random player moves after
the search, so the player does not always start next to the box) is replaced by the uniform
tie-break over all player cells that keep the level within the budget; (c) the start is restricted
to levels solvable within `max_solution_steps` actions (RAGEN's levels can need more than 10).

Cell codes of `Level.fixed`: 0 wall, 1 floor, 2 target (gym_sokoban's `room_fixed`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from flax import struct

WALL, FLOOR, TARGET = 0, 1, 2

# (d_row, d_col) of RAGEN's actions 1 Up, 2 Down, 3 Left, 4 Right, at index (action id - 1).
ACTION_DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))

# gym_sokoban's random-walk masks: ones become floor, centred on the walker's cell.
TOPOLOGY_MASKS = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
# gym_sokoban's walk directions, (d_row, d_col).
WALK_DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))


@dataclasses.dataclass(frozen=True)
class SokobanSpec:
    """Static settings of a Sokoban task (they fix array shapes, so they are hashable and static).

    rows, cols: room size (RAGEN's dim_room). num_boxes: boxes (= targets).
    max_solution_steps: the action budget; every generated level is solvable within it (RAGEN's
      max_actions_per_traj, 10). num_gen_steps: random-walk length, None -> int(1.7 * (rows + cols)).
    p_change_directions: random-walk turn probability. max_tries: fresh-key retries before the
      fallback level.
    """

    rows: int = 6
    cols: int = 6
    num_boxes: int = 1
    max_solution_steps: int = 10
    num_gen_steps: int | None = None
    p_change_directions: float = 0.35
    max_tries: int = 10

    def __post_init__(self):
        if self.rows < 5 or self.cols < 2 * self.num_boxes + 1:
            raise ValueError(
                f"SokobanSpec(rows={self.rows}, cols={self.cols}, num_boxes={self.num_boxes}) is too "
                "small: need rows >= 5 and cols >= 2 * num_boxes + 1 (e.g. 6x6 with 1 box, 8x8 with 2)."
            )
        if not 1 <= self.num_boxes <= 3:
            raise ValueError(
                f"num_boxes={self.num_boxes}: the enumerated state space has cells^(num_boxes+1) "
                "states, so 1 to 3 boxes are supported; use num_boxes in {1, 2, 3}."
            )
        if self.max_solution_steps < 4 * self.num_boxes - 3:
            raise ValueError(
                f"max_solution_steps={self.max_solution_steps} is below the fallback level's "
                f"solution length bound {4 * self.num_boxes - 3}; raise it."
            )
        if self.max_tries < 1:
            raise ValueError(f"max_tries={self.max_tries}: need at least 1 try.")

    @property
    def cells(self) -> int:
        return self.rows * self.cols

    @property
    def num_states(self) -> int:
        """Size of the enumerated state space: cells^(num_boxes + 1)."""
        return self.cells ** (self.num_boxes + 1)

    @property
    def walk_steps(self) -> int:
        if self.num_gen_steps is not None:
            return self.num_gen_steps
        return int(1.7 * (self.rows + self.cols))

    @property
    def unreached(self) -> int:
        """Distance value meaning "not solvable within max_solution_steps"."""
        return self.max_solution_steps + 1


@struct.dataclass
class Level:
    """A start state. fixed: int8[R, C] (0 wall, 1 floor, 2 target); boxes: bool[R, C];
    player: int32[2] (row, col); solution_length: int32[] (exact shortest solution, in actions);
    used_fallback: bool[] (True when every try failed and `fallback_level` was returned)."""

    fixed: jax.Array
    boxes: jax.Array
    player: jax.Array
    solution_length: jax.Array
    used_fallback: jax.Array


def room_topology(key: jax.Array, spec: SokobanSpec) -> jax.Array:
    """gym_sokoban's random-walk room: floor: bool[R, C], border always wall."""
    rows, cols = spec.rows, spec.cols
    masks = jnp.asarray(TOPOLOGY_MASKS, jnp.int32)
    directions = jnp.asarray(WALK_DIRECTIONS, jnp.int32)
    key_dir, key_pos, key_walk = jax.random.split(key, 3)
    direction = directions[jax.random.randint(key_dir, (), 0, 4)]
    # random.randint(1, dim - 1) is inclusive of both ends.
    position = jnp.stack([
        jax.random.randint(key_pos, (), 1, rows),
        jax.random.randint(jax.random.fold_in(key_pos, 1), (), 1, cols),
    ])
    grid_r = jnp.arange(rows)[:, None]
    grid_c = jnp.arange(cols)[None, :]

    def walk_step(step, carry):
        level, position, direction = carry
        k = jax.random.fold_in(key_walk, step)
        k_turn, k_dir, k_mask = jax.random.split(k, 3)
        turn = jax.random.uniform(k_turn) < spec.p_change_directions
        direction = jnp.where(turn, directions[jax.random.randint(k_dir, (), 0, 4)], direction)
        position = position + direction
        position = jnp.clip(position, 1, jnp.array([rows - 2, cols - 2]))
        mask = masks[jax.random.randint(k_mask, (), 0, len(TOPOLOGY_MASKS))]
        # Stamp the 3x3 mask whose top-left corner is position - 1.
        dr = grid_r - (position[0] - 1)
        dc = grid_c - (position[1] - 1)
        inside = (dr >= 0) & (dr < 3) & (dc >= 0) & (dc < 3)
        stamp = jnp.where(inside, mask[jnp.clip(dr, 0, 2), jnp.clip(dc, 0, 2)], 0)
        return level + stamp, position, direction

    level0 = jnp.zeros((rows, cols), jnp.int32)
    level, _, _ = jax.lax.fori_loop(0, spec.walk_steps, walk_step, (level0, position, direction))
    border = (grid_r == 0) | (grid_r == rows - 1) | (grid_c == 0) | (grid_c == cols - 1)
    return (level > 0) & ~border


def decode_states(spec: SokobanSpec) -> tuple[jax.Array, jax.Array]:
    """All states of the enumeration: player: int32[S] flat cell, boxes: int32[S, K] flat cells.

    Encoding: s = player * cells^K + sum_i boxes[i] * cells^(K - 1 - i).
    """
    s = jnp.arange(spec.num_states, dtype=jnp.int32)
    n, k = spec.cells, spec.num_boxes
    player = s // n**k
    boxes = jnp.stack([(s // n ** (k - 1 - i)) % n for i in range(k)], axis=-1)
    return player, boxes


def _entity_coords(spec: SokobanSpec) -> list[tuple[jax.Array, jax.Array]]:
    """(row, col) index arrays of the player (entity 0) and each box (1..K), shaped to broadcast
    over the dense state grid [R, C] * (K + 1) (axes 2e, 2e+1 belong to entity e)."""
    dims = 2 * (spec.num_boxes + 1)

    def axis_range(axis: int, size: int) -> jax.Array:
        shape = [1] * dims
        shape[axis] = size
        return jnp.arange(size).reshape(shape)

    return [(axis_range(2 * e, spec.rows), axis_range(2 * e + 1, spec.cols)) for e in range(spec.num_boxes + 1)]


def solution_lengths(fixed: jax.Array, spec: SokobanSpec) -> jax.Array:
    """Exact shortest forward solution length of every state, capped: int32[S] (S = num_states,
    indexed as in `decode_states`).

    max_solution_steps sweeps of the Bellman equation
        d(s) <- min(d(s), 1 + min_a d(next(s, a))),   d = 0 on solved states,
    under gym_sokoban's push rules. After t sweeps d is exact wherever the true length is <= t;
    the rest stay at spec.unreached (= max_solution_steps + 1), as do invalid states (player or a
    box on a wall, or two of them on one cell). (A blocked move stays put, d(s) + 1 > d(s), so it
    never improves d and is left out.)

    The state space is a dense grid d[pr, pc, b1r, b1c, ...] (row-major, so its flat index is the
    encoding of `decode_states`): a walk in direction delta reads d shifted by delta along the
    player axes, a push of box i reads it shifted along the player's and box i's axes. Dense
    shifted slices vectorise far better than gathers through a transition table.
    """
    rows, cols, k = spec.rows, spec.cols, spec.num_boxes
    shape = (rows, cols) * (k + 1)
    ents = _entity_coords(spec)
    floor = fixed != WALL
    target = fixed == TARGET

    def on(grid, rc, dr=0, dc=0):
        r, c = rc[0] + dr, rc[1] + dc
        inside = (r >= 0) & (r < rows) & (c >= 0) & (c < cols)
        return inside & grid[jnp.clip(r, 0, rows - 1), jnp.clip(c, 0, cols - 1)]

    def same(a, b, dr=0, dc=0):  # cell a + delta == cell b
        return (a[0] + dr == b[0]) & (a[1] + dc == b[1])

    valid = on(floor, ents[0])
    for i in range(1, k + 1):
        valid = valid & on(floor, ents[i]) & ~same(ents[0], ents[i])
    for i, j in itertools.combinations(range(1, k + 1), 2):
        valid = valid & ~same(ents[i], ents[j])
    solved = valid
    for i in range(1, k + 1):
        solved = solved & on(target, ents[i])
    valid, solved = jnp.broadcast_to(valid, shape), jnp.broadcast_to(solved, shape)

    # Per direction: where a walk is possible, and where a push of box i is possible, with the
    # offsets (along each axis) of the successor state.
    moves = []
    for dr, dc in ACTION_DELTAS:
        hit = [same(ents[0], ents[i], dr, dc) for i in range(1, k + 1)]
        walk = on(floor, ents[0], dr, dc)
        for h in hit:
            walk = walk & ~h
        moves.append((jnp.broadcast_to(walk, shape), [dr, dc] + [0, 0] * k))
        for i in range(1, k + 1):
            push = hit[i - 1] & on(floor, ents[i], dr, dc)
            for j in range(1, k + 1):
                if j != i:
                    push = push & ~same(ents[i], ents[j], dr, dc)
            offsets = [dr, dc] + [0, 0] * k
            offsets[2 * i], offsets[2 * i + 1] = dr, dc
            moves.append((jnp.broadcast_to(push, shape), offsets))

    unreached = spec.unreached

    def sweep(_, d):
        padded = jnp.pad(d, 1, constant_values=unreached)
        best = jnp.full(shape, unreached, jnp.int32)
        for allowed, offsets in moves:
            starts = [1 + o for o in offsets]
            successor = jax.lax.slice(padded, starts, [a + n for a, n in zip(starts, shape)])
            best = jnp.minimum(best, jnp.where(allowed, successor, unreached))
        return jnp.where(valid, jnp.minimum(d, jnp.minimum(best + 1, unreached)), unreached)

    d0 = jnp.where(solved, 0, unreached).astype(jnp.int32)
    return jax.lax.fori_loop(0, spec.max_solution_steps, sweep, d0).reshape(-1)


def displacement_score(target_cells: jax.Array, spec: SokobanSpec) -> jax.Array:
    """min over assignments sigma of sum_i |box_i - target_sigma(i)|_1 (Manhattan, in cells), for
    every state of the dense grid. target_cells: int32[K] flat cells. Returns int32[R, C]*(K+1)."""
    ents = _entity_coords(spec)
    tr, tc = target_cells // spec.cols, target_cells % spec.cols
    best = None
    for perm in itertools.permutations(range(spec.num_boxes)):
        cost = sum(
            jnp.abs(ents[1 + i][0] - tr[t]) + jnp.abs(ents[1 + i][1] - tc[t]) for i, t in enumerate(perm)
        )
        best = cost if best is None else jnp.minimum(best, cost)
    return jnp.broadcast_to(best, (spec.rows, spec.cols) * (spec.num_boxes + 1))


def _decode_index(index: jax.Array, spec: SokobanSpec) -> tuple[jax.Array, jax.Array]:
    """One state index -> (player flat cell int32[], box flat cells int32[K]) (see decode_states)."""
    n, k = spec.cells, spec.num_boxes
    boxes = jnp.stack([(index // n ** (k - 1 - i)) % n for i in range(k)])
    return (index // n**k).astype(jnp.int32), boxes.astype(jnp.int32)


def _try_level(key: jax.Array, spec: SokobanSpec) -> tuple[jax.Array, Level]:
    """One generation attempt -> (found: bool[], level). The level is meaningless when not found."""
    key_room, key_targets, key_tie = jax.random.split(key, 3)
    floor = room_topology(key_room, spec)
    flat_floor = floor.reshape(-1)
    n_floor = jnp.sum(flat_floor)
    enough_floor = n_floor > spec.num_boxes + 1  # RAGEN: more floor cells than boxes + player.
    probs = flat_floor / jnp.maximum(n_floor, 1)
    target_cells = jax.random.choice(
        key_targets, spec.cells, shape=(spec.num_boxes,), replace=False, p=probs
    ).astype(jnp.int32)
    fixed_flat = jnp.where(flat_floor, FLOOR, WALL).at[target_cells].set(TARGET)
    fixed = fixed_flat.reshape(spec.rows, spec.cols).astype(jnp.int8)

    d = solution_lengths(fixed, spec)
    # RAGEN's room score is 0 unless every target is uncovered (no box, no player on it).
    not_target = fixed != TARGET
    uncovered = None
    for r, c in _entity_coords(spec):
        cell_free = not_target[r, c]
        uncovered = cell_free if uncovered is None else uncovered & cell_free
    candidate = uncovered.reshape(-1) & (d <= spec.max_solution_steps) & enough_floor
    score = displacement_score(target_cells, spec).reshape(-1).astype(jnp.float32)
    # Integer scores plus U[0, 1) noise: argmax takes the best score, ties broken by the key.
    noisy = jnp.where(candidate, score + jax.random.uniform(key_tie, score.shape), -1.0)
    pick = jnp.argmax(noisy)
    player, boxes = _decode_index(pick, spec)
    level = Level(
        fixed=fixed,
        boxes=jnp.zeros(spec.cells, bool).at[boxes].set(True).reshape(spec.rows, spec.cols),
        player=jnp.stack([player // spec.cols, player % spec.cols]).astype(jnp.int32),
        solution_length=d[pick].astype(jnp.int32),
        used_fallback=jnp.array(False),
    )
    return jnp.any(candidate), level


def fallback_level(spec: SokobanSpec) -> Level:
    """The level used when every try fails: open interior, target i at (1, 1 + 2i), box i at
    (2, 1 + 2i), player at (3, 1). Shortest solution: Up, then (Down, Right, Right, Up) per further
    box, so its length is 4 * num_boxes - 3 <= max_solution_steps (checked by SokobanSpec; the
    tests confirm the length with the BFS solver)."""
    rows, cols = spec.rows, spec.cols
    fixed = jnp.zeros((rows, cols), jnp.int8).at[1 : rows - 1, 1 : cols - 1].set(FLOOR)
    boxes = jnp.zeros((rows, cols), bool)
    for i in range(spec.num_boxes):
        fixed = fixed.at[1, 1 + 2 * i].set(TARGET)
        boxes = boxes.at[2, 1 + 2 * i].set(True)
    player = jnp.array([3, 1], jnp.int32)
    length = jnp.int32(4 * spec.num_boxes - 3)
    return Level(fixed, boxes, player, length, jnp.array(True))


def generate_level(key: jax.Array, spec: SokobanSpec) -> Level:
    """A level from a key (jittable, vmappable): up to spec.max_tries attempts with keys
    fold_in(key, t), the first success wins; `fallback_level` if none succeeds."""
    found0, level0 = _try_level(jax.random.fold_in(key, 0), spec)

    def cond(carry):
        t, found, _ = carry
        return (~found) & (t < spec.max_tries)

    def body(carry):
        t, _, _ = carry
        found, level = _try_level(jax.random.fold_in(key, t), spec)
        return t + 1, found, level

    _, found, level = jax.lax.while_loop(cond, body, (jnp.int32(1), found0, level0))
    fallback = fallback_level(spec)
    return jax.tree.map(lambda a, b: jnp.where(found, a, b), level, fallback)


@functools.partial(jax.jit, static_argnames=("spec",))
def _generate_chunk(keys: jax.Array, spec: SokobanSpec) -> Level:
    return jax.vmap(generate_level, in_axes=(0, None))(keys, spec)


def make_level_pool(key: jax.Array, num_levels: int, spec: SokobanSpec, chunk_size: int = 64) -> Level:
    """Pre-generate num_levels levels on device, chunk_size at a time (this bounds the memory of
    the state-space grids: per level, a few dozen arrays of cells^(num_boxes+1) entries; for 8x8
    with 2 boxes that is tens of MB per level, so keep chunk_size modest there). Level i comes
    from fold_in(key, i), so a pool is a pure function of (key, num_levels, spec).
    Returns a Level whose leaves have a leading axis [num_levels]."""
    if num_levels < 1:
        raise ValueError(f"num_levels={num_levels}: a level pool needs at least one level.")
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_levels))
    pad = (-num_levels) % chunk_size
    keys = jnp.concatenate([keys, jnp.repeat(keys[-1:], pad, axis=0)]) if pad else keys
    chunks = [
        _generate_chunk(keys[i : i + chunk_size], spec) for i in range(0, keys.shape[0], chunk_size)
    ]
    pool = jax.tree.map(lambda *xs: jnp.concatenate(xs)[:num_levels], *chunks)
    return pool
