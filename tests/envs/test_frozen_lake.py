"""FrozenLake: map generation, gymnasium parity (exact and in distribution), turns, text, traces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv
from scipy import stats

from envs.frozen_lake import FROZEN, GOAL, HOLE, START, FrozenLake, FrozenLakeState, to_desc
from envs.registry import make
from envs.solvers import frozen_lake_bfs
from envs.text import make_parsed
from ragen_jax.models.tokenizers import CharTokenizer

TOK = CharTokenizer()
GYM_4X4 = ["SFFF", "FHFH", "FFFH", "HFFG"]


@pytest.fixture(scope="module")
def env():
    return FrozenLake()


@pytest.fixture(scope="module")
def params(env):
    return env.default_params


TRACES = {"reset": 0, "step": 0, "render": 0, "render_turn": 0, "parse": 0}


def counted(name, fn):
    """jit(vmap(fn)) that counts how often JAX traces fn's Python body."""

    def wrapper(*args):
        TRACES[name] += 1
        return fn(*args)

    return jax.jit(jax.vmap(wrapper))


@pytest.fixture(scope="module")
def layer(env, params):
    return env.text_layer(TOK, params)


@pytest.fixture(scope="module")
def compiled(env, params, layer):
    return {
        "reset": counted("reset", lambda k: env.reset_env(k, params)[1]),
        "step": counted("step", lambda k, s, a: env.step_env(k, s, a, params)[1]),
        "render": counted("render", layer.render),
        "render_turn": counted("render_turn", layer.render_turn),
        "parse": counted("parse", layer.parse),
    }


@pytest.fixture(scope="module")
def batched_reset(compiled):
    return compiled["reset"]


def state_from_desc(desc, pos, time=0):
    code = {"F": FROZEN, "H": HOLE, "S": START, "G": GOAL}
    grid = jnp.asarray([[code[ch] for ch in row] for row in desc], jnp.int32)
    tile = int(grid.reshape(-1)[pos])
    return FrozenLakeState(
        time=jnp.int32(time), terminated=jnp.asarray(tile in (HOLE, GOAL)), success=jnp.asarray(tile == GOAL),
        grid=grid, pos=jnp.int32(pos),
    )


def test_every_map_of_10000_seeds_is_solvable_within_budget(batched_reset, params):
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(10_000))
    states = jax.tree.map(np.asarray, batched_reset(keys))
    lengths = []
    holes = cells = 0
    for grid, pos in zip(states.grid, states.pos):
        assert (grid == START).sum() == 1 and (grid == GOAL).sum() == 1
        start = divmod(int(np.flatnonzero(grid.reshape(-1) == START)[0]), 4)
        goal = divmod(int(np.flatnonzero(grid.reshape(-1) == GOAL)[0]), 4)
        assert divmod(int(pos), 4) == start
        path = frozen_lake_bfs(grid, start, goal)
        assert path is not None and 1 <= len(path) <= params.max_actions
        lengths.append(len(path))
        holes += int((grid == HOLE).sum())
        cells += 14
    assert (states.time == 0).all() and not states.terminated.any()
    # Holes appear with probability about 0.1 (slightly less: unsolvable maps are redrawn).
    assert 0.07 < holes / cells < 0.105
    assert len(set(lengths)) > 4  # varied difficulty


def test_solver_paths_reach_the_goal_in_gymnasium(batched_reset):
    states = jax.tree.map(np.asarray, batched_reset(jax.vmap(jax.random.PRNGKey)(jnp.arange(200) + 77)))
    for grid in states.grid:
        desc = to_desc(grid)
        start = divmod(int(np.flatnonzero(grid.reshape(-1) == START)[0]), 4)
        goal = divmod(int(np.flatnonzero(grid.reshape(-1) == GOAL)[0]), 4)
        path = frozen_lake_bfs(desc, start, goal)
        gym_env = FrozenLakeEnv(desc=desc, is_slippery=False)
        gym_env.reset(seed=0)
        for i, action in enumerate(path):
            s, reward, terminated, _, _ = gym_env.step(action - 1)
            assert terminated == (i == len(path) - 1)
        assert reward == 1 and divmod(s, 4) == goal


