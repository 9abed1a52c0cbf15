"""MI proxies, their EMA state, and the two pair-sampling strategies.

References: hand-computed values (math module) and a plain numpy / Python re-derivation of RAGEN's
CollapseDetector formulas written here, row by row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.diagnostics.mi import (
    init_mi_ema_state,
    mi_metrics,
    mi_metrics_with_ema,
    should_compute_mi,
)
from ragen_jax.diagnostics.mi_sampling import (
    sample_first_turn_pairs,
    sample_trajectory_pairs,
)

# ----------------------------------------------------------------------------- numpy reference


def _lse(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def reference_metrics(logp_sum, logp_mean, true_col, signature=None, eps=1e-3):
    """RAGEN's formulas on real rows / columns only, one row at a time."""
    logp_sum = np.asarray(logp_sum, np.float64)
    logp_mean = np.asarray(logp_mean, np.float64)
    rows, cols = logp_sum.shape
    signature = list(range(cols)) if signature is None else list(signature)
    out = {}
    for name, mat in (("tok", logp_mean), ("seq", logp_sum)):
        matched = np.array([mat[m, true_col[m]] for m in range(rows)])
        marginal = np.array([_lse(list(mat[m])) - math.log(cols) for m in range(rows)])
        std = float(np.sqrt(np.mean((marginal - marginal.mean()) ** 2)))
        out[name] = dict(
            mi=matched.mean() - marginal.mean(),
            cond=-matched.mean(),
            marg=-marginal.mean(),
            std=std,
            z=float(np.mean((matched - marginal) / (std + eps))),
        )
    hits = {1: [], 2: [], 4: [], 8: []}
    chance = []
    for m in range(rows):
        order = sorted(range(cols), key=lambda j: (-logp_mean[m, j], j))
        true_sig = signature[true_col[m]]
        for k in hits:
            hits[k].append(any(signature[j] == true_sig for j in order[: min(k, cols)]))
        chance.append(sum(s == true_sig for s in signature) / cols)
    out["acc"] = {k: float(np.mean(v)) for k, v in hits.items()}
    out["chance"] = float(np.mean(chance))
    return out


def assert_matches_reference(got, ref, cols, atol=1e-4):
    pairs = [
        ("mi_estimate", ref["tok"]["mi"]),
        ("mi_seq_estimate", ref["seq"]["mi"]),
        ("conditional_entropy_est", ref["tok"]["cond"]),
        ("conditional_entropy_seq_est", ref["seq"]["cond"]),
        ("reasoning_entropy_est", ref["tok"]["marg"]),
        ("reasoning_entropy_seq_est", ref["seq"]["marg"]),
        ("marginal_std", ref["tok"]["std"]),
        ("marginal_std_seq", ref["seq"]["std"]),
        ("mi_zscore", ref["tok"]["z"]),
        ("mi_zscore_seq", ref["seq"]["z"]),
        ("retrieval_accuracy", ref["acc"][1]),
        ("retrieval_accuracy@2", ref["acc"][2]),
        ("retrieval_accuracy@4", ref["acc"][4]),
        ("retrieval_accuracy@8", ref["acc"][8]),
        ("retrieval_chance_level", ref["chance"]),
        ("retrieval_chance_level@4", min(1.0, ref["chance"] * min(4, cols))),
        ("mi_upper_bound", math.log(cols)),
    ]
    for key, want in pairs:
        scale = max(1.0, abs(want))
        # A z-score divides by sigma + eps; float32 rounding leaves sigma ~1e-7 where float64 gives
        # exactly 0, a relative change of 1e-4 of the z-score: compare those relatively.
        rel = 1e-3 if "zscore" in key else 0.0
        assert float(got[key]) == pytest.approx(want, abs=atol * scale, rel=rel), key


# ----------------------------------------------------------------------------- metrics


