"""The model core against independent references: a plain-numpy decoder and its own full forward.

The numpy reference below re-derives every formula (RMSNorm, rotate-half RoPE, GQA attention with a
causal + padding mask, SwiGLU, tied head) from the parameter arrays, so a bug shared by the cache
path and the full path still shows up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models.config import RopeScaling, get_preset
from ragen_jax.models.kv_cache import cache_bytes, compact, init_cache, repeat_rows
from ragen_jax.models.logprobs import chunked_token_logprobs, logprobs_from_logits, sequence_logprobs
from ragen_jax.models.transformer import Transformer
from tests._tolerance import logit_tolerance

SMALL = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def numpy_forward(model: Transformer, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    cfg = model.cfg
    p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    x = p["embed"]["embedding"][tokens].astype(np.float64)
    b, t = tokens.shape
    pos = np.maximum(np.cumsum(valid, 1) - 1, 0)
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        wl = 2 * np.pi / inv
        lo, hi = s.original_max_position_embeddings / s.low_freq_factor, s.original_max_position_embeddings / s.high_freq_factor
        scaled = np.where(wl > lo, inv / s.factor, inv)
        sm = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        mid = (wl >= hi) & (wl <= lo)
        inv = np.where(mid, (1 - sm) * scaled / s.factor + sm * scaled, scaled)
    ang = pos[..., None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(v):  # v: [b, t, h, d]
        rot = np.concatenate([-v[..., d // 2:], v[..., : d // 2]], -1)
        return v * cos[:, :, None] + rot * sin[:, :, None]

    def norm(v, w):
        return w * v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_norm_eps)

    mask = np.tril(np.ones((t, t), bool))[None] & valid[:, None, :]
    for layer in p["layers"].values():
        a = layer["attn"]
        h = norm(x, layer["input_norm"]["weight"])
        lin = lambda v, m: v @ m["kernel"] + m.get("bias", 0.0)
        q = rope(lin(h, a["q_proj"]).reshape(b, t, cfg.num_heads, d))
        k = rope(lin(h, a["k_proj"]).reshape(b, t, cfg.num_kv_heads, d))
        v = lin(h, a["v_proj"]).reshape(b, t, cfg.num_kv_heads, d)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
        sc = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        sc = np.where(mask[:, None], sc, -1e30)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", pr, v).reshape(b, t, -1)
        x = x + lin(o, a["o_proj"])
        h = norm(x, layer["post_attn_norm"]["weight"])
        m = layer["mlp"]
        g = h @ m["gate_proj"]["kernel"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
    x = norm(x, p["final_norm"]["weight"])
    head = p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return x @ head


@pytest.fixture(scope="module", params=["qwen2_tied", "llama_untied_scaled"])
def model(request):
    if request.param == "qwen2_tied":
        cfg = get_preset("tiny", **SMALL)
    else:
        cfg = get_preset(
            "tiny", **SMALL, qkv_bias=False, tie_embeddings=False, architecture="llama",
            rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=32),
        )
    m = Transformer(cfg, rngs=nnx.Rngs(3))
    # Non-trivial biases and norm weights so the reference checks them too.
    state = nnx.state(m)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    leaves = [l + 0.05 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]
    nnx.update(m, jax.tree.unflatten(treedef, leaves))
    return m


def _batch(b=3, t=12, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(8, 264, (b, t)).astype(np.int32)
    valid = np.ones((b, t), bool)
    valid[1, :4] = False  # left padding
    valid[2, -3:] = False  # right padding
    return tokens, valid


def test_full_forward_matches_numpy_reference(model):
    tokens, valid = _batch()
    logits, cache = model(jnp.asarray(tokens), jnp.asarray(valid))
    assert cache is None and logits.dtype == jnp.float32
    ref = numpy_forward(model, tokens, valid)
    np.testing.assert_allclose(np.asarray(logits)[valid], ref[valid], atol=1e-4, rtol=1e-4)


def test_padding_never_shifts_positions(model):
    tokens, valid = _batch()
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(valid))
    row = tokens[1][valid[1]][None]
    alone, _ = model(jnp.asarray(row), jnp.ones(row.shape, bool))
    np.testing.assert_allclose(np.asarray(logits)[1][valid[1]], np.asarray(alone)[0], atol=1e-5)


def test_cache_appends_equal_full_forward_including_holes(model):
    tokens, valid = _batch(t=12)
    full, _ = model(jnp.asarray(tokens), jnp.asarray(valid))
    cache = init_cache(model.cfg, 3, 24)
    pieces = []
    for lo, hi in [(0, 5), (5, 6), (6, 12)]:
        out, cache = model(jnp.asarray(tokens[:, lo:hi]), jnp.asarray(valid[:, lo:hi]), cache=cache)
        pieces.append(out)
        if lo == 5:  # a padding-only chunk in the middle fills no slot
            _, cache = model(jnp.zeros((3, 3), jnp.int32), jnp.zeros((3, 3), bool), cache=cache, kv_len=12)
    got = np.concatenate([np.asarray(p) for p in pieces], 1)
    np.testing.assert_allclose(got[valid], np.asarray(full)[valid], atol=1e-5)
    assert int(cache.end) == 12  # columns no row fills (the padding-only chunk) take no slot
    np.testing.assert_array_equal(np.asarray(cache.next_pos), valid.sum(1))
    assert int(cache.slot_valid.sum()) == valid.sum()


def test_compact_moves_each_rows_tokens_to_its_front_and_changes_no_logit(model):
    """After appends with holes (padding anywhere), ``compact`` keeps each row's keys in order at its
    front and ``end`` at the longest row; the next append's logits are the same either way."""
    tokens, valid = _batch(t=12)
    valid[0, 3:6] = False  # a hole inside row 0
    cache = init_cache(model.cfg, 3, 24)
    _, cache = model(jnp.asarray(tokens[:, :8]), jnp.asarray(valid[:, :8]), cache=cache)
    packed = compact(cache)
    counts = valid[:, :8].sum(1)
    assert int(packed.end) == counts.max()
    np.testing.assert_array_equal(np.asarray(packed.slot_valid), np.arange(24)[None] < counts[:, None])
    for b in range(3):
        np.testing.assert_array_equal(np.asarray(packed.k)[:, b, :, :counts[b]],
                                      np.asarray(cache.k)[:, b][:, :, np.nonzero(valid[b, :8])[0]])
    nxt, nxt_valid = jnp.asarray(tokens[:, 8:]), jnp.asarray(valid[:, 8:])
    want, _ = model(nxt, nxt_valid, cache=cache)
    got, _ = model(nxt, nxt_valid, cache=packed)
    cfg, want = model.cfg, np.asarray(want)[valid[:, 8:]]
    tol = logit_tolerance(want, max(cfg.intermediate_size, cfg.hidden_size, 24), depth=2 * cfg.num_layers + 1)
    assert np.all(np.max(np.abs(np.asarray(got)[valid[:, 8:]] - want), axis=-1) <= tol)


