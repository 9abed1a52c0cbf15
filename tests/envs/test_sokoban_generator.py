"""Sokoban level generator: every level solvable within the budget (checked by the host BFS
solver), exact state-space distances, the score rule, topology properties, pools, fallback."""

from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.sokoban_generator import (
    FLOOR,
    TARGET,
    WALL,
    SokobanSpec,
    decode_states,
    fallback_level,
    make_level_pool,
    room_topology,
    solution_lengths,
)
from envs.sokoban_solver import solve

SPEC = SokobanSpec()  # 6x6, one box, budget 10
LARGER = SokobanSpec(rows=8, cols=8, num_boxes=2)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


CHUNK = 250  # one compiled chunk shape shared by every pool built in this file


@pytest.fixture(scope="module")
def levels_1000():
    """Levels of seeds 0..999: level i comes from fold_in(key(0), i)."""
    return _host(make_level_pool(jax.random.key(0), 1000, SPEC, chunk_size=CHUNK))


def _manhattan_score(boxes_rc, targets_rc):
    """Independent: best assignment of boxes to targets by brute force over permutations."""
    import itertools

    return min(
        sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes_rc, perm))
        for perm in itertools.permutations(targets_rc)
    )


def test_every_generated_level_is_solvable_within_budget(levels_1000):
    lv = levels_1000
    assert not lv.used_fallback.any()
    for i in range(1000):
        fixed, boxes, player = lv.fixed[i], lv.boxes[i], lv.player[i]
        solution = solve(fixed, boxes, player, max_depth=SPEC.max_solution_steps)
        assert solution is not None, f"seed {i} not solvable in {SPEC.max_solution_steps}"
        assert len(solution) == lv.solution_length[i]
        assert 1 <= len(solution) <= SPEC.max_solution_steps


def test_generated_levels_are_well_formed(levels_1000):
    lv = levels_1000
    n = lv.fixed.shape[0]
    border = np.ones((6, 6), bool)
    border[1:-1, 1:-1] = False
    assert (lv.fixed[:, border] == WALL).all()
    assert ((lv.fixed == TARGET).sum(axis=(1, 2)) == 1).all()
    assert (lv.boxes.sum(axis=(1, 2)) == 1).all()
    rows, cols = lv.player[:, 0], lv.player[:, 1]
    player_cell = lv.fixed[np.arange(n), rows, cols]
    assert (player_cell == FLOOR).all(), "RAGEN's start has the player off every target, on floor"
    assert not lv.boxes[np.arange(n), rows, cols].any()
    assert not (lv.boxes & (lv.fixed == TARGET)).any(), "RAGEN's start has every target uncovered"
    assert not (lv.boxes & (lv.fixed == WALL)).any()
    # Levels differ across seeds (the generator uses the key).
    distinct = {(lv.fixed[i].tobytes(), lv.boxes[i].tobytes(), lv.player[i].tobytes()) for i in range(n)}
    assert len(distinct) > 900


def test_topology_is_a_connected_interior_room():
    keys = jax.vmap(jax.random.key)(jnp.arange(200))
    floors = np.asarray(jax.jit(jax.vmap(room_topology, in_axes=(0, None)), static_argnums=1)(keys, SPEC))
    for floor in floors:
        assert not floor[0].any() and not floor[-1].any() and not floor[:, 0].any() and not floor[:, -1].any()
        cells = list(map(tuple, np.argwhere(floor).tolist()))
        assert cells, "the walk always stamps the walker's own cell"
        seen, queue = {cells[0]}, deque([cells[0]])
        while queue:
            r, c = queue.popleft()
            for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                nxt = (r + dr, c + dc)
                if nxt not in seen and floor[nxt]:
                    seen.add(nxt)
                    queue.append(nxt)
        assert len(seen) == len(cells), "a random walk of stamped masks gives one connected room"
    # 20 steps of 3-cell masks inside a 4x4 interior: rooms are neither tiny nor always full.
    sizes = floors.sum(axis=(1, 2))
    assert sizes.min() >= 3 and sizes.max() <= 16 and 6 < sizes.mean() < 16


