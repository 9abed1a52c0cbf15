"""Cross-scoring at the real widths equals cross-scoring at the rollout's static widths.

`cross_score` crops the prompts (right-aligned, [N, Lx]) from the left and the reasonings
(left-aligned, [M, Lz]) from the right to their real extents rounded up to a bucket width
(`real_widths`). The batch below is a multi-turn rollout right-padded to a static width of 192 (its
longest real row is under 70 tokens), packed at prompt_len = 192 and reasoning_len = 48 as the trainer
packs them (cache length, max_new_tokens). The cropped and the full-width programs differ only in how
many masked keys (exactly zero attention weight) and padding positions (zero weight in the row sums)
they reduce over, so the scores agree up to the reduction order of float32 sums (tests/_tolerance.py),
and the MI metrics up to that perturbation pushed through their (Lipschitz) formulas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx

from ragen_jax.diagnostics import cross_scoring
from ragen_jax.diagnostics.cross_scoring import (
    crop_to_real_widths, cross_score, real_widths, score_pairs,
)
from ragen_jax.diagnostics.mi import init_marginal_std_ema
from ragen_jax.diagnostics.mi_sampling import sample_first_turn_pairs, sample_trajectory_pairs
from ragen_jax.models.config import get_preset
from ragen_jax.models.transformer import Transformer
from ragen_jax.rl.update import update_width
from tests._tolerance import gamma, logit_tolerance, logprob_entropy_tolerance

SMALL = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
STATIC, REASONING_LEN, TURNS, GROUPS, GROUP_SIZE = 192, 48, 3, 3, 3
THINK, END_THINK = 3, 4


@pytest.fixture(scope="module")
def model():
    return Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(3))


def wide_batch(seed: int = 0):
    """GROUPS x GROUP_SIZE trajectories of TURNS turns (obs, <think>, z, </think>, answer), each group
    sharing its first observation, right-padded to STATIC. Returns the sampling functions' arrays."""
    rng = np.random.default_rng(seed)
    rows = GROUPS * GROUP_SIZE
    tokens = np.zeros((rows, STATIC), np.int32)
    reasoning = np.zeros((rows, STATIC), bool)
    turn_ids = np.full((rows, STATIC), -1, np.int32)
    first_obs = [rng.integers(8, 264, rng.integers(4, 9)) for _ in range(GROUPS)]
    for b in range(rows):
        pos = 0
        for t in range(TURNS):
            obs = first_obs[b // GROUP_SIZE] if t == 0 else rng.integers(8, 264, rng.integers(2, 7))
            z = rng.integers(8, 264, rng.integers(3, 11))
            segment = [*obs, THINK, *z, END_THINK, *rng.integers(8, 264, 2)]
            tokens[b, pos: pos + len(segment)] = segment
            turn_ids[b, pos: pos + len(segment)] = t
            reasoning[b, pos + len(obs) + 1: pos + len(obs) + 1 + len(z)] = True
            pos += len(segment)
    group_ids = np.repeat(np.arange(GROUPS, dtype=np.int32), GROUP_SIZE)
    return tokens, tokens > 0, reasoning, turn_ids, group_ids


def sampled_pairs(strategy: str, seed: int = 0):
    tokens, valid, reasoning, turn_ids, group_ids = wide_batch(seed)
    key = jax.random.key(seed)
    if strategy == "first_turn":
        return sample_first_turn_pairs(key, tokens, valid, reasoning, turn_ids, group_ids, num_samples=8,
                                       num_groups=GROUPS, prompt_len=STATIC, reasoning_len=REASONING_LEN)
    return sample_trajectory_pairs(key, tokens, valid, reasoning, turn_ids, num_samples=8, max_turns=TURNS,
                                   prompt_len=STATIC, reasoning_len=REASONING_LEN)


def score_tolerance(model, x, x_valid, z, z_valid, temperature):
    """(tolerance of logp_sum f64[M, N], of logp_mean f64[M, N]) between two reduction orders of the
    cross-scoring at static width (Lx + Lz attended keys at most).

    Per reasoning token: `logit_tolerance` with the logits' scale read from one plain forward over each
    unpadded [x_j ; z_m], through `logprob_entropy_tolerance`; the row sum adds its own reordering of
    |z_m| terms. The mean divides both by |z_m|."""
    cfg = model.cfg
    longest = max(cfg.intermediate_size, cfg.hidden_size, x.shape[1] + z.shape[1], cfg.vocab_size)
    depth = 2 * cfg.num_layers + 1
    num_rows, num_cols = z.shape[0], x.shape[0]
    tol_sum = np.zeros((num_rows, num_cols))
    counts = np.maximum(z_valid.sum(axis=1), 1)
    pairs = [(m, j) for m in range(num_rows) if z_valid[m].any() for j in range(num_cols)]
    seqs = [np.concatenate([x[j][x_valid[j]], z[m][z_valid[m]]]) for m, j in pairs]
    # One forward over every pair, right-padded: causal attention keeps a position's logits free of the
    # padding after it, and the tolerance reads only the logits' scale.
    width = max(len(seq) for seq in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = seq
    all_logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(tokens > 0))[0], np.float64)
    for row, ((m, j), seq) in enumerate(zip(pairs, seqs)):
        reasoning = z[m][z_valid[m]]
        logits = all_logits[row, len(seq) - reasoning.size - 1: len(seq) - 1]  # the positions predicting z_m
        token_tol, _ = logprob_entropy_tolerance(logits, temperature, logit_tolerance(logits, longest, depth))
        log_softmax = scipy.special.log_softmax(logits / temperature, axis=-1)
        abs_logp = np.abs(log_softmax[np.arange(reasoning.size), reasoning])
        tol_sum[m, j] = token_tol.sum() + 2 * gamma(reasoning.size) * (abs_logp + token_tol).sum()
    return tol_sum, tol_sum / counts[:, None]