def test_repeat_rows_shares_a_prefill(model):
    tokens, valid = _batch()
    cache = init_cache(model.cfg, 3, 16)
    _, cache = model(jnp.asarray(tokens[:, :6]), jnp.asarray(valid[:, :6]), cache=cache)
    shared = repeat_rows(cache, jnp.array([0, 0, 2]))
    out, _ = model(jnp.asarray(tokens[[0, 0, 2], 6:]), jnp.asarray(valid[[0, 0, 2], 6:]), cache=shared)
    full, _ = model(jnp.asarray(tokens[[0, 0, 2]]), jnp.asarray(valid[[0, 0, 2]]))
    m = valid[[0, 0, 2], 6:]
    np.testing.assert_allclose(np.asarray(out)[m], np.asarray(full)[:, 6:][m], atol=1e-5)


def test_chunked_logprobs_equal_unchunked_and_numpy(model):
    tokens, valid = _batch(t=12)
    hidden, _ = model(jnp.asarray(tokens), jnp.ones_like(jnp.asarray(valid)), return_hidden=True)
    targets = jnp.asarray(np.roll(tokens, -1, 1))
    whole = logprobs_from_logits(model.lm_logits(hidden), targets, 0.7)
    chunked = chunked_token_logprobs(hidden, targets, model.lm_logits, 0.7, chunk=5)
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    z = np.asarray(model.lm_logits(hidden), np.float64) / 0.7
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    ref_logp = np.take_along_axis(z, np.asarray(targets)[..., None], -1)[..., 0] - lse
    p = np.exp(z - lse[..., None])
    np.testing.assert_allclose(np.asarray(whole[0]), ref_logp, atol=1e-4)
    np.testing.assert_allclose(np.asarray(whole[1]), -(p * np.log(p)).sum(-1), atol=1e-4)


