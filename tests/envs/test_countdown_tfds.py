"""The Countdown TFDS builder builds and loads offline, without TensorFlow (array_record + data source)."""

from __future__ import annotations

import itertools
import re
import sys

import jax
import numpy as np
import pytest

from envs.countdown import CountdownParams, generate_task
from envs.countdown_tfds import Countdown, CountdownConfig, load_data_sources


def small_config(**overrides) -> CountdownConfig:
    settings = dict(name="small", train_size=24, validation_size=8, train_seed=5, validation_seed=6)
    settings.update(overrides)
    return CountdownConfig(**settings)


def as_lists(source) -> list[tuple[list[int], int, str]]:
    out = []
    for i in range(len(source)):
        ex = source[i]
        solution = ex["solution"].decode() if isinstance(ex["solution"], bytes) else str(ex["solution"])
        out.append((np.asarray(ex["numbers"]).tolist(), int(ex["target"]), solution))
    return out


def python_reward_is_one(solution: str, nums: list[int], target: int) -> bool:
    """RAGEN's check: the numbers of the equation are the task's multiset and eval hits the target."""
    if sorted(int(x) for x in re.findall(r"\d+", solution)) != sorted(nums):
        return False
    return abs(eval(solution, {"__builtins__": None}, {}) - target) < 1e-5


@pytest.fixture(scope="module")
def tf_was_loaded():
    return "tensorflow" in sys.modules


def test_builder_builds_and_loads_without_tensorflow(tmp_path, tf_was_loaded):
    config = small_config()
    sources = load_data_sources(str(tmp_path), config)
    assert (len(sources["train"]), len(sources["validation"])) == (24, 8)
    params = CountdownParams()
    reference = jax.jit(jax.vmap(lambda k: generate_task(k, params)))
    for split, seed, size in (("train", 5, 24), ("validation", 6, 8)):
        rows = as_lists(sources[split])
        # Example i is generate_task(fold_in(PRNGKey(seed), i)): deterministic, in generation order.
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(np.arange(size, dtype=np.uint32))
        want_nums, want_n, want_target = (np.asarray(x) for x in reference(keys))
        for i, (nums, target, solution) in enumerate(rows):
            assert nums == want_nums[i, : want_n[i]].tolist()
            assert target == int(want_target[i])
            assert python_reward_is_one(solution, nums, target), (solution, nums, target)
            assert set(re.sub(r"[\d ]", "", solution)) <= {"+", "-"}
            assert any(
                sum(s * n for s, n in zip(signs, nums)) == target
                for signs in itertools.product((1, -1), repeat=len(nums))
            )
    # The builder class is what users instantiate; a second builder reads the prepared files.
    again = Countdown(data_dir=str(tmp_path), config=config).as_data_source(split="train")
    assert as_lists(again) == as_lists(sources["train"])
    if not tf_was_loaded:
        assert "tensorflow" not in sys.modules


def test_builder_all_ops_config_and_errors(tmp_path, tf_was_loaded):
    config = small_config(name="small_all_ops", only_add_sub_solvable=False, train_size=6, validation_size=2)
    rows = as_lists(load_data_sources(str(tmp_path), config)["train"])
    assert len(rows) == 6
    for nums, target, solution in rows:
        assert python_reward_is_one(solution, nums, target), (solution, nums, target)
    with pytest.raises(ValueError, match="widen the target range"):
        load_data_sources(str(tmp_path / "bad"), small_config(name="bad", min_target=10_000, max_target=20_000))
    if not tf_was_loaded:
        assert "tensorflow" not in sys.modules
