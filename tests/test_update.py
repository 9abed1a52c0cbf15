"""The fused update step: micro-batch accumulation, filtering, copy-padding, PPO gradient, NaN guard, traces.

Batches are hand-built with ``trajectories.finalize``: G = 4 groups x S = 3 samples, L = 16 tokens, a
random prompt then a random response (the loss mask), right padding. Rewards are chosen per test.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ragen_jax.models.critic import Critic
from ragen_jax.models.config import get_preset
from ragen_jax.models.logprobs import sequence_logprobs
from ragen_jax.models.transformer import Transformer
from ragen_jax.rl.optim import make_optimizer
from ragen_jax.rl.losses import ActorLossConfig, actor_loss_terms
from ragen_jax.rollout.trajectories import finalize
from ragen_jax.rl.state import TrainState
from ragen_jax.rl.update import UpdateConfig, make_update_step, plan_minibatches
from tests._tolerance import gamma

G, S, L = 4, 3, 16
R = G * S


def tiny_cfg():
    return get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16)


def make_traj(seed: int, rewards, logprob_fn=None, vocab: int = 264):
    """A finalized Trajectories batch with per-row rewards f32[R] (one turn per row)."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((R, L), np.int32)
    valid = np.zeros((R, L), bool)
    loss_mask = np.zeros((R, L), bool)
    for b in range(R):
        p, r = rng.integers(3, 7), rng.integers(2, 8)
        tokens[b, : p + r] = rng.integers(8, vocab, p + r)
        valid[b, : p + r] = True
        loss_mask[b, p : p + r] = True
    if logprob_fn is None:
        logprobs = np.where(loss_mask, -rng.uniform(0.5, 6.0, (R, L)), 0.0).astype(np.float32)
    else:
        logprobs = np.where(loss_mask, np.asarray(logprob_fn(tokens, valid)), 0.0).astype(np.float32)
    z = lambda dtype: np.zeros((R, 1), dtype)
    return finalize(
        tokens=jnp.asarray(tokens), valid=jnp.asarray(valid), loss_mask=jnp.asarray(loss_mask),
        logprobs=jnp.asarray(logprobs), entropy=jnp.zeros((R, L)), turn_ids=jnp.zeros((R, L), jnp.int32),
        reasoning_mask=jnp.zeros((R, L), bool), prompt_spans=jnp.zeros((R, 1, 2), jnp.int32),
        turn_active=jnp.ones((R, 1), bool), turn_rewards=jnp.asarray(np.asarray(rewards, np.float32)[:, None]),
        turn_penalties=jnp.asarray(z(np.float32)), turn_format_ok=jnp.ones((R, 1), bool),
        turn_valid_actions=jnp.asarray(z(np.int32)), turn_executed=jnp.asarray(z(np.int32)),
        response_lengths=jnp.asarray(loss_mask.sum(1, keepdims=True).astype(np.int32)),
        success=jnp.zeros(R, bool), group_ids=jnp.repeat(jnp.arange(G), S), seeds=jnp.repeat(jnp.arange(G), S),
        episode_ids=jnp.arange(R), sample_turn=jnp.full(R, -1),
    )


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def to_np(tree):
    return jax.tree.map(np.asarray, tree)


def rel_diff(a, b) -> float:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = math.sqrt(sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
                        for x, y in zip(la, lb)))
    den = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in la))
    return num / den


def trees_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def models():
    actor = Transformer(tiny_cfg(), rngs=nnx.Rngs(0))
    critic = Critic.from_actor(actor, nnx.Rngs(1))
    # A nonzero head, so the values (and the critic's gradient paths) are not trivially zero.
    critic.value_head.kernel.set_value(0.05 * jax.random.normal(jax.random.key(2), critic.value_head.kernel.shape))
    a_graph, a_params = nnx.split(actor)
    c_graph, c_params = nnx.split(critic)
    logprob_fn = jax.jit(lambda t, v: sequence_logprobs(nnx.merge(a_graph, a_params), t, v)[0])
    return dict(actor=actor, a_graph=a_graph, a_params=a_params, c_graph=c_graph, c_params=c_params,
                logprob_fn=logprob_fn)


