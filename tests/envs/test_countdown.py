"""Countdown TextEnv: generator, solver, render, parse and step against plain-Python references."""

from __future__ import annotations

import collections
import itertools
import random
import re
import warnings
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.countdown import (
    RAGEN_INSTRUCTION,
    Countdown,
    CountdownAction,
    CountdownParams,
    CountdownState,
    check_params,
    generate_task,
)
from envs.countdown_solver import demonstration, solve, solve_add_sub
from ragen_jax.models.tokenizers import CharTokenizer

SPECIAL = ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]
RESPONSE_TOKENS = 96


# ----- plain-Python references ----------------------------------------------------------------------
def ragen_has_solution(nums: list[int], target: int) -> bool:
    """RAGEN's has_solution: +-n1 +-n2 ... == target."""
    return any(sum(s * n for s, n in zip(signs, nums)) == target for signs in itertools.product((1, -1), repeat=len(nums)))


def reachable(nums: list[int]) -> set[Fraction]:
    """Every value of an expression using each number exactly once (+ - * /), by subset DP."""
    n = len(nums)
    values: dict[int, set[Fraction]] = {1 << i: {Fraction(x)} for i, x in enumerate(nums)}
    for mask in range(1, 1 << n):
        if mask in values:
            continue
        out: set[Fraction] = set()
        sub = (mask - 1) & mask
        while sub:
            rest = mask ^ sub
            for a in values[sub]:
                for b in values[rest]:
                    out.update((a + b, a - b, a * b))
                    if b != 0:
                        out.add(a / b)
            sub = (sub - 1) & mask
        values[mask] = out
    return values[(1 << n) - 1]


def py_eval(s: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return eval(s, {"__builtins__": None}, {})
        except Exception:
            return None


def ragen_reward(action: str, nums: list[int], target: int) -> float:
    if sorted(int(x) for x in re.findall(r"\d+", action)) != sorted(nums):
        return 0.0
    value = py_eval(action)
    try:
        return 1.0 if abs(value - target) < 1e-5 else 0.1
    except Exception:
        return 0.1


def ragen_turn(response: str, nums: list[int], target: int, max_actions: int = 1):
    """RAGEN _parse_response + es_manager step for one Countdown turn -> (reward, format_ok)."""
    m = re.search(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", "<think>" + response, re.DOTALL)
    if not m:
        return 0.0, False
    content = m.group(2)
    for token in SPECIAL:
        content = content.replace(token, "").strip()
    actions = [a.strip() for a in content.split("||") if a.strip()][:max_actions]
    if not actions:
        return 0.0, False
    return ragen_reward(actions[0], nums, target), True


# ----- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env():
    return Countdown()


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="module")
def layer(env, tokenizer):
    """Exact RAGEN parsing for any response (no cost knobs)."""
    return env.text_layer(tokenizer, prompt_style="ragen", max_actions_per_turn=1, bytes_per_token=None, answer_window=None)


BATCH = 128


class Compiled:
    """jit(vmap(...)) of the env's device functions, shared by the tests, with trace counters."""

    def __init__(self, env, layer):
        self.counts = collections.Counter()
        self.params = env.default_params
        self.reset = jax.jit(jax.vmap(self._counted("reset", env.reset_env), in_axes=(0, None)))
        self.step = jax.jit(jax.vmap(self._counted("step", env.step_env), in_axes=(0, 0, 0, None)))
        self.render = jax.jit(jax.vmap(self._counted("render", layer.render)))
        self.parse = jax.jit(jax.vmap(self._counted("parse", layer.parse)))
        self.step_turn = jax.jit(jax.vmap(self._counted("step_turn", layer.step_turn)))

    def _counted(self, name, fn):
        def wrapper(*args):
            self.counts[name] += 1  # runs only while tracing
            return fn(*args)

        return wrapper

    def reset_batch(self, seed: int):
        return self.reset(jax.random.split(jax.random.PRNGKey(seed), BATCH), self.params)


@pytest.fixture(scope="module")
def compiled(env, layer):
    return Compiled(env, layer)


@pytest.fixture(scope="module")
def tasks(compiled):
    """Tasks of both generator modes: (params, numbers, counts, targets) as numpy, 512 each."""
    states = [compiled.reset_batch(seed)[1] for seed in range(4)]
    out = {
        True: (
            compiled.params,
            np.concatenate([np.asarray(s.numbers) for s in states]),
            np.concatenate([np.asarray(s.n_numbers) for s in states]),
            np.concatenate([np.asarray(s.target) for s in states]),
        )
    }
    params = CountdownParams(only_add_sub_solvable=False)
    keys = jax.random.split(jax.random.PRNGKey(7), 512)
    nums, n, t = jax.jit(jax.vmap(lambda k: generate_task(k, params)))(keys)
    out[False] = (params, np.asarray(nums), np.asarray(n), np.asarray(t))
    return out


# ----- generator ------------------------------------------------------------------------------------
@pytest.mark.parametrize("only_add_sub", [True, False])
def test_generated_tasks_are_valid_and_solvable(tasks, only_add_sub):
    params, nums, counts, targets = tasks[only_add_sub]
    assert set(np.unique(counts)) == {3, 4}
    for row, n, t in zip(nums, counts, targets):
        task = row[:n].tolist()
        assert all(params.min_number <= x <= params.max_number for x in task)
        assert np.all(row[n:] == 0)
        assert params.min_target <= t <= params.max_target
        if only_add_sub:
            assert ragen_has_solution(task, int(t))
    # The general mode: solvable with all four operations (checked on a subset; the DP is slower).
    if not only_add_sub:
        for row, n, t in list(zip(nums, counts, targets))[:60]:
            assert Fraction(int(t)) in reachable(row[:n].tolist())
        assert not all(ragen_has_solution(r[:n].tolist(), int(t)) for r, n, t in zip(nums, counts, targets))


def test_generator_is_deterministic_and_key_dependent(compiled):
    a = compiled.reset_batch(3)[1]
    b = compiled.reset_batch(3)[1]
    c = compiled.reset_batch(4)[1]
    same = lambda x, y: all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)))  # noqa: E731
    assert same(a, b)
    assert not np.array_equal(np.asarray(a.numbers), np.asarray(c.numbers))


