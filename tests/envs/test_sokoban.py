"""Sokoban env: dynamics and rewards against an independent plain-Python step, invariants over
random play, device render == host render == a RAGEN-style render written here, parse, and
trace counts under jit + vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.sokoban import (
    SokobanEnv,
    SokobanParams,
    SokobanState,
    instruction_text,
    render_text,
    solution_names,
)
from envs.sokoban_generator import Level, SokobanSpec
from envs.sokoban_solver import solve
from ragen_jax.models.tokenizers import CharTokenizer

ENV = SokobanEnv()
PARAMS = ENV.default_params
SMALL_2BOX = SokobanSpec(rows=6, cols=6, num_boxes=2)  # 6^6 states: a cheap multi-box check

# ---------------------------------------------------------------------------------------------
# Independent references, written from gym_sokoban / RAGEN's descriptions
# ---------------------------------------------------------------------------------------------
MOVES = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}


def reference_step(fixed, boxes, player, action):
    """gym_sokoban push + _calc_reward on plain lists. Returns (boxes, player, reward, solved)."""
    rows, cols = len(fixed), len(fixed[0])
    boxes = {tuple(b) for b in boxes}
    targets = {(r, c) for r in range(rows) for c in range(cols) if fixed[r][c] == 2}
    before = len(boxes & targets)
    if action not in MOVES:
        return boxes, tuple(player), 0.0, before == len(boxes)
    dr, dc = MOVES[action]
    nxt = (player[0] + dr, player[1] + dc)
    far = (nxt[0] + dr, nxt[1] + dc)

    def is_floor(cell):
        return 0 <= cell[0] < rows and 0 <= cell[1] < cols and fixed[cell[0]][cell[1]] != 0

    player = tuple(player)
    if is_floor(nxt) and nxt not in boxes:
        player = nxt
    elif is_floor(nxt) and is_floor(far) and far not in boxes:
        boxes = (boxes - {nxt}) | {far}
        player = nxt
    after = len(boxes & targets)
    reward = -0.1 + (1.0 if after > before else 0.0) - (1.0 if after < before else 0.0)
    solved = after == len(boxes)
    return boxes, player, reward + (10.0 if solved else 0.0), solved


def ragen_grid_coord(fixed, boxes, player):
    """RAGEN's room_state encoding (0 wall, 1 empty, 2 target, 3 box on target, 4 box, 5 player)
    and `_render_text('grid_coord')` with its coordinate collection, re-written from the source."""
    fixed = np.asarray(fixed)
    room = fixed.copy().astype(int)
    boxes = np.asarray(boxes)
    room[boxes & (fixed == 2)] = 3
    room[boxes & (fixed != 2)] = 4
    room[player[0], player[1]] = 5
    lookup = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
    coords = {
        "targets": np.argwhere(fixed == 2),
        "boxes_on_target": np.argwhere(room == 3),
        "boxes": np.argwhere(room == 4),
        "player": [p for p in np.argwhere(room == 5) if fixed[p[0], p[1]] != 2],
        "player_on_target": [p for p in np.argwhere(room == 5) if fixed[p[0], p[1]] == 2],
    }
    lines = [f"Board size: {fixed.shape[0]} rows x {fixed.shape[1]} cols (zero-indexed)."]
    for key, label in [("targets", "Targets"), ("boxes", "Boxes"), ("boxes_on_target", "Boxes on target"),
                       ("player", "Player"), ("player_on_target", "Player on target")]:
        if len(coords[key]):
            lines.append(f"{label}: " + ", ".join(f"({int(r)}, {int(c)})" for r, c in coords[key]))
    grid_room = np.where((room == 5) & (fixed == 2), 6, room)
    grid = "\n".join("".join(lookup[v] for v in row) for row in grid_room.tolist())
    return "Coordinates: \n" + "\n".join(lines) + "\n" + "Grid Map: \n" + grid


# ---------------------------------------------------------------------------------------------
# Shared compiled functions
# ---------------------------------------------------------------------------------------------
def rollout(params, seeds, steps):
    """Random play: actions uniform over 0..5 (0 and 5 are invalid ids), vmapped over seeds."""

    def one(seed):
        key = jax.random.key(seed)
        _, state = ENV.reset_env(jax.random.fold_in(key, 0), params)
        actions = jax.random.randint(jax.random.fold_in(key, 1), (steps,), 0, 6)

        def body(st, a):
            _, nxt, r, term, info = ENV.step_env(key, st, a, params)
            return nxt, (st, r, term)

        final, (states, rewards, terms) = jax.lax.scan(body, state, actions)
        return states, final, actions, rewards, terms

    return jax.vmap(one)(seeds)


@pytest.fixture(scope="module")
def play_6x6():
    out = jax.jit(rollout, static_argnums=2)(PARAMS, jnp.arange(48), 40)
    return jax.tree.map(np.asarray, out)


@pytest.fixture(scope="module")
def layer():
    return ENV.text_layer(CharTokenizer(), PARAMS)


def _state_at(states, i, t):
    return jax.tree.map(lambda x: x[i, t], states)


def test_rewards_and_transitions_match_reference_step(play_6x6):
    states, final, actions, rewards, terms = play_6x6
    num_envs, steps = actions.shape
    solved_runs = 0
    for i in range(num_envs):
        fixed = states.fixed[i, 0].tolist()
        boxes = [tuple(b) for b in np.argwhere(states.boxes[i, 0]).tolist()]
        player = tuple(states.player[i, 0].tolist())
        done = False
        total_ref, total = 0.0, 0.0
        for t in range(steps):
            a = int(actions[i, t])
            if done:  # a terminated episode stays as it is
                expected_boxes, expected_player, expected_r = set(boxes), player, 0.0
            else:
                expected_boxes, expected_player, expected_r, done = reference_step(fixed, boxes, player, a)
            nxt = _state_at(states, i, t + 1) if t + 1 < steps else jax.tree.map(lambda x: x[i], final)
            assert {tuple(b) for b in np.argwhere(nxt.boxes).tolist()} == expected_boxes
            assert tuple(nxt.player.tolist()) == expected_player
            assert rewards[i, t] == pytest.approx(expected_r, abs=1e-6)
            assert bool(terms[i, t]) == done
            boxes, player = list(expected_boxes), expected_player
            total_ref += expected_r
            total += float(rewards[i, t])
        assert total == pytest.approx(total_ref, abs=1e-4)
        solved_runs += done
    # Invalid ids 0 and 5 left time unchanged; valid ones counted (until termination).
    valid = (actions >= 1) & (actions <= 4)
    assert (final.time <= valid.sum(axis=1)).all()
    assert ((final.time == valid.sum(axis=1)) | final.terminated).all()


def test_invariants_over_random_play(play_6x6):
    states, final, _, rewards, _ = play_6x6
    fixed0 = states.fixed[:, :1]
    assert (states.fixed == fixed0).all(), "walls and targets never change"
    box_counts = states.boxes.sum(axis=(2, 3))
    assert (box_counts == 1).all(), "box count conserved"
    assert ((states.fixed == 2).sum(axis=(2, 3)) == 1).all(), "target count conserved"
    assert not (states.boxes & (states.fixed == 0)).any(), "no box in a wall"
    n, t = states.player.shape[:2]
    ii, tt = np.meshgrid(np.arange(n), np.arange(t), indexing="ij")
    pr, pc = states.player[..., 0], states.player[..., 1]
    assert (states.fixed[ii, tt, pr, pc] != 0).all(), "player never in a wall"
    assert not states.boxes[ii, tt, pr, pc].any(), "player never on a box"
    on_target = (states.boxes & (states.fixed == 2)).sum(axis=(2, 3))
    assert (states.boxes_on_target == on_target).all()
    assert (states.success == states.terminated).all()
    allowed = np.array([0.0, -0.1, 0.9, -1.1, 10.9])  # invalid/done, step, +1, -1, +1 +10
    assert (np.abs(rewards[..., None] - allowed).min(axis=-1) < 1e-5).all()


def _levels_from_maps(maps):
    """A Level pool from hand-written maps: '#' wall, '_' floor, 'O' target, 'X' box, 'P' player."""
    fixed, boxes, players = [], [], []
    for rows in maps:
        fixed.append([[{"#": 0, "O": 2}.get(ch, 1) for ch in row] for row in rows])
        boxes.append([[ch == "X" for ch in row] for row in rows])
        players.append([(r, row.index("P")) for r, row in enumerate(rows) if "P" in row][0])
    n = len(maps)
    return Level(
        fixed=jnp.asarray(fixed, jnp.int8), boxes=jnp.asarray(boxes), player=jnp.asarray(players, jnp.int32),
        solution_length=jnp.zeros((n,), jnp.int32), used_fallback=jnp.zeros((n,), bool),
    )


TWO_BOX_MAPS = [
    ["######", "#O_O_#", "#_X__#", "#__X_#", "#P___#", "######"],
    ["######", "#__#_#", "#OX__#", "#_XP_#", "#__O_#", "######"],
    ["######", "#P___#", "#_XX_#", "#____#", "#O__O#", "######"],
]


def test_multi_box_invariants_and_rewards():
    params = SokobanEnv.pool_params(_levels_from_maps(TWO_BOX_MAPS), SMALL_2BOX)
    states, final, actions, rewards, terms = jax.tree.map(
        np.asarray, jax.jit(rollout, static_argnums=2)(params, jnp.arange(24), 40)
    )
    assert (states.boxes.sum(axis=(2, 3)) == 2).all()
    assert ((states.fixed == 2).sum(axis=(2, 3)) == 2).all()
    assert not (states.boxes & (states.fixed == 0)).any()
    n, t = states.player.shape[:2]
    ii, tt = np.meshgrid(np.arange(n), np.arange(t), indexing="ij")
    assert not states.boxes[ii, tt, states.player[..., 0], states.player[..., 1]].any()
    for i in range(n):
        fixed = states.fixed[i, 0].tolist()
        boxes = [tuple(b) for b in np.argwhere(states.boxes[i, 0]).tolist()]
        player, done = tuple(states.player[i, 0].tolist()), False
        for step in range(t):
            if done:
                break
            boxes, player, r, done = reference_step(fixed, boxes, player, int(actions[i, step]))
            assert rewards[i, step] == pytest.approx(r, abs=1e-6)
    on_counts = (states.boxes & (states.fixed == 2)).sum(axis=(2, 3))
    assert (on_counts == 1).any(), "random play should move a box onto a target"


def test_solver_solution_succeeds_with_expected_return(play_6x6):
    """Replaying the BFS solution through step_env solves the level; return = 11 - 0.1 n (1 box)."""
    states = play_6x6[0]
    step = jax.jit(lambda s, a: ENV.step_env(jax.random.key(0), s, a, PARAMS))
    for i in range(6):
        state = _state_at(states, i, 0)  # the start state of seed i
        solution = solve(state.fixed, state.boxes, state.player)
        assert solution is not None and len(solution) == int(state.solution_length) <= 10
        total = 0.0
        for a in solution:
            _, state, r, term, _ = step(state, a)
            total += float(r)
        assert bool(term) and bool(state.success)
        assert total == pytest.approx(11.0 - 0.1 * len(solution), abs=1e-5)
        names = solution_names(_state_at(states, i, 0))
        assert names == [("Up", "Down", "Left", "Right")[a - 1] for a in solution]


def _hand_state(fixed_rows, boxes, player):
    """A state from a character map: '#' wall, '_' floor, 'O' target."""
    fixed = np.array([[{"#": 0, "_": 1, "O": 2}[ch] for ch in row] for row in fixed_rows], np.int8)
    box_grid = np.zeros(fixed.shape, bool)
    for b in boxes:
        box_grid[b] = True
    on = int((box_grid & (fixed == 2)).sum())
    return SokobanState(
        time=jnp.int32(0), terminated=jnp.bool_(on == len(boxes)), success=jnp.bool_(on == len(boxes)),
        fixed=jnp.asarray(fixed), boxes=jnp.asarray(box_grid), player=jnp.asarray(player, jnp.int32),
        boxes_on_target=jnp.int32(on), solution_length=jnp.int32(0),
    )


def test_render_text_matches_ragen_format_by_hand():
    rows = ["######", "#O___#", "#__O_#", "#____#", "#____#", "######"]
    state = _hand_state(rows, [(1, 1), (3, 2)], (2, 3))
    expected = (
        "Coordinates: \n"
        "Board size: 6 rows x 6 cols (zero-indexed).\n"
        "Targets: (1, 1), (2, 3)\n"
        "Boxes: (3, 2)\n"
        "Boxes on target: (1, 1)\n"
        "Player on target: (2, 3)\n"
        "Grid Map: \n"
        "######\n#√___#\n#__S_#\n#_X__#\n#____#\n######"
    )
    assert render_text(state) == expected


def test_device_render_equals_host_render(play_6x6, layer):
    states = play_6x6[0]
    n, t = states.time.shape
    flat = jax.tree.map(lambda x: x.reshape(n * t, *x.shape[2:]), states)
    tokens, lengths = jax.jit(jax.vmap(layer.render))(flat)
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    tok = layer.tokenizer
    seen_player_on_target = seen_box_on_target = False
    for k in range(0, n * t, 3):
        state = jax.tree.map(lambda x: x[k], flat)
        host = layer.render_text(state)
        assert host == ragen_grid_coord(state.fixed, state.boxes, state.player)
        assert tok.decode(tokens[k, : lengths[k]].tolist()) == host
        assert (tokens[k, lengths[k]:] == tok.pad_id).all()
        seen_player_on_target |= "Player on target" in host
        seen_box_on_target |= "Boxes on target" in host
    assert seen_box_on_target, "random play should reach a box-on-target state"


def test_device_render_with_two_boxes_and_every_list_shape():
    spec = SMALL_2BOX
    params = SokobanParams(spec=spec)
    layer = ENV.text_layer(CharTokenizer(), params)
    rows = ["######", "#O_O_#", "#____#", "#____#", "#____#", "######"]
    cases = [
        ([(2, 1), (2, 3)], (3, 3)),   # two boxes off target
        ([(1, 1), (2, 3)], (1, 3)),   # one on target, player on the other target
        ([(1, 1), (1, 3)], (4, 4)),   # both on target
    ]
    render = jax.jit(layer.render)
    for boxes, player in cases:
        state = _hand_state(rows, boxes, player)
        tokens, length = render(state)
        host = layer.render_text(state)
        assert host == ragen_grid_coord(state.fixed, state.boxes, state.player)
        assert layer.tokenizer.decode(np.asarray(tokens[:length]).tolist()) == host


def test_instruction_and_system_text(layer):
    ragen = (  # RAGEN config/envs.yaml CoordSokoban env_instruction, verbatim
        "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\n"
        "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. \n"
        "Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). \n"
        "When you are exactly next to a box, you can push it by moving in the same direction. \n"
        "You cannot push a box through a wall, and you cannot pull a box.\n"
        "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
    )
    assert instruction_text(SokobanSpec()) == ragen
    assert "(7, 7)" in instruction_text(SokobanSpec(rows=8, cols=8, num_boxes=2))
    system = layer.system_text()
    assert system.startswith("You're a helpful assistant. " + ragen)
    assert "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target" in system
    assert "Your available actions are:\nUp, Down, Left, Right\n" in system


def test_parse_maps_names_to_action_ids(layer):
    tok = layer.tokenizer
    texts = [
        ("plan</think><answer>Up || right</answer>", [1, 4], True),
        ("x</think> <answer>LEFT||Down||Up</answer>", [3, 2], True),  # at most 2 actions per turn
        ("x</think><answer>Jump || Down</answer>", [2], False),  # unknown name dropped
        ("no tags at all", [], False),
    ]
    width = 64
    batch = np.full((len(texts), width), tok.pad_id, np.int32)
    lengths = []
    for i, (text, _, _) in enumerate(texts):
        ids = tok.encode(text)
        batch[i, : len(ids)] = ids
        lengths.append(len(ids))
    parsed = jax.jit(jax.vmap(layer.parse))(jnp.asarray(batch), jnp.asarray(lengths))
    for i, (_, ids, ok) in enumerate(texts):
        n = int(parsed.n_valid[i])
        assert np.asarray(parsed.actions[i, :n]).tolist() == ids
        assert bool(parsed.format_ok[i]) == ok


def test_pool_reset_draws_levels_from_the_pool():
    pool = _levels_from_maps(TWO_BOX_MAPS)
    params = SokobanEnv.pool_params(pool, SMALL_2BOX)
    _, states = jax.jit(jax.vmap(ENV.reset_env, in_axes=(0, None)))(
        jax.random.split(jax.random.key(0), 32), params
    )
    pool_players = [tuple(p) for p in np.asarray(pool.player).tolist()]
    drawn = {pool_players.index(tuple(p)) for p in np.asarray(states.player).tolist()}
    assert drawn == {0, 1, 2}
    with pytest.raises(ValueError, match="make_level_pool"):
        SokobanEnv.pool_params(pool, SokobanSpec(rows=8, cols=8, num_boxes=2))


def test_reset_step_render_parse_trace_once_under_jit_vmap(layer):
    counts = {"reset": 0, "step": 0, "render": 0, "parse": 0}

    def counted(name, fn):
        def wrapped(*args):
            counts[name] += 1
            return fn(*args)
        return wrapped

    reset = jax.jit(jax.vmap(counted("reset", lambda k: ENV.reset_env(k, PARAMS))))
    step = jax.jit(jax.vmap(counted("step", lambda k, s, a: ENV.step_env(k, s, a, PARAMS))))
    render = jax.jit(jax.vmap(counted("render", layer.render)))
    parse = jax.jit(jax.vmap(counted("parse", layer.parse)))
    tok = layer.tokenizer
    batch = 4
    for round_ in range(3):
        keys = jax.random.split(jax.random.key(round_), batch)
        _, state = reset(keys)
        tokens, _ = render(state)
        text = tok.encode("a</think><answer>Left || Up</answer>")
        resp = jnp.asarray(np.tile(np.array(text + [tok.pad_id] * 8, np.int32), (batch, 1)))
        parsed = parse(resp, jnp.full((batch,), len(text) - round_))
        _, state, reward, _, _ = step(keys, state, parsed.actions[:, 0])
        jax.block_until_ready((tokens, reward))
    assert counts == {"reset": 1, "step": 1, "render": 1, "parse": 1}


def test_compact_render_device_equals_host_and_lists_every_piece():
    params = SokobanParams(spec=SMALL_2BOX)
    layer = ENV.text_layer(CharTokenizer(), params, prompt_style="compact")
    rows = ["######", "#O_O_#", "#____#", "#____#", "#____#", "######"]
    render = jax.jit(layer.render)
    expected = [
        "P (3, 3) X (2, 1), (2, 3) O (1, 1), (1, 3)",
        "S (1, 3) X (2, 3) \u221a (1, 1) O (1, 1), (1, 3)",
        "P (4, 4) \u221a (1, 1), (1, 3) O (1, 1), (1, 3)",
    ]
    for (boxes, player), first_line in zip(
        [([(2, 1), (2, 3)], (3, 3)), ([(1, 1), (2, 3)], (1, 3)), ([(1, 1), (1, 3)], (4, 4))], expected
    ):
        state = _hand_state(rows, boxes, player)
        host = layer.render_text(state)
        grid = ragen_grid_coord(state.fixed, state.boxes, state.player).split("Grid Map: \n")[1]
        assert host == first_line + "\n" + grid
        tokens, length = render(state)
        assert layer.tokenizer.decode(np.asarray(tokens[:length]).tolist()) == host