PPO = UpdateConfig(adv_estimator="gae", mini_batch_size=4, micro_batch_size=2, group_size=S,
                   filter_strategy="top_p", filter_value=1.0, filter_include_zero=False)


def _ppo_step(models, config):
    return make_update_step(models["a_graph"], models["c_graph"], config, make_optimizer(1e-3),
                            make_optimizer(1e-3))


@pytest.fixture(scope="module")
def ppo_step(models):
    return _ppo_step(models, PPO)


def run(step, models, traj, key=0, ref=None):
    """One update from the models' initial parameters; returns UpdateResult(state, metrics)."""
    a, c = copy_tree(models["a_params"]), copy_tree(models["c_params"])
    a_opt, c_opt = step.actor_tx.init(a), (step.critic_tx.init(c) if step.critic_tx else None)
    if not step.config.use_critic:
        c = None
    state = TrainState(actor=a, critic=c, actor_opt=a_opt, critic_opt=c_opt, ref=ref)
    return step(state, traj, jax.random.key(key))


# Rewards: groups 1 and 3 have zero spread (filtered out with include_zero=False); groups 0 and 2 vary.
MIXED = np.array([1.0, 0.0, 2.0, 0.5, 0.5, 0.5, -1.0, 3.0, 0.0, 1.0, 1.0, 1.0], np.float32)


def test_micro_batch_accumulation_equals_one_micro_batch(models):
    """Same update with micro-batches of 2 rows as with the whole mini-batch (4 rows) in one.

    Plain SGD, so that each mini-batch moves the parameters by exactly -lr * gradient: Adam's
    g / (sqrt(g^2) + eps) would turn the last-bit differences of near-zero gradient entries into
    differences of up to lr, which is no property of the accumulation. The two layouts differ only in
    reduction order; the bound is ``depth`` float32 reductions of at most ``n`` terms each
    (tests/_tolerance.py): the mini-batch's positions (4 x L) in the weight gradients, the MLP width in
    the forward and backward matmuls. A weighting bug (per-micro-batch means, a wrong count) moves the
    gradient by the ratio of the micro-batches' token counts, 1e-1 and more on this batch.
    """
    traj = make_traj(0, MIXED, models["logprob_fn"])
    sgd = lambda config: make_update_step(models["a_graph"], models["c_graph"], config, optax.sgd(1e-2),
                                          optax.sgd(1e-2))
    a = run(sgd(PPO), models, traj)
    b = run(sgd(dataclasses.replace(PPO, micro_batch_size=4)), models, traj)
    assert a.metrics["update/minibatches_used"] == 2.0
    cfg = tiny_cfg()
    depth = 2 * (2 * cfg.num_layers + 1)  # forward and backward through the stack and the head
    tol = depth * 2 * gamma(max(PPO.mini_batch_size * L, cfg.intermediate_size))
    for params_a, params_b, start in ((a.state.actor, b.state.actor, models["a_params"]),
                                      (a.state.critic, b.state.critic, models["c_params"])):
        delta_a = jax.tree.map(lambda x, y: x - y, params_a, start)
        delta_b = jax.tree.map(lambda x, y: x - y, params_b, start)
        assert rel_diff(delta_b, start) > 1e-3  # the step did change the parameters
        assert rel_diff(delta_a, delta_b) <= tol
    for name in ("actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "critic/vf_loss", "actor/entropy"):
        np.testing.assert_allclose(a.metrics[name], b.metrics[name], rtol=tol, atol=0, err_msg=name)


def test_filtered_groups_change_nothing(models, ppo_step):
    """Replacing the filtered groups' rows by garbage (NaN log-probs included) gives the same update."""
    traj = make_traj(1, MIXED, models["logprob_fn"])
    garbage = make_traj(99, MIXED * 0 + 7.0, None)  # constant rewards: still zero spread
    dropped = np.repeat(np.array([False, True, False, True]), S)
    swap = lambda x, y: jnp.where(dropped.reshape((R,) + (1,) * (x.ndim - 1)), y, x)
    mixed = jax.tree.map(swap, traj, garbage)
    mixed = mixed.replace(logprobs=jnp.where(dropped[:, None], jnp.nan, mixed.logprobs))
    a = run(ppo_step, models, traj, key=3)
    b = run(ppo_step, models, mixed, key=3)
    assert a.metrics["filter/kept_groups"] == 2.0 and b.metrics["filter/kept_groups"] == 2.0
    assert a.metrics["update/minibatches_used"] == 2.0  # ceil(6 / 4): filtered rows cost no mini-batch
    assert trees_equal(a.state.actor, b.state.actor)
    assert trees_equal(a.state.critic, b.state.critic)
    for name in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "update/tokens"):
        assert a.metrics[name] == b.metrics[name], name
    assert np.isfinite(a.metrics["actor/pg_loss"]) and a.metrics["update/nonfinite_skipped"] == 0.0