def test_hand_computed_two_by_two():
    # Rows sampled from columns 0 and 1; per-token matrix A, per-sequence B = 3 * A (3 tokens each).
    a = np.array([[-1.0, -3.0], [-2.0, -0.5]], np.float32)
    got = mi_metrics(3 * a, a, jnp.array([0, 1]))
    marg0 = math.log(math.exp(-1) + math.exp(-3)) - math.log(2)
    marg1 = math.log(math.exp(-2) + math.exp(-0.5)) - math.log(2)
    matched_mean = (-1.0 - 0.5) / 2
    marginal_mean = (marg0 + marg1) / 2
    std = abs(marg0 - marg1) / 2  # population std of two values
    assert float(got["mi_estimate"]) == pytest.approx(matched_mean - marginal_mean, abs=1e-6)
    assert float(got["conditional_entropy_est"]) == pytest.approx(0.75, abs=1e-6)
    assert float(got["reasoning_entropy_est"]) == pytest.approx(-marginal_mean, abs=1e-6)
    assert float(got["marginal_std"]) == pytest.approx(std, abs=1e-6)
    assert float(got["mi_zscore"]) == pytest.approx(
        (matched_mean - marginal_mean) / (std + 1e-3), abs=1e-5
    )
    seq_marg0 = math.log(math.exp(-3) + math.exp(-9)) - math.log(2)
    seq_marg1 = math.log(math.exp(-6) + math.exp(-1.5)) - math.log(2)
    assert float(got["mi_seq_estimate"]) == pytest.approx(
        -2.25 - (seq_marg0 + seq_marg1) / 2, abs=1e-5
    )
    assert float(got["conditional_entropy_seq_est"]) == pytest.approx(2.25, abs=1e-6)
    assert float(got["retrieval_accuracy"]) == 1.0
    assert float(got["retrieval_chance_level"]) == 0.5
    assert float(got["retrieval_accuracy@2"]) == 1.0
    assert float(got["retrieval_chance_level@2"]) == 1.0  # min(1, 0.5 * 2)
    assert float(got["mi_upper_bound"]) == pytest.approx(math.log(2))
    # H(Z) = I + H(Z|X) exactly.
    assert float(got["reasoning_entropy_est"]) == pytest.approx(
        float(got["mi_estimate"]) + float(got["conditional_entropy_est"]), abs=1e-6
    )


@pytest.mark.parametrize("rows,cols,seed", [(12, 4, 0), (9, 9, 1), (16, 3, 2), (20, 10, 3)])
def test_random_matrices_match_numpy_reference(rows, cols, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, size=(rows, 1))
    logp_mean = rng.normal(-2.0, 1.0, size=(rows, cols)).astype(np.float32)
    logp_sum = (logp_mean * lengths).astype(np.float32)
    true_col = rng.integers(0, cols, size=rows)
    signature = rng.integers(0, max(1, cols - 1), size=cols)  # some duplicate prompts
    got = jax.jit(mi_metrics)(logp_sum, logp_mean, true_col, signature)
    ref = reference_metrics(logp_sum, logp_mean, true_col, signature)
    assert_matches_reference(got, ref, cols)


def test_template_collapse_constant_rows_give_zero_mi_and_chance_retrieval():
    # p(z | x_j) does not depend on j: each row is constant across columns.
    cols, per_col = 4, 3
    row_values = np.repeat(np.linspace(-5.0, -1.0, cols * per_col)[:, None], cols, axis=1)
    true_col = np.repeat(np.arange(cols), per_col)
    got = mi_metrics(10 * row_values, row_values, true_col)
    assert abs(float(got["mi_estimate"])) < 1e-6
    assert abs(float(got["mi_seq_estimate"])) < 1e-5
    assert abs(float(got["mi_zscore"])) < 1e-3
    # Ties go to the first column, right for exactly the rows of column 0: accuracy = chance = 1/N.
    assert float(got["retrieval_accuracy"]) == pytest.approx(1 / cols)
    assert float(got["retrieval_chance_level"]) == pytest.approx(1 / cols)
    assert float(got["retrieval_above_chance"]) == pytest.approx(0.0, abs=1e-7)