def test_sequence_logprobs_skip_holes(model):
    tokens, valid = _batch(t=10)
    holes_tokens = np.concatenate([tokens[:, :4], np.zeros((3, 3), np.int32), tokens[:, 4:]], 1)
    holes_valid = np.concatenate([valid[:, :4], np.zeros((3, 3), bool), valid[:, 4:]], 1)
    lp, _ = sequence_logprobs(model, jnp.asarray(tokens), jnp.asarray(valid), chunk=4)
    lph, _ = sequence_logprobs(model, jnp.asarray(holes_tokens), jnp.asarray(holes_valid), chunk=4)
    lph = np.concatenate([np.asarray(lph)[:, :4], np.asarray(lph)[:, 7:]], 1)
    np.testing.assert_allclose(lph, np.asarray(lp), atol=1e-5)
    # The first valid token of each row has no prediction; padding positions are zero.
    first = valid.argmax(1)
    assert np.all(np.asarray(lp)[np.arange(3), first] == 0) and np.all(np.asarray(lp)[~valid] == 0)
    ref = numpy_forward(model, tokens, valid)
    z = ref - ref.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    r = 0  # row 0 has no padding: logp[t] = log_softmax(logits[t-1])[token t]
    np.testing.assert_allclose(np.asarray(lp)[r, 1:], logsm[r, np.arange(9), tokens[r, 1:]], atol=1e-4)


def test_bfloat16_compute_gives_float32_logits():
    cfg = get_preset("tiny", **SMALL, dtype="bfloat16")
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens, valid = _batch()
    logits, _ = m(jnp.asarray(tokens), jnp.asarray(valid))
    ref, _ = Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0))(jnp.asarray(tokens), jnp.asarray(valid))
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(logits)))
    np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(ref)[valid], atol=0.05)


def test_presets_and_config_errors():
    assert 2e6 < get_preset("tiny").num_params() < 6e6
    cfg = Transformer(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0))
    assert cfg.cfg.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(cfg)))
    # Real shapes: Qwen2.5-0.5B has 494M parameters, Qwen2.5-7B 7.6B.
    assert abs(get_preset("qwen2.5-0.5b").num_params() / 494e6 - 1) < 0.01
    assert abs(get_preset("qwen2.5-7b").num_params() / 7.62e9 - 1) < 0.01
    assert abs(get_preset("llama3.2-1b").num_params() / 1.236e9 - 1) < 0.01
    assert abs(get_preset("smollm2-135m").num_params() / 134.5e6 - 1) < 0.01
    with pytest.raises(ValueError, match="Did you mean 'qwen2.5-3b'"):
        get_preset("qwen2.5-3")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        get_preset("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        get_preset("tiny", dtype="float16")
    c = get_preset("tiny")
    assert cache_bytes(c, 2, 10) == 2 * c.num_layers * 2 * c.num_kv_heads * 10 * c.head_dim * 4 + 20