def test_params_errors_name_the_fix():
    with pytest.raises(ValueError, match="widen the target range"):
        check_params(CountdownParams(min_target=1000, max_target=2000, max_number=9))
    with pytest.raises(ValueError, match="min_count"):
        check_params(CountdownParams(min_count=5, max_count=4))


# ----- solver ---------------------------------------------------------------------------------------
def test_solver_matches_exhaustive_reference():
    rng = random.Random(0)
    for _ in range(120):
        nums = [rng.randint(1, 30) for _ in range(rng.choice([3, 4]))]
        target = rng.randint(1, 100)
        eq = solve(nums, target)
        assert (eq is not None) == (Fraction(target) in reachable(nums)), (nums, target)
        if eq is not None:
            assert ragen_reward(eq, nums, target) == 1.0, (eq, nums, target)
        add_sub = solve(nums, target, only_add_sub=True)
        assert (add_sub is not None) == ragen_has_solution(nums, target)
        if add_sub is not None:
            assert set(re.sub(r"[\d ]", "", add_sub)) <= {"+", "-"}
            assert ragen_reward(add_sub, nums, target) == 1.0


def test_demonstration_is_input_dependent_and_correct():
    rng = random.Random(1)
    seen = set()
    for nums, target in [([3, 5, 2], 4), ([44, 19, 35], 98), ([6, 7, 8, 2], 52), ([25, 4, 7, 9], 907)]:
        think, answer = demonstration(nums, target, rng=rng)
        assert str(nums) in think and str(target) in think
        assert ragen_reward(answer, nums, target) == 1.0
        assert f"So the answer is {answer} = {target}." in think
        seen.add(think)
    assert len(seen) == 4
    assert demonstration([1, 1, 1], 100) is None
    assert solve_add_sub([3, 5, 2], 4).equation == "5 + 2 - 3"


# ----- text layer -----------------------------------------------------------------------------------
def decode(tokenizer, ids, length) -> str:
    return tokenizer.decode(np.asarray(ids[: int(length)]).tolist())


def test_system_prompt_is_ragen_instruction(layer):
    assert layer.system_text() == "You're a helpful assistant. " + RAGEN_INSTRUCTION