@pytest.mark.parametrize("gym_kwargs", [{"is_slippery": False}, {"is_slippery": True, "success_rate": 1.0}])
def test_deterministic_transitions_equal_gymnasium(env, params, batched_reset, gym_kwargs):
    num_maps, steps = 48, 14
    states = batched_reset(jax.vmap(jax.random.PRNGKey)(jnp.arange(num_maps) + 5000))
    actions = np.random.default_rng(0).integers(0, 6, (num_maps, steps))  # 0 and 5 are invalid ids

    def play(state, acts, key):
        def one(s, inputs):
            a, k = inputs
            _, s, r, term, _ = env.step_env(k, s, a, params)
            return s, (s.pos, r, term)

        return jax.lax.scan(one, state, (acts, jax.random.split(key, steps)))[1]

    keys = jax.random.split(jax.random.PRNGKey(1), num_maps)
    pos, rew, term = jax.tree.map(np.asarray, jax.jit(jax.vmap(play))(states, jnp.asarray(actions), keys))
    for m in range(num_maps):
        gym_env = FrozenLakeEnv(desc=to_desc(np.asarray(states.grid[m])), **gym_kwargs)
        s, _ = gym_env.reset(seed=m)
        done, r = False, 0.0
        for t, a in enumerate(actions[m]):
            if 1 <= a <= 4:
                s, r, done, _, _ = gym_env.step(int(a) - 1)
            else:
                r = 0.0  # invalid id: nothing happens
            assert (pos[m, t], rew[m, t], term[m, t]) == (s, r, done), (m, t, a)


@pytest.mark.parametrize("success_rate", [0.8, 1.0 / 3.0])
def test_slippery_transitions_match_gymnasium_in_distribution(env, success_rate):
    params = env.default_params.replace(success_rate=success_rate)
    gym_env = FrozenLakeEnv(desc=GYM_4X4, is_slippery=True, success_rate=success_rate)
    gym_env.reset(seed=0)
    samples = 3000
    step = jax.jit(jax.vmap(lambda k, s, a: env.step_env(k, s, a, params)[1].pos, in_axes=(0, None, None)))
    rng = np.random.default_rng(0)
    for pos, action in [(0, 3), (6, 1), (9, 2), (14, 3), (4, 4), (10, 1)]:
        state = state_from_desc(GYM_4X4, pos)
        ours = np.bincount(np.asarray(step(jax.random.split(jax.random.PRNGKey(pos * 10 + action), samples), state, action)), minlength=16)
        expected = np.zeros(16)
        for prob, nxt, _, _ in gym_env.unwrapped.P[pos][action - 1]:
            expected[nxt] += prob
        assert ours[expected == 0].sum() == 0
        support = expected > 0
        assert stats.chisquare(ours[support], expected[support] * samples).pvalue > 1e-3
        # Two-sample check against gymnasium's own sampler.
        theirs = np.zeros(16, int)
        gym_env.unwrapped.np_random = np.random.default_rng(rng.integers(1 << 30))
        for _ in range(samples):
            gym_env.unwrapped.s = pos
            theirs[gym_env.step(action - 1)[0]] += 1
        if support.sum() > 1:
            table = np.stack([ours[support], theirs[support]])
            assert stats.chi2_contingency(table).pvalue > 1e-3


def test_invariants_over_random_play(env, params, batched_reset):
    batch, steps = 128, 24
    states = batched_reset(jax.vmap(jax.random.PRNGKey)(jnp.arange(batch) + 123))
    actions = jnp.asarray(np.random.default_rng(3).integers(-2, 8, (batch, steps)))
    slippery = params.replace(success_rate=0.6)

    def play(state, acts, key):
        def one(s, inputs):
            a, k = inputs
            _, nxt, r, _, _ = env.step_env(k, s, a, slippery)
            return nxt, (nxt, r)

        return jax.lax.scan(one, state, (acts, jax.random.split(key, steps)))[1]

    traj, rewards = jax.jit(jax.vmap(play))(states, actions, jax.random.split(jax.random.PRNGKey(9), batch))
    traj, rewards, actions = jax.tree.map(np.asarray, (traj, rewards, actions))
    grid0 = np.asarray(states.grid)
    for b in range(batch):
        prev_time, prev_term, prev_pos = 0, False, int(states.pos[b])
        for t in range(steps):
            grid, pos = traj.grid[b, t], int(traj.pos[b, t])
            tile = grid.reshape(-1)[pos]
            assert (grid == grid0[b]).all() and 0 <= pos < 16
            valid = 1 <= actions[b, t] <= 4 and not prev_term
            assert traj.time[b, t] == prev_time + valid
            assert traj.terminated[b, t] == (tile in (HOLE, GOAL))
            assert traj.success[b, t] == (tile == GOAL)
            assert rewards[b, t] == float(valid and tile == GOAL)
            if not valid:
                assert pos == prev_pos
            else:  # a move changes row or column by at most one
                (r0, c0), (r1, c1) = divmod(prev_pos, 4), divmod(pos, 4)
                assert abs(r0 - r1) + abs(c0 - c1) <= 1
            prev_time, prev_term, prev_pos = int(traj.time[b, t]), bool(traj.terminated[b, t]), pos
        assert rewards[b].sum() <= 1