def metric_tolerances(metrics, d_tok: float, d_seq: float, num: int, std_eps: float = 1e-3) -> dict[str, float]:
    """|metric_a - metric_b| bounds when every entry of logp_mean (logp_sum) moves by at most d_tok (d_seq).

    Means and logsumexps are 1-Lipschitz in the max norm, so matched / marginal means and entropies move
    by d, MI by 2 d, the population std by d (||e - mean e||_2 <= ||e||_2 <= sqrt(M) d); the z-score
    MI / (sigma + eps) by 2 d / (s + eps) + |MI| d / (s + eps)^2 with s the smaller admissible sigma.
    Each is computed in float32 over at most M + N terms: plus that reordering (`num` terms)."""
    tol = {}
    for key, value in metrics.items():
        seq = key.endswith("_seq") or "_seq_" in key
        d = d_seq if seq else d_tok
        if key.startswith("mi_zscore"):
            mi = float(metrics["mi_seq_estimate" if seq else "mi_estimate"])
            sigma_key = ("marginal_std_ema" if "ema" in key else "marginal_std") + ("_seq" if seq else "")
            s = max(float(metrics[sigma_key]) - d, 0.0) + std_eps
            bound = 2 * d / s + abs(mi) * d / s ** 2
        elif key.startswith("mi_") and "estimate" in key:
            bound = 2 * d
        else:
            bound = d
        tol[key] = bound + 4 * gamma(num) * max(1.0, abs(float(value)))
    return tol


EXACT = ("retrieval", "num_", "mi_upper_bound")


def assert_scores_close(got, want, tol, label):
    for a, b, t, name in zip(got, want, tol, ("logp_sum", "logp_mean")):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert np.all(diff <= t), (label, name, float(diff.max()), float(t.flat[np.argmax(diff)]))