@pytest.mark.parametrize("default", [True, False])
def test_render_on_device_equals_render_text(env, tokenizer, layer, compiled, default):
    if default:
        _, states = compiled.reset_batch(11)
        ids, lengths = compiled.render(states)
    else:  # 1-5 numbers, targets up to 2000: other digit counts and list lengths
        params = CountdownParams(min_count=1, max_count=5, max_target=2000, only_add_sub_solvable=False)
        layer = env.text_layer(tokenizer, params=params)
        keys = jax.random.split(jax.random.PRNGKey(11), 32)
        states = jax.vmap(lambda k: env.reset_env(k, params)[1])(keys)
        ids, lengths = jax.jit(jax.vmap(layer.render))(states)
    for i in range(int(lengths.shape[0])):
        state = jax.tree.map(lambda x: x[i], states)
        n = int(state.n_numbers)
        expected = f"Target: {int(state.target)}, nums: {np.asarray(state.numbers)[:n].tolist()}"
        assert layer.render_text(state) == expected
        assert decode(tokenizer, ids[i], lengths[i]) == expected


def make_responses(seed: int, tasks, count: int):
    """(response text, nums, target) covering the format cases RAGEN's regex distinguishes."""
    rng = random.Random(seed)
    _, nums_all, counts, targets = tasks
    out = []
    for i in range(count):
        nums = nums_all[i % len(nums_all)][: counts[i % len(nums_all)]].tolist()
        target = int(targets[i % len(nums_all)])
        eq = solve(nums, target, only_add_sub=True)
        wrong = " - ".join(str(x) for x in nums)
        other = rng.choice([eq, wrong, f"{eq} = {target}", f"({eq}", f"{eq}\n", "", "  ", f"{nums[0]}"])
        templates = [
            f" let me think </think><answer>{other}</answer>",
            f"ok</think>\n <answer> {other} || {eq}</answer>",
            f"</think><answer>|| {other}</answer>",
            f"</think><answer>{other}<|im_end|></answer>",
            f"</think><answer>{other}",
            f"</think> x <answer>{other}</answer>",
            f"</think><answer>{other}</answer> trailing <answer>{eq}</answer>",
            f"</think><answer>{other} ||| {eq}</answer>",
        ]
        out.append((rng.choice(templates), nums, target))
    return out


def encode_responses(tokenizer, responses):
    ids = np.full((len(responses), RESPONSE_TOKENS), tokenizer.pad_id, np.int32)
    lengths = np.zeros((len(responses),), np.int32)
    for i, (text, _, _) in enumerate(responses):
        t = tokenizer.encode(text)[:RESPONSE_TOKENS]
        assert tokenizer.decode(t) == text, text
        ids[i, : len(t)] = t
        lengths[i] = len(t)
    return ids, lengths


def states_for(responses):
    size = len(responses)
    numbers = np.zeros((size, 4), np.int32)
    counts = np.zeros((size,), np.int32)
    for i, (_, nums, _) in enumerate(responses):
        numbers[i, : len(nums)] = nums
        counts[i] = len(nums)
    return CountdownState(
        time=jnp.zeros((size,), jnp.int32),
        terminated=jnp.zeros((size,), bool),
        success=jnp.zeros((size,), bool),
        numbers=jnp.asarray(numbers),
        n_numbers=jnp.asarray(counts),
        target=jnp.asarray([r[2] for r in responses], jnp.int32),
    )


def test_parse_and_step_turn_match_ragen_pipeline(tokenizer, compiled, tasks):
    rewards, formats, dones, times, successes, expected = [], [], [], [], [], []
    for seed in range(3):
        responses = make_responses(seed, tasks[True], BATCH)
        ids, lengths = encode_responses(tokenizer, responses)
        parsed = compiled.parse(ids, lengths)
        keys = jax.random.split(jax.random.PRNGKey(seed), BATCH)
        new_states, reward, done, info = compiled.step_turn(keys, states_for(responses), parsed)
        rewards.append(np.asarray(reward))
        formats.append(np.asarray(parsed.format_ok))
        dones.append(np.asarray(done))
        times.append(np.asarray(new_states.time))
        successes.append(np.asarray(info["success"]))
        expected += [ragen_turn(*r) for r in responses]
    want_reward = np.asarray([e[0] for e in expected], np.float32)
    want_format = np.asarray([e[1] for e in expected])
    np.testing.assert_array_equal(np.concatenate(formats), want_format)
    np.testing.assert_array_equal(np.concatenate(rewards), want_reward)
    np.testing.assert_array_equal(np.concatenate(successes), want_reward == 1.0)
    # An executed answer ends the episode; a turn without an action leaves the state unchanged.
    np.testing.assert_array_equal(np.concatenate(dones), want_format)
    np.testing.assert_array_equal(np.concatenate(times), want_format.astype(np.int32))
    for value in (0.0, 0.1, 1.0):
        assert np.sum(want_reward == value) >= 20, value
    assert np.sum(~want_format) >= 20