def test_solution_lengths_match_host_bfs_on_every_state(levels_1000):
    fixed = levels_1000.fixed[7]
    d = np.asarray(jax.jit(solution_lengths, static_argnums=1)(jnp.asarray(fixed), SPEC))
    player, boxes = (np.asarray(a) for a in decode_states(SPEC))
    floor = fixed.reshape(-1) != WALL
    checked = 0
    for s in range(SPEC.num_states):
        p, b = int(player[s]), int(boxes[s, 0])
        if not (floor[p] and floor[b] and p != b):
            assert d[s] == SPEC.unreached
            continue
        box_grid = np.zeros_like(fixed, bool)
        box_grid[b // 6, b % 6] = True
        sol = solve(fixed, box_grid, (p // 6, p % 6), max_depth=SPEC.max_solution_steps)
        expected = SPEC.unreached if sol is None else len(sol)
        assert d[s] == expected, (s, d[s], expected)
        checked += 1
    assert checked > 20


def test_start_maximises_displacement_among_budget_solvable_starts(levels_1000):
    """Independent re-derivation of the pick rule on the level's own room with the host solver."""
    levels = levels_1000
    for i in range(100, 104):
        fixed = levels.fixed[i]
        targets = list(map(tuple, np.argwhere(fixed == TARGET).tolist()))
        floor = list(map(tuple, np.argwhere(fixed == FLOOR).tolist()))  # floor = not wall, not target
        best = 0
        for box in floor:
            for player in floor:
                if player == box:
                    continue
                grid = np.zeros_like(fixed, bool)
                grid[box] = True
                if solve(fixed, grid, player, max_depth=SPEC.max_solution_steps) is not None:
                    best = max(best, _manhattan_score([box], targets))
        got = _manhattan_score(list(map(tuple, np.argwhere(levels.boxes[i]).tolist())), targets)
        assert got == best > 0


@pytest.mark.slow
def test_larger_pool_levels_are_solvable_within_budget():
    pool = _host(make_level_pool(jax.random.key(0), 12, LARGER, chunk_size=6))
    assert pool.fixed.shape == (12, 8, 8)
    assert not pool.used_fallback.any()
    for i in range(12):
        assert pool.boxes[i].sum() == 2 and (pool.fixed[i] == TARGET).sum() == 2
        assert not (pool.boxes[i] & (pool.fixed[i] == TARGET)).any()
        sol = solve(pool.fixed[i], pool.boxes[i], pool.player[i], max_depth=LARGER.max_solution_steps)
        assert sol is not None and len(sol) == pool.solution_length[i]


def test_pool_is_a_pure_function_of_its_key(levels_1000):
    """Level i depends only on (key, i): a shorter pool is a prefix, chunking does not matter."""
    prefix = _host(make_level_pool(jax.random.key(0), 5, SPEC, chunk_size=CHUNK))
    for x, y in zip(jax.tree.leaves(prefix), jax.tree.leaves(levels_1000)):
        np.testing.assert_array_equal(x, y[:5])
    other = _host(make_level_pool(jax.random.key(1), 5, SPEC, chunk_size=CHUNK))
    assert not np.array_equal(other.fixed, prefix.fixed)


@pytest.mark.parametrize("spec", [SPEC, LARGER], ids=["6x6x1", "8x8x2"])
def test_fallback_level_is_solvable_as_documented(spec):
    level = _host(jax.jit(fallback_level, static_argnums=0)(spec))
    assert level.used_fallback
    sol = solve(level.fixed, level.boxes, level.player, max_depth=spec.max_solution_steps)
    assert sol is not None and len(sol) == level.solution_length == 4 * spec.num_boxes - 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(rows=4), "too small"),
        (dict(num_boxes=4, cols=9, rows=9), "1 to 3 boxes"),
        (dict(num_boxes=2, cols=8, rows=8, max_solution_steps=4), "fallback"),
        (dict(max_tries=0), "at least 1 try"),
    ],
)
def test_spec_rejects_unsupported_settings(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SokobanSpec(**kwargs)


def test_default_walk_length_is_ragens():
    assert SPEC.walk_steps == 20  # int(1.7 * (6 + 6))
    assert LARGER.walk_steps == 27