def test_identical_rows_across_samples_give_no_information():
    # Every reasoning scores the same vector (non-constant): MI <= 0 by Jensen, retrieval at chance.
    cols = 5
    row = np.array([-1.0, -2.0, -1.5, -3.0, -2.5], np.float32)
    true_col = np.arange(cols)
    matrix = np.tile(row, (cols, 1))
    got = mi_metrics(matrix, matrix, true_col)
    ref = reference_metrics(matrix, matrix, true_col)
    assert_matches_reference(got, ref, cols)
    assert float(got["mi_estimate"]) <= 1e-7
    assert float(got["retrieval_accuracy"]) == pytest.approx(1 / cols)


@pytest.mark.parametrize("cols", [2, 8, 64])
def test_perfectly_diagonal_matrix_reaches_log_n(cols):
    matrix = np.where(np.eye(cols, dtype=bool), 0.0, -200.0).astype(np.float32)
    got = mi_metrics(matrix, matrix, np.arange(cols))
    assert float(got["mi_estimate"]) == pytest.approx(math.log(cols), abs=1e-5)
    assert float(got["mi_seq_estimate"]) == pytest.approx(math.log(cols), abs=1e-5)
    assert float(got["mi_upper_bound"]) == pytest.approx(math.log(cols), abs=1e-6)
    assert float(got["retrieval_accuracy"]) == 1.0
    assert float(got["retrieval_chance_level"]) == pytest.approx(1 / cols)
    assert float(got["marginal_std"]) == pytest.approx(0.0, abs=1e-5)
    # sigma ~ 0: the z-score is MI / eps (the caveat RAGEN's docs note).
    assert float(got["mi_zscore"]) == pytest.approx(math.log(cols) / 1e-3, rel=1e-2)


@pytest.mark.parametrize("cols", [2, 3, 7, 16, 33, 64])
@pytest.mark.parametrize("matched", [0.0, -0.7])
def test_zero_marginal_std_gives_zscore_log_n_over_eps(cols, matched):
    """Equal marginals: sigma is exactly 0 and the z-score is MI / eps = log N / eps to float32 rounding.

    Every real row scores `matched` under its own prompt and exp(-1e4) = 0 under the others, so
    marginal_m = matched - log N for every m. The expected value repeats the library's float32 steps
    (mi = matched - (matched - log N), z = mi / (0 + eps)); only XLA's log may differ from numpy's, by
    an ulp or two, so rel = 4 u. A naive float32 mean leaves sigma ~ 5e-7 (z = 2771.3 instead of
    2772.6 for N = 16), off by 5e-4 relative.
    """
    rows = cols + 3  # three padded rows with junk values: excluded from every statistic
    matrix = np.full((rows, cols), -1e4, np.float32)
    matrix[np.arange(cols), np.arange(cols)] = matched
    matrix[cols:] = np.random.default_rng(cols).normal(size=(3, cols))
    true_col = np.concatenate([np.arange(cols), np.zeros(3, int)])
    row_valid = np.arange(rows) < cols
    got = jax.device_get(mi_metrics(matrix, matrix, true_col, row_valid=row_valid))
    f32 = np.float32
    log_n = f32(np.log(cols))
    want = (f32(matched) - (f32(matched) - log_n)) / (f32(0.0) + f32(1e-3))
    for suffix in ("", "_seq"):
        assert got["marginal_std" + suffix] == 0.0
        assert got["mi_zscore" + suffix] == pytest.approx(float(want), rel=4 * 2.0**-24)
        assert got["mi_zscore" + suffix] == pytest.approx(math.log(cols) / 1e-3, rel=4 * 2.0**-24)


def test_single_column_gives_zero_mi_and_trivial_retrieval():
    # G = 1 (first-turn strategy): one prompt, N = 1, I <= log 1 = 0.
    rng = np.random.default_rng(4)
    matrix = rng.normal(-2, 1, size=(6, 1)).astype(np.float32)
    got = mi_metrics(matrix, matrix, np.zeros(6, np.int32))
    assert float(got["mi_estimate"]) == pytest.approx(0.0, abs=1e-6)
    assert float(got["mi_upper_bound"]) == 0.0
    assert float(got["retrieval_accuracy"]) == 1.0
    assert float(got["retrieval_chance_level"]) == 1.0
    assert float(got["num_columns"]) == 1.0


