"""Bandit: RAGEN's arm names and payoffs, state-dependent action names, text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from envs.bandit import ARM_NAMES, INIT_PROMPT, TEST_PAIRS, TRAIN_PAIRS, Bandit
from envs.registry import make
from ragen_jax.models.tokenizers import CharTokenizer

TOK = CharTokenizer()
R = 64


@pytest.fixture(scope="module")
def env():
    return Bandit()


@pytest.fixture(scope="module")
def params(env):
    return env.default_params


@pytest.fixture(scope="module")
def layer(env, params):
    return env.text_layer(TOK, params)


@pytest.fixture(scope="module")
def reset(env, params):
    return jax.jit(jax.vmap(lambda k: env.reset_env(k, params)[1]))


@pytest.fixture(scope="module")
def parse_and_step(env, params, layer):
    def run(key, state, tokens, length):
        parsed = layer.parse(tokens, length, state)
        new_state, reward, done, info = layer.step_turn(key, state, parsed)
        return parsed, new_state, reward, done, info

    return jax.jit(jax.vmap(run))


def answer_tokens(texts):
    tokens = np.zeros((len(texts), R), np.int32)
    lengths = np.zeros((len(texts),), np.int32)
    for i, text in enumerate(texts):
        ids = TOK.encode(text)
        tokens[i, : len(ids)] = ids
        lengths[i] = len(ids)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def test_names_are_ragens_pairs_in_random_order(reset):
    states = jax.tree.map(np.asarray, reset(jax.random.split(jax.random.PRNGKey(0), 4000)))
    pairs = set()
    for arms, high in zip(states.arms, states.high_action):
        names = (ARM_NAMES[arms[0]], ARM_NAMES[arms[1]])
        low_name, high_name = (names[1], names[0]) if high == 1 else names
        assert (low_name, high_name) in TRAIN_PAIRS
        pairs.add((low_name, high_name))
    assert pairs == set(TRAIN_PAIRS)
    # Order is a fair coin: high-risk arm first about half the time.
    assert stats.binomtest(int((states.high_action == 1).sum()), 4000, 0.5).pvalue > 1e-3


def test_test_split_uses_test_names(env):
    _, params = make("bandit", split="test")
    states = jax.jit(jax.vmap(lambda k: env.reset_env(k, params)[1]))(jax.random.split(jax.random.PRNGKey(1), 500))
    test_names = {name for pair in TEST_PAIRS for name in pair}
    assert {ARM_NAMES[i] for i in np.asarray(states.arms).reshape(-1)} == test_names
    with pytest.raises(ValueError, match="split"):
        env.reset_env(jax.random.PRNGKey(0), params.replace(split="val"))


def test_payoffs_and_success(reset, parse_and_step):
    n = 4000
    states = reset(jax.random.split(jax.random.PRNGKey(2), n))
    arms = np.asarray(states.arms)
    high = np.asarray(states.high_action)
    pick_high = np.arange(n) % 2 == 0
    chosen = np.where(pick_high, high, 3 - high)
    texts = [f"</think><answer>{ARM_NAMES[arms[i, chosen[i] - 1]]}</answer>" for i in range(n)]
    tokens, lengths = answer_tokens(texts)
    parsed, new, reward, done, info = jax.tree.map(
        np.asarray, parse_and_step(jax.random.split(jax.random.PRNGKey(3), n), states, tokens, lengths)
    )
    assert parsed.format_ok.all() and done.all() and (info["n_executed"] == 1).all()
    assert (info["success"] == pick_high).all()
    assert np.allclose(reward[~pick_high], 0.1)
    high_rewards = reward[pick_high]
    assert set(np.unique(high_rewards)) <= {0.0, 1.0}
    assert stats.binomtest(int(high_rewards.sum()), len(high_rewards), 0.25).pvalue > 1e-3


def test_names_are_case_insensitive_and_episode_specific(reset, parse_and_step):
    states = reset(jax.random.split(jax.random.PRNGKey(4), 8))  # batch 8 shares the render test's compile
    arms = np.asarray(states.arms)
    other = next(i for i in range(len(ARM_NAMES)) if i not in arms[1])
    texts = [
        f"x</think> <answer> {ARM_NAMES[arms[0, 1]].upper()} </answer>",
        f"</think><answer>{ARM_NAMES[other]}</answer>",  # an arm of another episode: invalid
        "</think><answer>arm 1</answer>",
    ] + ["no answer"] * 5
    tokens, lengths = answer_tokens(texts)
    parsed, new, reward, done, info = parse_and_step(jax.random.split(jax.random.PRNGKey(5), 8), states, tokens, lengths)
    assert np.asarray(parsed.actions[:3, 0]).tolist() == [2, 0, 0]
    assert np.asarray(parsed.n_parsed[:3]).tolist() == [1, 1, 1]
    assert np.asarray(parsed.format_ok[:3]).tolist() == [True, False, False]
    assert np.asarray(done[:3]).tolist() == [True, False, False]
    assert int(new.pulled[0]) == 2 and int(new.pulled[1]) == 0 and int(new.time[2]) == 0
    assert float(reward[1]) == 0.0 and not np.asarray(info["success"][1:]).any()


def test_parse_without_state_is_a_clear_error(layer):
    tokens, lengths = answer_tokens(["</think><answer>Teacher</answer>"])
    with pytest.raises(ValueError, match="state"):
        layer.parse(tokens[0], lengths[0])


def test_render_before_and_after_the_pull(env, params, layer, reset, parse_and_step):
    states = reset(jax.random.split(jax.random.PRNGKey(6), 8))
    arms = np.asarray(states.arms)
    texts = [f"</think><answer>{ARM_NAMES[arms[i, i % 2]]}</answer>" for i in range(8)]
    tokens, lengths = answer_tokens(texts)
    _, pulled, reward, _, _ = parse_and_step(jax.random.split(jax.random.PRNGKey(7), 8), states, tokens, lengths)
    compact = env.text_layer(TOK, params, prompt_style="compact")
    for lay in (layer, compact):  # the device render decodes to the host text in both styles
        render = jax.jit(jax.vmap(lay.render))
        for batch in (states, pulled):
            obs, n = render(batch)
            for i in range(8):
                state = jax.tree.map(lambda x: x[i], batch)
                assert TOK.decode(np.asarray(obs[i, : n[i]]).tolist()) == lay.render_text(state)
    first = jax.tree.map(lambda x: x[0], states)
    names = [ARM_NAMES[i] for i in arms[0]]
    assert layer.render_text(first) == INIT_PROMPT.format(name_a=names[0], name_b=names[1])
    after = layer.render_text(jax.tree.map(lambda x: x[0], pulled))
    assert after == f"{names[0]}: {float(reward[0]):.1f} points"
    assert layer.system_text() == "You're a helpful assistant. "
    assert compact.render_text(first) == (f"Arms: {names[0]}, {names[1]}. Pick the arm whose name suggests the "
                                          "higher average reward.")
    assert compact.render_text(jax.tree.map(lambda x: x[0], pulled)) == after