def test_all_filtered_batch_leaves_parameters_bit_identical(models, ppo_step):
    traj = make_traj(2, np.repeat(np.array([0.0, 1.0, 0.5, -0.25], np.float32), S))
    before_a, before_c = to_np(models["a_params"]), to_np(models["c_params"])
    out = run(ppo_step, models, traj)
    assert out.metrics["filter/empty"] == 1.0 and out.metrics["update/minibatches_used"] == 0.0
    assert out.metrics["update/tokens"] == 0.0
    assert trees_equal(out.state.actor, before_a) and trees_equal(out.state.critic, before_c)
    assert all(np.isfinite(float(v)) for v in out.metrics.values())


def test_nonfinite_old_logprob_skips_the_actor_step(models, ppo_step):
    """One kept group (3 rows + 1 copy = one mini-batch) with a NaN old log-prob: no actor step."""
    rewards = np.array([0.0] * 3 + [1.0, 0.0, 0.0] + [0.5] * 6, np.float32)
    traj = make_traj(4, rewards, models["logprob_fn"])
    row = S  # first row of the kept group 1
    col = int(np.argmax(np.asarray(traj.loss_mask[row])))
    traj = traj.replace(logprobs=traj.logprobs.at[row, col].set(jnp.nan))
    a_opt_init = to_np(ppo_step.actor_tx.init(models["a_params"]))
    out = run(ppo_step, models, traj)
    assert out.metrics["update/minibatches_used"] == 1.0
    assert out.metrics["actor/nonfinite_skipped"] == 1.0 and out.metrics["update/nonfinite_skipped"] == 1.0
    assert trees_equal(out.state.actor, to_np(models["a_params"]))
    assert trees_equal(out.state.actor_opt, a_opt_init)
    assert not trees_equal(out.state.critic, to_np(models["c_params"]))  # the critic never sees log-probs
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(out.state.actor))


def test_copy_padding_uses_ceil_minibatches_of_kept_rows(models, ppo_step):
    # Three groups with spread, one without: K = 9 rows -> ceil(9 / 4) = 3 mini-batches, 3 copies.
    rewards = np.array([1.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.0, 0.0, 5.0], np.float32)
    out = run(ppo_step, models, make_traj(5, rewards, models["logprob_fn"]))
    assert out.metrics["filter/kept_rows"] == 9.0
    assert out.metrics["update/minibatches_used"] == 3.0 and out.metrics["update/copied_rows"] == 3.0

    keep = jnp.asarray(np.repeat(np.array([True, True, False, True]), S))
    plan = plan_minibatches(keep, 4, jax.random.key(7))
    src, active, copy = map(np.asarray, (plan.src, plan.active, plan.is_copy))
    kept_rows = np.flatnonzero(np.asarray(keep))
    assert int(plan.num_minibatches) == 3 and active.sum() == 12
    np.testing.assert_array_equal(src[:9], kept_rows)  # kept rows first, original order
    assert copy.sum() == 3 and set(src[copy]) <= set(kept_rows)
    assert len(set(src[copy])) == 3  # without replacement while possible