def test_windowed_parse_credits_only_answers_read_completely(env, tokenizer, tasks):
    """The text layer's default answer window (64 bytes): exact on answers it reads completely; an
    answer cut before its first piece is closed by "||" is an invalid turn (never credited)."""
    layer = env.text_layer(tokenizer, max_actions_per_turn=1)
    window = layer.answer_window
    responses = make_responses(3, tasks[True], BATCH - 32)
    rng = random.Random(3)
    _, nums_all, counts, targets = tasks[True]
    for i in range(32):
        nums, target = nums_all[i][: counts[i]].tolist(), int(targets[i])
        eq = solve(nums, target, only_add_sub=True)
        long_tail = rng.choice([" " * window, f" || {'x' * window}", f"{' ' * (window - len(eq) - 3)} || 1"])
        responses.append((f"</think><answer>{eq}{long_tail}</answer>", nums, target))
    ids, lengths = encode_responses(tokenizer, responses)
    parsed = jax.jit(jax.vmap(layer.parse))(ids, lengths)
    keys = jax.random.split(jax.random.PRNGKey(0), BATCH)
    _, reward, _, info = jax.jit(jax.vmap(layer.step_turn))(keys, states_for(responses), parsed)
    incomplete = 0
    for i, (text, nums, target) in enumerate(responses):
        answer = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
        content = "" if answer is None else answer.group(1)
        first_closed = "||" in content[:window] and content[:window].split("||")[0].strip()
        complete = answer is None or len(content) <= window or bool(first_closed)
        want_reward, want_format = ragen_turn(text, nums, target)
        incomplete += not complete
        if complete:
            assert np.float32(reward[i]) == np.float32(want_reward) and bool(parsed.format_ok[i]) == want_format, text
        else:
            assert int(parsed.n_valid[i]) == 0 and not bool(parsed.format_ok[i]) and float(reward[i]) == 0.0, text
    assert 5 <= incomplete <= 32


def test_gymnax_step_and_reset(env):
    params = env.default_params
    obs, state = env.reset(jax.random.PRNGKey(0), params)
    nums = np.asarray(state.numbers)[: int(state.n_numbers)].tolist()
    eq = solve(nums, int(state.target)).encode()
    text = np.zeros((params.max_action_bytes,), np.uint8)
    text[: len(eq)] = np.frombuffer(eq, np.uint8)
    action = CountdownAction(jnp.asarray(text), jnp.int32(len(eq)))
    obs2, state2, reward, terminated, truncated, info = env.step(jax.random.PRNGKey(1), state, action, params)
    assert float(reward) == 1.0 and bool(terminated)
    assert np.array_equal(np.asarray(info["final_observation"])[:2], [int(state.target), len(nums)])
    assert int(state2.time) == 0  # gymnax's step auto-resets a finished episode
    blank = CountdownAction(jnp.asarray(text), jnp.int32(0))
    _, state3, reward3, terminated3, _ = env.step_env(jax.random.PRNGKey(1), state, blank, params)
    assert float(reward3) == 0.0 and not bool(terminated3) and int(state3.time) == 0
    too_long = CountdownAction(jnp.asarray(text), jnp.int32(params.max_action_bytes + 1))
    _, _, reward4, _, info4 = env.step_env(jax.random.PRNGKey(1), state, too_long, params)
    assert float(reward4) == 0.0 and bool(info4["action_too_long"])


def test_reset_step_render_parse_trace_once(tokenizer, compiled, tasks):
    """Runs last in this module: every shared function was already called on other data."""
    for call in range(2):
        keys = jax.random.split(jax.random.PRNGKey(100 + call), BATCH)
        _, states = compiled.reset(keys, compiled.params)
        compiled.render(states)
        responses = make_responses(100 + call, tasks[True], BATCH)
        parsed = compiled.parse(*encode_responses(tokenizer, responses))
        compiled.step(keys, states, parsed.action, compiled.params)
        compiled.step_turn(keys, states, parsed)
    assert compiled.counts == {"reset": 1, "step": 1, "render": 1, "parse": 1, "step_turn": 1}