def test_signatures_make_duplicate_prompts_equivalent():
    # Columns 0 and 1 hold the same prompt. Row 0 (true col 0) prefers col 1: correct by signature.
    matrix = np.array([[-2.0, -1.0, -3.0], [-3.0, -3.0, -1.0], [-1.0, -2.0, -3.0]], np.float32)
    true_col = np.array([0, 2, 2])
    plain = mi_metrics(matrix, matrix, true_col)
    merged = mi_metrics(matrix, matrix, true_col, np.array([0, 0, 2]))
    assert float(plain["retrieval_accuracy"]) == pytest.approx(1 / 3)
    assert float(merged["retrieval_accuracy"]) == pytest.approx(2 / 3)
    # Chance: row 0 shares its signature with 2 of 3 columns, rows 1, 2 with 1 of 3.
    assert float(merged["retrieval_chance_level"]) == pytest.approx((2 / 3 + 1 / 3 + 1 / 3) / 3)
    assert float(merged["retrieval_chance_level@2"]) == pytest.approx(min(1.0, 2 * 4 / 9))
    # Signatures never enter the logsumexp.
    assert float(merged["mi_estimate"]) == pytest.approx(float(plain["mi_estimate"]), abs=1e-7)


def test_padded_rows_and_columns_equal_the_sub_matrix():
    rng = np.random.default_rng(5)
    rows, cols = 10, 6
    logp_mean = rng.normal(-2, 1, size=(rows, cols)).astype(np.float32)
    logp_sum = logp_mean * rng.integers(1, 9, size=(rows, 1)).astype(np.float32)
    col_valid = np.array([1, 1, 0, 1, 1, 0], bool)
    real_cols = np.flatnonzero(col_valid)
    true_col = rng.choice(real_cols, size=rows)
    row_valid = rng.random(rows) < 0.7
    row_valid[0] = True
    signature = np.array([0, 1, 0, 0, 4, 1])
    got = mi_metrics(
        logp_sum, logp_mean, true_col, signature, row_valid=row_valid, col_valid=col_valid
    )
    col_index = {c: i for i, c in enumerate(real_cols)}
    sub_true = np.array([col_index[c] for c in true_col[row_valid]])
    ref = reference_metrics(
        logp_sum[row_valid][:, real_cols],
        logp_mean[row_valid][:, real_cols],
        sub_true,
        signature[real_cols],
    )
    assert_matches_reference(got, ref, len(real_cols))
    assert float(got["num_rows"]) == row_valid.sum()
    assert float(got["num_columns"]) == len(real_cols)


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="true_col"):
        mi_metrics(np.zeros((3, 2)), np.zeros((3, 2)), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"\[M, N\]"):
        mi_metrics(np.zeros((3, 2)), np.zeros((3, 3)), np.zeros(3, np.int32))


# ----------------------------------------------------------------------------- EMA


def test_ema_initialises_to_first_value_then_decays_per_strategy():
    rng = np.random.default_rng(6)
    state = init_mi_ema_state()
    update = jax.jit(mi_metrics_with_ema)
    want_tok, want_seq = {}, {}
    for step in range(4):
        for label in ("first_turn", "trajectory"):
            cols = 4 if label == "first_turn" else 8
            logp_mean = rng.normal(-2, 1 + step, size=(8, cols)).astype(np.float32)
            logp_sum = 7 * logp_mean
            true_col = np.arange(8) % cols
            metrics = mi_metrics(logp_sum, logp_mean, true_col)
            out, state[label] = update(state[label], metrics)
            ref = reference_metrics(logp_sum, logp_mean, true_col)
            for store, key in ((want_tok, "tok"), (want_seq, "seq")):
                current = ref[key]["std"]
                store[label] = current if label not in store else 0.9 * store[label] + 0.1 * current
            assert float(out["marginal_std_ema"]) == pytest.approx(want_tok[label], rel=1e-5)
            assert float(out["marginal_std_ema_seq"]) == pytest.approx(want_seq[label], rel=1e-5)
            # mean_m (matched - marginal) / (sigma_ema + eps), computed row by row.
            matched = logp_mean[np.arange(8), true_col]
            marginal = np.array([_lse(list(r)) for r in logp_mean]) - math.log(cols)
            want_z = np.mean((matched - marginal) / (want_tok[label] + 1e-3))
            assert float(out["mi_zscore_ema"]) == pytest.approx(want_z, rel=1e-4, abs=1e-5)
    assert int(state["first_turn"].count) == 4 and int(state["trajectory"].count) == 4
    # The state is a plain pytree of arrays (what the trainer carries and orbax checkpoints).
    leaves = jax.tree_util.tree_leaves(state)
    assert len(leaves) == 6 and all(isinstance(x, jax.Array) for x in leaves)


