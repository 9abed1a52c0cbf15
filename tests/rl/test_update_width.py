"""The update at the batch's bucket width, with remat, equals the update at the rollout's static width without.

``UpdateStep`` crops the right-padded rows to ``update_width`` before the jitted program. The batches are
``tests/test_update.make_traj``'s (12 rows, at most 14 tokens), right-padded to a static width of 64 as a
rollout's cache would leave them; the bucket width is then 16. The cropped and the full-width programs
differ only in how many masked keys (exactly zero softmax weight) and padding positions (zero loss weight)
they reduce over, so everything they compute is equal up to the reduction order of float32 sums
(tests/_tolerance.py), for every estimator, loss aggregation mode, the critic and the KL term.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ragen_jax.rl.losses import ActorLossConfig
from ragen_jax.rl.state import TrainState
from ragen_jax.rl.update import UpdateConfig, make_update_step, update_width
from ragen_jax.rollout.trajectories import TOKEN_FIELDS
from tests._tolerance import gamma
from tests.test_update import MIXED, S, copy_tree, make_traj, models, rel_diff, tiny_cfg  # noqa: F401 (fixture)

WIDE = 64
PAD_VALUES = {"turn_ids": -1}  # what finalize leaves past a row's length; every other field is 0 / False


def widen(traj, width: int = WIDE):
    """The same batch right-padded to ``width`` positions, as a rollout with a longer cache returns it."""
    extra = width - traj.seq_len
    pad = lambda name, x: jnp.pad(x, ((0, 0), (0, extra)), constant_values=PAD_VALUES.get(name, 0))  # noqa: E731
    return traj.replace(**{name: pad(name, getattr(traj, name)) for name in TOKEN_FIELDS})


BASE = UpdateConfig(adv_estimator="gae", mini_batch_size=4, micro_batch_size=2, group_size=S,
                    filter_strategy="top_p", filter_value=1.0, filter_include_zero=False)
KL = ActorLossConfig(agg_mode="seq-mean-token-sum", use_kl_loss=True, kl_coef=0.1, entropy_coeff=0.01)
CASES = {
    "gae-token-mean": BASE,
    "bilevel-gae-seq-mean-token-mean": dataclasses.replace(
        BASE, bi_level_gae=True, actor_loss=ActorLossConfig(agg_mode="seq-mean-token-mean"),
        critic_loss_agg_mode="seq-mean-token-mean"),
    "grpo-kl-seq-mean-token-sum": dataclasses.replace(BASE, adv_estimator="grpo", actor_loss=KL,
                                                      recompute_old_logprobs=True),
    "rloo-seq-mean-token-sum-norm": dataclasses.replace(
        BASE, adv_estimator="rloo", actor_loss=ActorLossConfig(agg_mode="seq-mean-token-sum-norm")),
}


def _step(models, config):
    # Plain SGD: each mini-batch moves the parameters by exactly -lr * gradient (see test_update's
    # micro-batch test for why Adam would turn last-bit gradient differences into lr-sized ones).
    critic = config.use_critic
    return make_update_step(models["a_graph"], models["c_graph"] if critic else None, config, optax.sgd(1e-2),
                            optax.sgd(1e-2) if critic else None)


def _run(step, models, traj):
    a = copy_tree(models["a_params"])
    c = copy_tree(models["c_params"]) if step.config.use_critic else None
    ref = jax.tree.map(lambda x: x * 1.01, models["a_params"]) if step.config.actor_loss.use_kl_loss else None
    state = TrainState(actor=a, critic=c, actor_opt=step.actor_tx.init(a),
                       critic_opt=step.critic_tx.init(c) if c is not None else None, ref=ref)
    return step(state, traj, jax.random.key(5))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bucketed_update_equals_full_width_update(models, name):
    config = CASES[name]
    traj = widen(make_traj(7, MIXED, models["logprob_fn"]))
    # width_buckets 8 (64 -> steps of 8: the longest row, 14, -> 16), with remat
    cropped_step = _step(models, dataclasses.replace(config, remat=True))
    full_step = _step(models, dataclasses.replace(config, width_buckets=1, remat=False))
    a, b = _run(cropped_step, models, traj), _run(full_step, models, traj)
    assert list(cropped_step.traces_by_width) == [16] and list(full_step.traces_by_width) == [WIDE]
    assert float(a.metrics["update/width"]) == 16.0 and float(b.metrics["update/width"]) == WIDE
    # Reductions of at most max(mini-batch positions, MLP width, attended keys) terms, through the stack
    # forward and backward; the full-width program's sums hold (WIDE / 16)x more (zero) terms.
    assert_same_update(a, b, models, config, WIDE, skip=("update/width", "update/rows_run"))


def assert_same_update(a, b, models, config, width: int, skip=()):
    """Two updates of the same batch from the same parameters agree (parameters moved, every metric but
    ``skip``) within the bound of reductions of at most max(mini-batch positions at ``width``, MLP width)
    float32 terms through the stack, forward and backward."""
    cfg = tiny_cfg()
    depth = 2 * (2 * cfg.num_layers + 1)
    tol = depth * 2 * gamma(max(config.mini_batch_size * width, cfg.intermediate_size))
    pairs = [(a.state.actor, b.state.actor, models["a_params"])]
    if config.use_critic:
        pairs.append((a.state.critic, b.state.critic, models["c_params"]))
    for params_a, params_b, start in pairs:
        delta_a = jax.tree.map(lambda x, y: x - y, params_a, start)
        delta_b = jax.tree.map(lambda x, y: x - y, params_b, start)
        assert rel_diff(delta_b, start) > 1e-4  # the step did change the parameters
        assert rel_diff(delta_a, delta_b) <= tol
    assert set(a.metrics) == set(b.metrics)
    for key in sorted(set(a.metrics) - set(skip)):
        x, y = float(a.metrics[key]), float(b.metrics[key])
        assert abs(x - y) <= tol * max(1.0, abs(y)), (key, x, y)


def test_each_bucket_width_compiles_once(models):
    """Batches whose longest rows fall in two buckets: two compiles, each width traced once."""
    step = _step(models, dataclasses.replace(BASE, adv_estimator="grpo"))
    short = widen(make_traj(1, MIXED))
    long = short.replace(valid=short.valid.at[0, :20].set(True), lengths=short.lengths.at[0].set(20))
    for traj in (short, long, short, long):
        out = _run(step, models, traj)
        assert np.isfinite(float(out.metrics["actor/pg_loss"]))
    assert step.traces_by_width == {16: 1, 24: 1} and step.traces == 1


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64, 2186, 3001])
@pytest.mark.parametrize("buckets", [1, 3, 8, 16])
def test_update_width_is_the_smallest_bucket_that_holds_the_longest_row(seq_len, buckets):
    step = -(-(-(-seq_len // buckets)) // 8) * 8  # ceil(seq_len / buckets), rounded up to a multiple of 8
    widths = sorted({min(seq_len, k * step) for k in range(1, seq_len + 1)})
    assert len(widths) <= buckets
    seen = set()
    for longest in range(0, seq_len + 1):
        w = update_width(longest, seq_len, buckets)
        seen.add(w)
        assert w in widths and w >= longest
        assert w == min(x for x in widths if x >= max(longest, 1))
    assert seen <= set(widths)
    assert update_width(seq_len, seq_len, buckets) == seq_len
    if buckets == 1:
        assert seen == {seq_len}