@pytest.mark.parametrize("keep_rows,mb", [((0, 5), 4), ((2,), 4), ((1, 2, 3, 4, 5, 6, 7), 3), ((), 4)])
def test_plan_against_python_rules(keep_rows, mb):
    r = 12
    keep = np.zeros(r, bool)
    keep[list(keep_rows)] = True
    plan = plan_minibatches(jnp.asarray(keep), mb, jax.random.key(1))
    k = len(keep_rows)
    used = -(-k // mb)
    assert int(plan.num_kept) == k and int(plan.num_minibatches) == used
    src, active = np.asarray(plan.src), np.asarray(plan.active)
    assert active.sum() == used * mb
    np.testing.assert_array_equal(src[:k], np.flatnonzero(keep))
    copies = src[k : used * mb]
    assert set(copies) <= set(np.flatnonzero(keep))
    if 0 < len(copies) <= k:
        assert len(set(copies)) == len(copies)
    elif len(copies) > k > 0:  # more copies than kept rows: every kept row is used before any repeats
        assert len(set(copies[:k])) == k


def test_ratio_one_policy_gradient_is_minus_advantage_times_logp_toy():
    """Hand check: at ratio 1 the token-mean PPO loss has d/dlogp = -A / N (no clipping active)."""
    logp = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    mask = jnp.array([[True, True, True], [True, True, False]])
    adv = jnp.array([[0.5, 0.5, 0.5], [-2.0, -2.0, 0.0]])
    config = ActorLossConfig(entropy_coeff=0.0)

    def loss(lp):
        terms, _ = actor_loss_terms(lp, jnp.zeros_like(lp), jax.lax.stop_gradient(lp), adv, mask, config)
        return terms["task"].sum / terms["task"].count

    grad = np.asarray(jax.grad(loss)(logp))
    expected = np.array([[-0.5, -0.5, -0.5], [2.0, 2.0, 0.0]]) / 5.0
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


GRPO_SGD = UpdateConfig(
    adv_estimator="grpo", actor_loss=ActorLossConfig(entropy_coeff=0.0), mini_batch_size=6, micro_batch_size=3,
    group_size=S, filter_strategy="top_k_abs", filter_value=2, recompute_old_logprobs=True,
)
LR = 0.5


@pytest.fixture(scope="module")
def grpo_step(models):
    return make_update_step(models["a_graph"], None, GRPO_SGD, optax.sgd(LR), None)


def test_grpo_step_gradient_is_minus_advantage_times_logp(models, grpo_step):
    """End to end: old == current log-probs, so the SGD step is -lr * grad(sum(-A logp) / N) with A the
    GRPO z-scores of the kept groups computed from those groups alone (numpy)."""
    rewards = np.array([0.0, 1.0, 3.0, 0.2, 0.2, 0.3, 2.0, -1.0, 0.0, 1.0, 1.0, 1.1], np.float32)
    traj = make_traj(6, rewards, models["logprob_fn"])
    out = run(grpo_step, models, traj)
    assert out.metrics["filter/kept_groups"] == 2.0 and out.metrics["update/minibatches_used"] == 1.0

    kept = [0, 2]  # largest unbiased std
    adv_rows = np.zeros(R, np.float32)
    for g in kept:
        x = rewards[g * S : (g + 1) * S].astype(np.float64)
        adv_rows[g * S : (g + 1) * S] = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
    row_in = np.repeat(np.isin(np.arange(G), kept), S)
    mask = np.asarray(traj.loss_mask) & row_in[:, None]
    n_tokens = mask.sum()

    def reference_loss(params):
        logp, _ = sequence_logprobs(nnx.merge(models["a_graph"], params), traj.tokens, traj.valid)
        return jnp.sum(jnp.where(mask, -adv_rows[:, None] * logp, 0.0)) / n_tokens

    grads = jax.jit(jax.grad(reference_loss))(models["a_params"])
    expected = jax.tree.map(lambda p, g: p - LR * g, models["a_params"], grads)
    delta = jax.tree.map(lambda x, y: x - y, out.state.actor, models["a_params"])
    delta_ref = jax.tree.map(lambda x, y: x - y, expected, models["a_params"])
    assert rel_diff(delta_ref, models["a_params"]) > 1e-4
    assert rel_diff(delta, delta_ref) <= 1e-4
    np.testing.assert_allclose(out.metrics["actor/ppo_kl"], 0.0, atol=1e-6)
    assert out.metrics["actor/old_logprob_diff_max"] < 1e-5  # the sampler's log-probs = the forward's
    np.testing.assert_allclose(out.metrics["critic/advantages/mean"], adv_rows[row_in].repeat(
        mask.sum(1)[row_in]).mean(), atol=1e-5)


def test_step_compiles_once_across_calls(models, grpo_step):
    """Three calls with different data, one trace; the recomputed-old-logprob gap is logged each time."""
    for i in range(3):
        rewards = np.random.default_rng(20 + i).normal(size=R).astype(np.float32)
        traj = make_traj(20 + i, rewards)  # sampler log-probs that do NOT match the model
        out = run(grpo_step, models, traj, key=i)
        assert np.isfinite(out.metrics["actor/pg_loss"]) and out.metrics["update/minibatches_used"] == 1.0
        # reference gap over the kept rows, from the model's own log-probs
        scores = rewards.reshape(G, S).std(axis=1, ddof=1)
        kept = np.zeros(G, bool)
        kept[np.argsort(-scores, kind="stable")[:2]] = True
        mask = np.asarray(traj.loss_mask) & np.repeat(kept, S)[:, None]
        gap = np.abs(np.asarray(traj.logprobs) - np.asarray(models["logprob_fn"](traj.tokens, traj.valid)))[mask]
        np.testing.assert_allclose(out.metrics["actor/old_logprob_diff_max"], gap.max(), rtol=1e-5)
        np.testing.assert_allclose(out.metrics["actor/old_logprob_diff_mean"], gap.mean(), rtol=1e-5)
    assert grpo_step.traces == 1


def test_kl_loss_requires_reference_params(models):
    config = dataclasses.replace(GRPO_SGD, actor_loss=ActorLossConfig(use_kl_loss=True, kl_coef=0.1))
    step = make_update_step(models["a_graph"], None, config, optax.sgd(LR), None)
    with pytest.raises(ValueError, match="ref_params"):
        run(step, models, make_traj(0, MIXED))


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="micro_batch_size"):
        UpdateConfig(mini_batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="adv_estimator"):
        UpdateConfig(adv_estimator="ppo")
    with pytest.raises(ValueError, match="critic"):
        make_update_step(None, None, UpdateConfig(), optax.sgd(1.0), None)


def test_from_config_reads_base_defaults():
    from configs.base import apply_algorithm_preset, get_config

    config = get_config()
    uc = UpdateConfig.from_config(config)
    assert (uc.adv_estimator, uc.mini_batch_size, uc.micro_batch_size, uc.group_size) == ("gae", 32, 8, 16)
    assert uc.actor_loss.clip_high == 0.28 and uc.actor_loss.entropy_coeff == 0.001 and not uc.recompute_old_logprobs
    grpo = UpdateConfig.from_config(apply_algorithm_preset(get_config(), "grpo"))
    assert grpo.adv_estimator == "grpo" and grpo.actor_loss.agg_mode == "seq-mean-token-mean"
    config.algorithm.mini_batch_size = 48
    with pytest.raises(ValueError, match="mini_batch_size"):
        UpdateConfig.from_config(config)