def test_ema_skips_steps_without_a_usable_estimate():
    state = init_mi_ema_state()["trajectory"]
    good = mi_metrics(np.array([[-1.0, -2.0], [-3.0, -1.0]]), np.array([[-1.0, -2.0], [-3.0, -1.0]]),
                      np.array([0, 1]))
    _, state = mi_metrics_with_ema(state, good)
    single_column = mi_metrics(np.ones((3, 1)), np.ones((3, 1)), np.zeros(3, np.int32))
    _, after = mi_metrics_with_ema(state, single_column)
    assert float(after.token) == pytest.approx(float(state.token))
    assert int(after.count) == 1


def test_compute_schedule_matches_ragen():
    assert [s for s in range(0, 21) if should_compute_mi(s, 5)] == [1, 5, 10, 15, 20]
    assert [s for s in range(0, 4) if should_compute_mi(s, 1)] == [1, 2, 3]
    with pytest.raises(ValueError, match="compute_freq"):
        should_compute_mi(3, 0)


# ----------------------------------------------------------------------------- pair sampling

PROMPT, THINK, REASON, OTHER = "prompt", "think", "reason", "other"


def build_batch(trajectories, length):
    """trajectories: list of segment lists [(kind, turn, token_list)]; PAD = None segments of 0s.

    Returns the plain arrays the sampling functions take, plus the per-(b, t) reference X and Z.
    """
    batch = len(trajectories)
    tokens = np.zeros((batch, length), np.int32)
    valid = np.zeros((batch, length), bool)
    reasoning = np.zeros((batch, length), bool)
    turn_ids = np.full((batch, length), -1, np.int32)
    reference = {}
    for b, segments in enumerate(trajectories):
        pos = 0
        seen = []  # real tokens so far
        for kind, turn, toks in segments:
            for tok in toks:
                if kind == "pad":
                    pos += 1
                    continue
                tokens[b, pos] = tok
                valid[b, pos] = True
                turn_ids[b, pos] = turn
                if kind == REASON:
                    reasoning[b, pos] = True
                    entry = reference.setdefault((b, turn), {"x": list(seen), "z": []})
                    entry["z"].append(tok)
                seen.append(tok)
                pos += 1
    return tokens, valid, reasoning, turn_ids, reference


def _turn(turn, prompt, reason, tail=(90, 91)):
    segs = [(PROMPT, -1, prompt), (THINK, turn, [7])]
    if reason:
        segs.append((REASON, turn, reason))
    segs.append((OTHER, turn, [8, *tail]))
    return segs


@pytest.fixture(scope="module")
def small_batch():
    # 2 groups x 3 samples. Group 0 prompt [1, 2, 3]; group 1 prompt [4, 5]. Trajectory 2 has an
    # empty first-turn reasoning (format failure); trajectory 4 has a padding hole in its second turn.
    p0, p1 = [1, 2, 3], [4, 5]
    trajectories = [
        _turn(0, p0, [11, 12]) + _turn(1, [60], [13]),
        _turn(0, p0, [14]) + _turn(1, [61], [15, 16, 17]) + _turn(2, [62], [18]),
        _turn(0, p0, []) + _turn(1, [63], [19]),
        _turn(0, p1, [21, 22, 23]),
        _turn(0, p1, [24]) + [("pad", -1, [0, 0])] + _turn(1, [64], [25, 26]),
        _turn(0, p1, [27, 28]),
    ]
    arrays = build_batch(trajectories, length=32)
    group_ids = np.array([0, 0, 0, 1, 1, 1], np.int32)
    return arrays, group_ids