@pytest.mark.parametrize("strategy", ["first_turn", "trajectory"])
def test_cropped_scores_and_metrics_equal_full_width(model, strategy):
    pairs = sampled_pairs(strategy)
    assert int(pairs.num_truncated) == 0
    x, x_valid, z, z_valid = (np.asarray(a) for a in (pairs.x_tokens, pairs.x_valid, pairs.z_tokens, pairs.z_valid))
    assert x.shape[1] == STATIC and z.shape[1] == REASONING_LEN
    prompt_width, reasoning_width = real_widths(x_valid, z_valid)
    assert prompt_width <= STATIC // 2 and reasoning_width <= REASONING_LEN // 2  # a real crop

    cropped = cross_score(model, x, x_valid, z, z_valid, 0.8)
    full = cross_score(model, x, x_valid, z, z_valid, 0.8, width_buckets=1)
    tol = score_tolerance(model, x, x_valid, z, z_valid, 0.8)
    assert_scores_close(cropped, full, tol, strategy)

    ema = init_marginal_std_ema()
    got, got_ema = score_pairs(model, pairs, ema, 0.8)
    want, want_ema = score_pairs(model, pairs, ema, 0.8, width_buckets=1)
    assert set(got) == set(want)
    masked = np.where(np.asarray(pairs.row_valid)[:, None] & np.asarray(pairs.col_valid)[None, :], 1, 0)
    d_sum, d_mean = float((tol[0] * masked).max()), float((tol[1] * masked).max())
    num = x.shape[0] + z.shape[0]
    metric_tol = metric_tolerances(want, d_mean, d_sum, num)
    # Retrieval ranks columns: equal when no real row has two real columns within 2 d of its best one.
    best = np.sort(np.where(masked > 0, np.asarray(full[1]), -np.inf), axis=1)
    margin = np.where(np.asarray(pairs.row_valid), best[:, -1] - best[:, -2], np.inf)
    for key in sorted(want):
        a, b = float(got[key]), float(want[key])
        if key.startswith(EXACT):
            if key.startswith("retrieval") and margin.min() <= 2 * d_mean:
                continue
            assert a == b, (key, a, b)
        else:
            assert abs(a - b) <= metric_tol[key], (key, a, b, metric_tol[key])
    for a, b, key in ((got_ema.token, want_ema.token, "marginal_std"), (got_ema.seq, want_ema.seq, "marginal_std_seq")):
        assert abs(float(a) - float(b)) <= metric_tol[key]


def test_cutting_one_real_token_breaks_the_bound(model):
    """The tolerance above is tight enough to see a crop that drops a real prompt or reasoning token."""
    pairs = sampled_pairs("trajectory")
    x, x_valid, z, z_valid = (np.asarray(a) for a in (pairs.x_tokens, pairs.x_valid, pairs.z_tokens, pairs.z_valid))
    full = cross_score(model, x, x_valid, z, z_valid, 0.8, width_buckets=1)
    tol = score_tolerance(model, x, x_valid, z, z_valid, 0.8)
    first_real = int(np.argmax(x_valid.any(axis=0)))
    last_real = int(np.nonzero(z_valid.any(axis=0))[0].max())
    cut_prompt = cross_score(model, x[:, first_real + 1:], x_valid[:, first_real + 1:], z, z_valid, 0.8,
                             width_buckets=1)
    cut_reasoning = cross_score(model, x, x_valid, z[:, :last_real], z_valid[:, :last_real], 0.8,
                                width_buckets=1)
    for cut, label in ((cut_prompt, "prompt"), (cut_reasoning, "reasoning")):
        with pytest.raises(AssertionError):
            assert_scores_close(cut, full, tol, label)