def turn(env, params, state, actions, n_parsed=None, key=0):
    acts = jnp.asarray(list(actions) + [0] * (2 - len(actions)), jnp.int32)
    n = len(actions)
    parsed = make_parsed(acts, jnp.int32(n), jnp.int32(n if n_parsed is None else n_parsed), jnp.asarray(True))
    return jax.jit(lambda s, p: env.step_turn(jax.random.PRNGKey(key), s, p, params))(state, parsed)


def test_step_turn_applies_in_order_and_stops_at_done(env, params):
    # Right to (0, 1), then Down into the hole at (1, 1): done, reward 0.
    state, reward, done, info = turn(env, params, state_from_desc(GYM_4X4, 0), [3, 2])
    assert (int(state.pos), float(reward), bool(done), int(info["n_executed"])) == (5, 0.0, True, 2)
    assert not bool(info["success"]) and int(info["actions_left"]) == 8
    # Right onto the goal from (3, 2); the following Left is not executed.
    state, reward, done, info = turn(env, params, state_from_desc(GYM_4X4, 14), [3, 1])
    assert (int(state.pos), float(reward), bool(done), int(info["n_executed"])) == (15, 1.0, True, 1)
    assert bool(info["success"]) and int(state.time) == 1


def test_step_turn_without_valid_actions_leaves_state_unchanged(env, params):
    start = state_from_desc(GYM_4X4, 2, time=4)
    state, reward, done, info = turn(env, params, start, [], n_parsed=2)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state, start))
    assert float(reward) == 0.0 and not bool(done) and int(info["n_executed"]) == 0 and not bool(info["format_ok"])


def test_step_turn_respects_the_action_budget(env, params):
    state, _, done, info = turn(env, params, state_from_desc(GYM_4X4, 0, time=9), [3, 3])
    assert int(info["n_executed"]) == 1 and int(state.pos) == 1 and int(state.time) == 10
    assert bool(done) and not bool(info["success"]) and int(info["actions_left"]) == 0


def test_render_text_is_ragen_grid_coord(env, params):
    layer = env.text_layer(TOK, params)
    expected = (
        "Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\nStart: (0, 0)\nGoal: (3, 3)\n"
        "Player: (0, 0)\nHoles: (1, 1), (1, 3), (2, 3), (3, 0)\nGrid Map: \nP___\n_O_O\n___O\nO__G"
    )
    assert layer.render_text(state_from_desc(GYM_4X4, 0)) == expected
    assert layer.render_text(state_from_desc(GYM_4X4, 5)).endswith("Player in hole: (1, 1)\nHoles: (1, 1), (1, 3), (2, 3), (3, 0)\nGrid Map: \n____\n_X_O\n___O\nO__G")
    on_goal = layer.render_text(state_from_desc(["GFFF", "FFFF", "FFFF", "FFFS"], 0))
    assert "Player on goal: (0, 0)\nGrid Map: \n\u221a___" in on_goal and "Holes" not in on_goal


def test_system_text_is_ragens(env, params):
    expected = (
        "You're a helpful assistant. You are solving the FrozenLake puzzle. The observation includes both a symbol "
        "grid and zero-indexed coordinates for the start, goal, player, and any holes.\nCoordinates range from the "
        "top-left corner (0, 0) to the bottom-right corner (5, 5).\nBeware that the ice is slippery, so the agent "
        "might slide and end up in an unintended tile.\nRespond with a sequence of actions such as "
        "<answer>Left || Up || Up</answer>.\n\nThe meaning of each symbol in the state is:\nP: player, _: empty, "
        "O: hole, G: goal, X: player in hole, \u221a: player on goal\nYour available actions are:\nLeft, Down, Right, "
        "Up\nYou can make up to 10 actions, separated by the action separator \" || \"\n"
    )
    layer = env.text_layer(TOK, params)
    assert layer.system_text() == expected
    assert TOK.decode(layer.system_tokens().tolist()) == expected
    assert len(env.text_layer(TOK, params, prompt_style="compact").system_text()) < len(expected) // 2