def _unpack(tokens, valid):
    return [int(t) for t, v in zip(tokens, valid) if v]


def test_first_turn_sampling_takes_all_valid_rows_and_groups_as_columns(small_batch):
    (tokens, valid, reasoning, turn_ids, reference), group_ids = small_batch
    sample = jax.jit(
        sample_first_turn_pairs,
        static_argnames=("num_samples", "num_groups", "prompt_len", "reasoning_len"),
    )
    pairs = sample(
        jax.random.key(0), tokens, valid, reasoning, turn_ids, group_ids,
        num_samples=8, num_groups=2, prompt_len=6, reasoning_len=4,
    )
    assert pairs.z_tokens.shape == (6, 4) and pairs.x_tokens.shape == (2, 6)
    chosen = sorted(int(b) for b, ok in zip(pairs.row_traj, pairs.row_valid) if ok)
    assert chosen == [0, 1, 3, 4, 5]  # trajectory 2 has no first-turn reasoning
    for m in range(6):
        if not pairs.row_valid[m]:
            assert not np.any(pairs.z_valid[m])
            continue
        b = int(pairs.row_traj[m])
        assert _unpack(pairs.z_tokens[m], pairs.z_valid[m]) == reference[(b, 0)]["z"]
        assert int(pairs.true_col[m]) == group_ids[b]
        # z is left-aligned: its valid slots form a prefix.
        count = int(pairs.z_valid[m].sum())
        assert pairs.z_valid[m][:count].all()
    assert _unpack(pairs.x_tokens[0], pairs.x_valid[0]) == [1, 2, 3, 7]
    assert _unpack(pairs.x_tokens[1], pairs.x_valid[1]) == [4, 5, 7]
    assert bool(pairs.x_valid[1, -1]) and not bool(pairs.x_valid[1, 0])  # right-aligned
    assert list(np.asarray(pairs.col_valid)) == [True, True]
    assert list(np.asarray(pairs.col_signature)) == [0, 1]
    assert int(pairs.num_truncated) == 0 and int(pairs.num_inconsistent) == 0


def test_first_turn_subsampling_is_uniform_without_replacement(small_batch):
    (tokens, valid, reasoning, turn_ids, _), group_ids = small_batch
    keys = jax.random.split(jax.random.key(1), 3000)

    def draw(key):
        pairs = sample_first_turn_pairs(
            key, tokens, valid, reasoning, turn_ids, group_ids,
            num_samples=2, num_groups=2, prompt_len=6, reasoning_len=4,
        )
        return pairs.row_traj, pairs.row_valid

    traj, row_valid = jax.jit(jax.vmap(draw))(keys)
    traj, row_valid = np.asarray(traj), np.asarray(row_valid)
    assert row_valid.all()
    assert np.all(traj[:, 0] != traj[:, 1])
    freq = np.bincount(traj.ravel(), minlength=6) / len(keys)
    # 2 of the 5 valid first turns: each drawn with probability 2/5; trajectory 2 never.
    assert freq[2] == 0
    np.testing.assert_allclose(freq[[0, 1, 3, 4, 5]], 0.4, atol=0.04)


def test_first_turn_flags_truncation_and_inconsistent_groups(small_batch):
    (tokens, valid, reasoning, turn_ids, _), group_ids = small_batch
    mixed_groups = np.array([0, 1, 0, 1, 1, 1], np.int32)  # trajectory 1 (prompt p0) in group 1
    pairs = sample_first_turn_pairs(
        jax.random.key(2), tokens, valid, reasoning, turn_ids, mixed_groups,
        num_samples=6, num_groups=2, prompt_len=6, reasoning_len=2,
    )
    # Trajectory 3 (reasoning of 3 tokens) does not fit reasoning_len = 2.
    assert int(pairs.num_truncated) == 1
    # Group 1 holds prompts p0 and p1: whichever is the column, the other rows are inconsistent.
    assert int(pairs.num_inconsistent) in (1, 3)


