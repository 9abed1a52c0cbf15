"""The host-env bridge: envs in worker processes give the fused rollout's trajectories token for token;
a hung, raising or dying env ends its own episode only (error kind + penalty), the pool heals itself."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np
import pytest

from _host_envs import FaultyGuess
from envs.frozen_lake import FrozenLake
from ragen_jax.rollout.fused import Rollout
from ragen_jax.rollout.host_envs import TextEnvHostFactory
from ragen_jax.rollout.host_pool import CRASH, EXCEPTION, NO_ERROR, TIMEOUT, Failure, HostEnvPool, InProcessEnvs
from ragen_jax.rollout.host_stepped import HostRollout
from ragen_jax.rollout.layout import RolloutConfig
from test_rollout import ANSWER_CHAIN, SEEDS, TOK, assert_same, bigram_table, config, model, policy  # noqa: F401

PENALTY = -0.5


def test_frozen_lake_in_worker_processes_equals_the_fused_rollout(model):
    """TextEnvHost rows in 2 spawned workers == the on-device fused rollout (same layout, same keys),
    through the on-device env's Rollout (training with rollout.host_workers) and through HostRollout."""
    cfg = config()
    params = policy(model, bigram_table(ANSWER_CHAIN, 8.0))
    factory = TextEnvHostFactory("frozen_lake", TOK, {}, cfg.prompt_style, cfg.max_actions_per_turn,
                                 cfg.max_new_tokens)
    with HostEnvPool(factory, num_workers=2, timeout_s=120.0) as pool:
        lake = Rollout(model, TOK, FrozenLake(), cfg, host_envs=pool)
        pooled = HostRollout(model, TOK, factory, cfg, envs=pool, layout=lake.layout)
        for k, run_host in ((7, lambda key: lake.run(params, key, SEEDS, mode="host")),
                            (8, lambda key: pooled.run(params, key, SEEDS))):
            key = jax.random.key(k)
            fused, host = lake.run(params, key, SEEDS), run_host(key)
            assert_same(fused, host)
            ok = np.asarray(fused.turn_format_ok)[np.asarray(fused.turn_active)]
            assert ok.any() and (~ok).any()  # valid and invalid turns, early-finishing rows
        assert pool.errors == {"timeout": 0, "exception": 0, "crash": 0} and pool.restarts == 0


FAULTS = {100: ("hang", 2), 101: ("raise", 1), 102: ("exit", 2), 105: ("reset_raise", 0)}


def guess_config(**kw) -> RolloutConfig:
    base = dict(n_groups=6, group_size=1, max_turns=3, max_new_tokens=12, prompt_style="compact",
                max_user_tokens=48, mode="host", host_error_penalty=PENALTY)
    return RolloutConfig(**{**base, **kw})


def rows(traj, index):
    return jax.tree.map(lambda x: np.asarray(x)[index], traj)


def test_faults_end_their_own_episode_only_and_the_pool_heals(model):
    cfg = guess_config()
    params = policy(model, None)
    key = jax.random.key(3)
    seeds = np.arange(100, 106, dtype=np.int32)
    clean = HostRollout(model, TOK, FaultyGuess, cfg)  # in process, no faults: the reference
    with HostEnvPool(functools.partial(FaultyGuess, faults=FAULTS), num_workers=2, timeout_s=2.0) as pool:
        rollout = HostRollout(model, TOK, FaultyGuess, cfg, envs=pool)
        pids = pool.worker_pids()
        start = time.perf_counter()
        traj = rollout.run(params, key, seeds).to_numpy()
        elapsed = time.perf_counter() - start
        ref = clean.run(params, key, seeds).to_numpy()
        # Rows 0-2 fail in step (hang at turn 2, raise at turn 1, os._exit at turn 2), row 5 at reset.
        assert list(traj.host_error) == [TIMEOUT, EXCEPTION, CRASH, NO_ERROR, NO_ERROR, EXCEPTION]
        assert list(traj.num_turns) == [2, 1, 2, 3, 3, 0]
        for row, turn in ((0, 1), (1, 0), (2, 1)):
            assert traj.turn_penalties[row, turn] == PENALTY and traj.turn_rewards[row, turn] == 0
            assert traj.turn_active[row, turn] and not traj.turn_active[row, turn + 1:].any()
            assert traj.loss_mask[row].any()  # the failed turn's response is kept
            np.testing.assert_array_equal(traj.tokens[row, :traj.lengths[row]], ref.tokens[row, :traj.lengths[row]])
        assert traj.lengths[5] == 0 and traj.episode_reward[5] == 0
        assert_same(rows(traj, slice(3, 5)), rows(ref, slice(3, 5)))  # row 4 shared worker 0 with 2 faults
        assert pool.errors == {"timeout": 1, "exception": 2, "crash": 1} and pool.restarts == 2
        new_pids = pool.worker_pids()
        assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
        assert elapsed < 60, elapsed
        # The next rollout runs on the replaced worker as if nothing happened.
        seeds = np.arange(200, 206, dtype=np.int32)
        assert_same(rollout.run(params, key, seeds), clean.run(params, key, seeds))
        assert pool.restarts == 2


def test_in_process_envs_catch_exceptions():
    envs = InProcessEnvs(functools.partial(FaultyGuess, faults={1: ("raise", 1), 2: ("reset_raise", 0)}))
    starts = envs.reset([0, 1, 2])
    assert isinstance(starts[2], Failure) and starts[2].kind == EXCEPTION and "cannot reset" in starts[2].message
    steps = envs.step({0: "<answer>3</answer>", 1: "x"})
    assert not isinstance(steps[0], Failure)
    assert isinstance(steps[1], Failure) and steps[1].kind == EXCEPTION and "sandbox" in steps[1].message
    with pytest.raises(ValueError):  # the reference (given instances, catch=False) lets bugs through
        bad = InProcessEnvs(envs=[FaultyGuess({1: ("raise", 1)})], catch=False)
        bad.reset([1])
        bad.step({0: "x"})


def test_pool_refuses_an_unpicklable_factory():
    with pytest.raises(ValueError, match="picklable"):
        HostEnvPool(lambda: FaultyGuess(), num_workers=1, timeout_s=1.0)


def test_limited_window_with_a_pool(model):
    """The limited-context host rollout takes the same env batch."""
    cfg = guess_config(n_groups=2, context_mode="limited", context_window=2)
    params = policy(model, None)
    seeds = np.array([100, 103], np.int32)
    with HostEnvPool(functools.partial(FaultyGuess, faults=FAULTS), num_workers=1, timeout_s=2.0) as pool:
        traj = HostRollout(model, TOK, FaultyGuess, cfg, envs=pool).run(params, jax.random.key(0), seeds).to_numpy()
    ref = HostRollout(model, TOK, FaultyGuess, cfg).run(params, jax.random.key(0), seeds).to_numpy()
    # Sample rows: episode * T + turn; episode 0 hangs at turn 2.
    assert list(traj.host_error) == [TIMEOUT] * 3 + [NO_ERROR] * 3
    assert_same(rows(traj, slice(3, 6)), rows(ref, slice(3, 6)))
    assert dataclasses.is_dataclass(traj)