def test_crop_keeps_the_prompts_right_end_and_the_reasonings_left_end():
    pairs = sampled_pairs("trajectory")
    x, x_valid, z, z_valid = (np.asarray(a) for a in (pairs.x_tokens, pairs.x_valid, pairs.z_tokens, pairs.z_valid))
    # The sampler's packing: every real prompt ends at the last slot, every real reasoning starts at 0.
    real = np.asarray(pairs.row_valid)
    assert x_valid[real, -1].all() and z_valid[real, 0].all()
    cx, cx_valid, cz, cz_valid = (np.asarray(a) for a in crop_to_real_widths(x, x_valid, z, z_valid))
    prompt_width, reasoning_width = real_widths(x_valid, z_valid)
    assert cx.shape == (x.shape[0], prompt_width) and cz.shape == (z.shape[0], reasoning_width)
    np.testing.assert_array_equal(cx, x[:, STATIC - prompt_width:])
    np.testing.assert_array_equal(cz, z[:, :reasoning_width])
    assert cx_valid.sum() == x_valid.sum() and cz_valid.sum() == z_valid.sum()  # no real token dropped
    # A left-aligned prompt array is real from slot 0: it is not cropped at all.
    flipped = x_valid[:, ::-1]
    assert real_widths(flipped, z_valid)[0] == STATIC


@pytest.mark.parametrize("static,buckets", [(192, 8), (2186, 8), (96, 8), (7, 8), (64, 1), (300, 3)])
def test_bucket_is_the_smallest_that_holds_the_longest_real_row(static, buckets):
    rng = np.random.default_rng(static + buckets)
    widths = sorted({update_width(n, static, buckets) for n in range(static + 1)})
    assert len(widths) <= buckets and widths[-1] == static
    for extent in sorted({0, 1, static, *rng.integers(1, static + 1, 12).tolist()}):
        x_valid = np.zeros((4, static), bool)
        z_valid = np.zeros((5, static), bool)
        if extent:
            x_valid[1, static - extent:] = True  # the longest prompt: right-aligned, `extent` slots
            x_valid[2, static - 1] = True
            if extent > 2:
                x_valid[1, static - extent + extent // 2] = False  # a hole does not shorten it
            z_valid[3, :extent] = True  # the longest reasoning: left-aligned, `extent` slots
            z_valid[0, 0] = True
        want = min(w for w in widths if w >= max(extent, 1))
        assert real_widths(x_valid, z_valid, buckets) == (want, want)


def test_compiles_once_per_bucket_width(model):
    """Batches whose real widths fall in two prompt buckets: one trace per width pair, none on repeats."""
    counts = cross_scoring.TRACES_BY_WIDTH["cross_score"]
    rng = np.random.default_rng(5)
    num_cols, num_rows = 3, 7  # shapes no other test uses: every trace below is this test's
    x = rng.integers(8, 264, (num_cols, STATIC)).astype(np.int32)
    z = rng.integers(8, 264, (num_rows, REASONING_LEN)).astype(np.int32)

    def masks(prompt_extent, reasoning_extent):
        x_valid = np.zeros((num_cols, STATIC), bool)
        x_valid[:, STATIC - prompt_extent:] = True
        z_valid = np.zeros((num_rows, REASONING_LEN), bool)
        z_valid[:, :reasoning_extent] = True
        return x_valid, z_valid

    extents = [(10, 5), (20, 7), (30, 3), (50, 6), (10, 5), (47, 8)]  # prompt buckets 24 / 48 / 72, reasoning 8
    widths = [real_widths(*masks(*e)) for e in extents]
    assert sorted(set(widths)) == [(24, 8), (48, 8), (72, 8)]
    before = {w: counts.get(w, 0) for w in set(widths)}
    total = cross_scoring.TRACE_COUNTS["cross_score"]
    for extent in extents:
        x_valid, z_valid = masks(*extent)
        sums, _ = cross_score(model, x, x_valid, z, z_valid)
        assert sums.shape == (num_rows, num_cols) and np.all(np.isfinite(np.asarray(sums)))
    assert {w: counts[w] - before[w] for w in set(widths)} == {w: 1 for w in set(widths)}
    assert cross_scoring.TRACE_COUNTS["cross_score"] == total + 3