def test_first_turn_with_one_group_and_one_sample():
    tokens, valid, reasoning, turn_ids, reference = build_batch(
        [_turn(0, [1, 2], [11, 12, 13])], length=12
    )
    pairs = sample_first_turn_pairs(
        jax.random.key(3), tokens, valid, reasoning, turn_ids, np.zeros(1, np.int32),
        num_samples=64, num_groups=1, prompt_len=4, reasoning_len=4,
    )
    assert pairs.z_tokens.shape == (1, 4) and pairs.x_tokens.shape == (1, 4)
    assert bool(pairs.row_valid[0]) and bool(pairs.col_valid[0])
    assert _unpack(pairs.x_tokens[0], pairs.x_valid[0]) == [1, 2, 7]
    assert _unpack(pairs.z_tokens[0], pairs.z_valid[0]) == [11, 12, 13]


def test_trajectory_sampling_packs_full_context_and_one_column_per_draw(small_batch):
    (tokens, valid, reasoning, turn_ids, reference), _ = small_batch
    pairs = jax.jit(
        sample_trajectory_pairs,
        static_argnames=("num_samples", "max_turns", "prompt_len", "reasoning_len"),
    )(
        jax.random.key(4), tokens, valid, reasoning, turn_ids,
        num_samples=10, max_turns=3, prompt_len=24, reasoning_len=4,
    )
    assert pairs.x_tokens.shape == (10, 24) and pairs.z_tokens.shape == (10, 4)
    assert np.asarray(pairs.row_valid).all()  # 10 valid turns in the batch: all 10 draws are real
    np.testing.assert_array_equal(pairs.true_col, np.arange(10))
    contexts = []
    for m in range(10):
        b, t = int(pairs.row_traj[m]), int(pairs.row_turn[m])
        assert (b, t) in reference and reference[(b, t)]["z"], (b, t)
        assert _unpack(pairs.x_tokens[m], pairs.x_valid[m]) == reference[(b, t)]["x"]
        assert _unpack(pairs.z_tokens[m], pairs.z_valid[m]) == reference[(b, t)]["z"]
        contexts.append(tuple(reference[(b, t)]["x"]))
    # Signature: the first column with the identical context.
    for m in range(10):
        assert int(pairs.col_signature[m]) == contexts.index(contexts[m])


def test_trajectory_sampling_distribution_and_draw_cap(small_batch):
    (tokens, valid, reasoning, turn_ids, reference), _ = small_batch
    keys = jax.random.split(jax.random.key(5), 1000)

    def draw(key):
        pairs = sample_trajectory_pairs(
            key, tokens, valid, reasoning, turn_ids,
            num_samples=8, max_turns=3, prompt_len=24, reasoning_len=4,
        )
        return pairs.row_traj, pairs.row_turn

    traj, turn = (np.asarray(a).ravel() for a in jax.jit(jax.vmap(draw))(keys))
    valid_turns = {}
    for b, t in reference:
        if reference[(b, t)]["z"]:
            valid_turns.setdefault(b, []).append(t)
    # Pr(b, t) = 1/6 * 1/T_b: every trajectory has a valid turn here.
    for b, turns in valid_turns.items():
        for t in turns:
            freq = np.mean((traj == b) & (turn == t))
            assert freq == pytest.approx(1 / 6 / len(turns), abs=0.015), (b, t)
    assert set(zip(traj.tolist(), turn.tolist())) <= {(b, t) for b in valid_turns for t in valid_turns[b]}

    # At most (number of valid turns) draws: with 2 valid turns and 5 draws, 3 rows are padding.
    few = build_batch([_turn(0, [1], [11]) + _turn(1, [2], [12]), _turn(0, [3], [])], length=16)
    pairs = sample_trajectory_pairs(
        jax.random.key(6), *few[:4], num_samples=5, max_turns=2, prompt_len=12, reasoning_len=2
    )
    assert list(np.asarray(pairs.row_valid)) == [True, True, False, False, False]
    assert np.asarray(pairs.row_traj)[:2].tolist() == [0, 0]
    assert not np.any(pairs.x_valid[2:]) and not np.any(pairs.z_valid[2:])
