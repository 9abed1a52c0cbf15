"""Packed rows (rl/packing.py): the plan, the model over packed sequences, the losses, the whole update.

A packed row holds several sequences side by side; each must get exactly what it gets in a row of its
own. The model's packed forward and the update differ from the unpacked ones only in which masked keys
(zero softmax weight) and padding positions (zero loss weight) they reduce over and in the order of
float32 sums, so they are compared with the rounding bounds of tests/_tolerance.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models.config import get_preset
from ragen_jax.models.logprobs import sequence_logprobs
from ragen_jax.models.transformer import Transformer
from ragen_jax.rl.losses import AGG_MODES, aggregate
from ragen_jax.rl.packing import pack, pack_plan, pack_rows, row_lengths
from tests._tolerance import gamma, logit_tolerance, reorder_bound
from tests.rl.test_update_width import CASES, _run, _step, assert_same_update, widen
from tests.test_update import MIXED, make_traj, models  # noqa: F401 (fixture)


@pytest.mark.parametrize("seed", range(6))
def test_every_row_lands_once_in_order_and_the_used_rows_are_a_prefix(seed):
    rng = np.random.default_rng(seed)
    rows, width = int(rng.integers(1, 20)), int(rng.integers(4, 40))
    lengths = rng.integers(0, width + 1, rows)
    lengths[rng.random(rows) < 0.5] = rng.integers(0, max(2, width // 3))  # many short rows, as a rollout's
    plan = jax.tree.map(np.asarray, pack_plan(jnp.asarray(lengths, jnp.int32), width))
    source, segments = plan.source, plan.segments
    expected = [r * width + c for r in range(rows) for c in range(lengths[r])]
    assert sorted(source[source >= 0].tolist()) == expected  # each token once, nothing else
    for r in range(rows):
        where = np.argwhere(segments == r + 1)
        if lengths[r] == 0:
            assert where.size == 0
            continue
        assert len(set(where[:, 0])) == 1  # one packed row
        p, cols = where[0, 0], where[:, 1]
        assert np.array_equal(cols, np.arange(cols[0], cols[0] + lengths[r]))  # contiguous
        assert np.array_equal(source[p, cols], r * width + np.arange(lengths[r]))  # in order
    assert np.array_equal(segments == 0, source < 0)
    used = np.any(source >= 0, axis=1)
    assert int(plan.rows_used) == used.sum() and not np.any(used[int(plan.rows_used):])
    assert int(plan.rows_used) >= -(-lengths.sum() // width)
    # first fit: no later packed row's first sequence would have fitted into an earlier row's free room
    free = width - np.sum(source >= 0, axis=1)
    for p in range(1, int(plan.rows_used)):
        first = segments[p, 0] - 1
        assert np.all(free[:p] < lengths[first]) or lengths[first] == 0


def test_pack_moves_whole_trailing_dimensions_and_zeroes_the_padding():
    valid = np.zeros((3, 6), bool)
    valid[0, :2], valid[1, :5], valid[2, :3] = True, True, True
    valid[1, 1] = False  # a hole inside a row travels with it
    x = np.arange(3 * 6 * 2, dtype=np.float32).reshape(3, 6, 2) + 1
    packed = pack_rows({"valid": jnp.asarray(valid), "x": jnp.asarray(x)})
    assert row_lengths(jnp.asarray(valid)).tolist() == [2, 5, 3]
    # first fit decreasing: row 1 (5) alone; rows 2 (3) and 0 (2) share the next row
    assert np.asarray(packed["segments"]).tolist() == [[2, 2, 2, 2, 2, 0], [3, 3, 3, 1, 1, 0], [0] * 6]
    assert np.array_equal(np.asarray(packed["x"])[1, 3:5], x[0, :2])
    assert np.array_equal(np.asarray(packed["x"])[0, :5], x[1, :5])
    assert not np.any(np.asarray(packed["x"])[2]) and not np.any(np.asarray(packed["valid"])[:, 5])
    assert np.asarray(packed["valid"])[0].tolist() == [True, False, True, True, True, False]
    plan = pack_plan(jnp.asarray([2, 5, 3], jnp.int32), 6)
    assert np.array_equal(np.asarray(pack(plan, jnp.asarray(x))), np.asarray(packed["x"]))


@pytest.mark.parametrize("block", [0, 8])
def test_each_packed_sequence_gets_the_logits_and_logprobs_of_its_own_row(block):
    cfg = dataclasses.replace(get_preset("tiny"), num_layers=2, attention_block=block)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(block)
    rows, width = 5, 40
    lengths = np.array([40, 9, 17, 3, 12])
    tokens = rng.integers(0, cfg.vocab_size, (rows, width)).astype(np.int32)
    valid = np.arange(width)[None, :] < lengths[:, None]
    valid[2, 4] = valid[4, 0] = False  # holes, and a row that starts with one
    packed = pack_rows({"tokens": jnp.asarray(tokens), "valid": jnp.asarray(valid)})
    assert int(np.sum(np.any(np.asarray(packed["valid"]), axis=1))) == 3  # 40 | 17 + 12 + 9 | 3
    want, _ = model(jnp.asarray(tokens), jnp.asarray(valid))
    got, _ = model(packed["tokens"], packed["valid"], segments=packed["segments"])
    want_lp = sequence_logprobs(model, jnp.asarray(tokens), jnp.asarray(valid))[0]
    got_lp = sequence_logprobs(model, packed["tokens"], packed["valid"], segments=packed["segments"])[0]
    plan = pack_plan(jnp.asarray(lengths, jnp.int32), width)
    source = np.asarray(plan.source)
    on = (source >= 0) & np.asarray(packed["valid"])
    row, col = np.divmod(source[on], width)
    want = np.asarray(want)
    tol = logit_tolerance(want, max(cfg.intermediate_size, cfg.hidden_size, width), depth=2 * cfg.num_layers + 1)
    err = np.max(np.abs(np.asarray(got)[on] - want[row, col]), axis=-1)
    assert np.all(err <= tol[row, col])
    # log p = z_k - logsumexp(z): twice the logits' bound (scored positions only: a sequence's first
    # token is not predicted from the sequence packed before it)
    want_lp, got_lp = np.asarray(want_lp), np.asarray(got_lp)
    assert np.all(np.abs(got_lp[on] - want_lp[row, col]) <= 2 * tol[row, col] + 1e-6)
    assert np.all((got_lp[on] == 0) == (want_lp[row, col] == 0))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_losses_over_packed_sequences_equal_the_losses_over_rows(mode):
    rng = np.random.default_rng(3)
    rows, width = 8, 30
    lengths = rng.integers(1, width + 1, rows)
    valid = np.arange(width)[None, :] < lengths[:, None]
    mask = valid & (rng.random((rows, width)) < 0.6)
    mask[2] = False  # a sequence with no loss token
    x = rng.normal(size=(rows, width)).astype(np.float32)
    packed = pack_rows({"valid": jnp.asarray(valid), "mask": jnp.asarray(mask), "x": jnp.asarray(x)})
    want = aggregate(jnp.asarray(x), jnp.asarray(mask), mode, norm_length=50.0)
    got = aggregate(packed["x"], packed["mask"], mode, norm_length=50.0, segments=packed["segments"])
    assert float(got.count) == float(want.count)
    n = rows * width
    assert abs(float(got.sum) - float(want.sum)) <= float(reorder_bound(n, np.abs(x[mask]).sum())) + gamma(n)
    with pytest.raises(ValueError, match="not both"):
        aggregate(packed["x"], packed["mask"], mode, sequence_mask=jnp.ones(rows, bool), segments=packed["segments"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_packed_update_equals_the_update_over_rows(models, name):
    config = CASES[name]
    # rows of 5-14 tokens at width 32: the 4 rows of a mini-batch pack into 2 or 3
    traj = widen(make_traj(7, MIXED, models["logprob_fn"]), 32)
    packed_step = _step(models, dataclasses.replace(config, pack_rows=True, width_buckets=1))
    rows_step = _step(models, dataclasses.replace(config, pack_rows=False, width_buckets=1))
    a, b = _run(packed_step, models, traj), _run(rows_step, models, traj)
    assert float(a.metrics["update/rows_run"]) < float(b.metrics["update/rows_run"])
    assert_same_update(a, b, models, config, 32, skip=("update/rows_run",))