@pytest.mark.parametrize("style", ["ragen", pytest.param("compact", marks=pytest.mark.slow)])
def test_device_render_decodes_to_render_text(env, params, compiled, style):
    layer = env.text_layer(TOK, params, prompt_style=style)
    if style == "ragen":
        render, render_turn = compiled["render"], compiled["render_turn"]
    else:
        render, render_turn = jax.jit(jax.vmap(layer.render)), jax.jit(jax.vmap(layer.render_turn))
    batch = 48
    states = compiled["reset"](jax.vmap(jax.random.PRNGKey)(jnp.arange(batch)))
    # Random play so that players also sit in holes and on goals.
    for t, a in enumerate(np.random.default_rng(5).integers(1, 5, (6, batch))):
        states = compiled["step"](jax.random.split(jax.random.PRNGKey(t), batch), states, jnp.asarray(a, jnp.int32))
    turns = jnp.arange(batch) % 5 + 1
    warn = jnp.arange(batch) % 2 == 0
    rewards = jnp.asarray(np.random.default_rng(6).choice([0.0, 1.0, 2.0, -1.0], batch), jnp.float32)
    obs, obs_n = render(states)
    turn_tok, turn_n = render_turn(states, turns, warn)
    rew_tok, rew_n = jax.jit(jax.vmap(layer.render_reward))(rewards)
    assert obs.shape[1] == layer.obs_len
    kinds = set()
    for b in range(batch):
        state = jax.tree.map(lambda x: x[b], states)
        text = layer.render_text(state)
        kinds.add(text.split("\n")[4].split(":")[0] if style == "ragen" else text.split(" (")[0])
        assert TOK.decode(np.asarray(obs[b, : obs_n[b]]).tolist()) == layer.render_text(state)
        assert TOK.decode(np.asarray(turn_tok[b, : turn_n[b]]).tolist()) == layer.turn_text(state, int(turns[b]), bool(warn[b]))
        assert TOK.decode(np.asarray(rew_tok[b, : rew_n[b]]).tolist()) == layer.reward_text(float(rewards[b]))
    assert kinds == ({"Player", "Player in hole", "Player on goal"} if style == "ragen" else {"P", "P in O", "P on G"})


def test_ragen_turn_text(env, params):
    layer = env.text_layer(TOK, params)
    state = state_from_desc(GYM_4X4, 0, time=3)
    text = layer.turn_text(state, 2, warning=True)
    assert text.startswith("\nTurn 2:\nState:\nCoordinates: \n")
    assert text.endswith(
        "O__G\nNo valid action provided previously. Environment state remains the same. Please try again.\n"
        "You have 7 actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> "
        "with no extra text. Strictly follow this format. Max response length: 120 words (tokens).\n"
    )
    assert layer.reward_text(1.0) == "Reward:\n1\n"


def test_each_function_traced_once_under_jit_vmap(compiled):
    response = TOK.encode("hm</think><answer>Left || Up</answer>")
    tokens = np.zeros((4, 64), np.int32)
    tokens[:, : len(response)] = response
    before, first = dict(TRACES), None
    for i in range(4):
        keys = jax.random.split(jax.random.PRNGKey(i), 4)
        states = compiled["reset"](keys)
        states = compiled["step"](keys, states, jnp.full((4,), i + 1, jnp.int32))
        compiled["render"](states)[0].block_until_ready()
        compiled["render_turn"](states, jnp.full((4,), i + 1), jnp.full((4,), i == 1))[0].block_until_ready()
        compiled["parse"](jnp.asarray(tokens), jnp.full((4,), len(response) - i, jnp.int32)).actions.block_until_ready()
        first = dict(TRACES) if first is None else first
    # The shared functions may already have been traced for other batch sizes by other tests: at most
    # one new trace for this shape, and none after the first call.
    assert all(first[name] - before[name] <= 1 for name in TRACES)
    assert TRACES == first


def test_registry(env):
    made, params = make("frozen_lake", success_rate=0.8)
    assert isinstance(made, FrozenLake) and params.success_rate == 0.8 and params.max_actions == 10
    with pytest.raises(ValueError, match="success_rate"):
        make("frozen_lake", slip=0.2)
    with pytest.raises(ValueError, match="registered envs"):
        make("frozen_pond")
