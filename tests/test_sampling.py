"""The sampler: cached decode against the teacher-forced full forward, multi-turn append, log-probs
against the trainer's path, stops, inactive rows, top-k / top-p, and trace counts.

References: the model's full (cache-free) causal forward over the whole conversation, greedy decoding
by repeated full forwards, ``sequence_logprobs`` (the trainer's path) on the conversation with its
holes removed, and plain numpy re-implementations of the top-k / top-p rules and of the stop rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models.config import get_preset
from ragen_jax.models.logprobs import sequence_logprobs
from ragen_jax.models.tokenizers import CharTokenizer
from ragen_jax.models.transformer import Transformer
from ragen_jax.sampling.sampler import (
    Sampler,
    SamplingConfig,
    filter_logits,
    generate_text,
    init_sampler_state,
    left_pad,
    pick_tokens,
)
from tests._tolerance import logit_tolerance, logprob_entropy_tolerance

PROMPT_LEN = 16  # prompt bucket
OBS_LEN = 8  # observation bucket
N = 8  # max_new_tokens
MAX_LEN = 48  # cache slots (> the 40 the conversation uses, so kv_len < max_len is exercised)
TEMPERATURE = 0.8
EOS_IDS = tuple(range(8, 38))  # many eos ids, so that sampled rows stop at different steps
CONV_ACTIVE_TURN1 = np.array([True, True, True, False])


@pytest.fixture(scope="module")
def cfg():
    # attention_block=8: the cache's windows (up to 48 slots) and the full forwards attend in blocks.
    return get_preset("tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, attention_block=8)


def _peaked_params(params, cfg, seed):
    """Random weights at fan-in scale (the default 0.02 init gives near-uniform next-token
    distributions that repeat the last token; these give varied, peaked ones)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = []
    for key, x in zip(keys, leaves):
        if x.ndim == 2:
            scale = 0.3 if x.shape[0] == cfg.vocab_size else 1.0 / np.sqrt(x.shape[0])
            new.append(scale * jax.random.normal(key, x.shape))
        elif x.shape == (cfg.hidden_size,):  # norm weights
            new.append(1.0 + 0.1 * jax.random.normal(key, x.shape))
        else:  # biases
            new.append(0.1 * jax.random.normal(key, x.shape))
    return jax.tree.unflatten(treedef, new)


@pytest.fixture(scope="module")
def model_parts(cfg):
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    return graphdef, _peaked_params(params, cfg, seed=1)


@pytest.fixture(scope="module")
def full_forward(model_parts):
    """Teacher-forced logits of the cache-free forward.  f32[B, L, V]"""
    graphdef, _ = model_parts

    @jax.jit
    def forward(params, tokens, valid):
        return nnx.merge(graphdef, params)(tokens, valid)[0]

    return forward


@pytest.fixture(scope="module")
def trainer_logprobs(model_parts):
    graphdef, _ = model_parts

    @jax.jit
    def logprobs(params, tokens, valid, temperature):
        return sequence_logprobs(nnx.merge(graphdef, params), tokens, valid, temperature)

    return logprobs


def _prompts(seed, lengths=(5, 9, 12, 16)):
    rng = np.random.default_rng(seed)
    return left_pad([rng.integers(38, 264, n).tolist() for n in lengths], PROMPT_LEN)


def _observations(seed, lengths=(3, 0, 6, 5)):
    """Right-padded observations (row 1 has none)."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), OBS_LEN), np.int32)
    valid = np.zeros((len(lengths), OBS_LEN), bool)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(38, 264, n)
        valid[i, :n] = True
    return tokens, valid


def _previous_valid(valid):
    """prev[b, t] = index of the last valid position before t in row b (-1 if none)."""
    prev = np.full(valid.shape, -1)
    for b in range(valid.shape[0]):
        last = -1
        for t in range(valid.shape[1]):
            prev[b, t] = last
            if valid[b, t]:
                last = t
    return prev


def _compact(tokens, valid):
    """Move each row's valid tokens to the front (removing the holes); also return the map."""
    out_tokens = np.zeros_like(tokens)
    out_valid = np.zeros_like(valid)
    where = np.full(valid.shape, -1)
    for b in range(tokens.shape[0]):
        idx = np.flatnonzero(valid[b])
        out_tokens[b, : len(idx)] = tokens[b, idx]
        out_valid[b, : len(idx)] = True
        where[b, idx] = np.arange(len(idx))
    return out_tokens, out_valid, where


# ----------------------------------------------------------------------------- a two-turn conversation


@pytest.fixture(scope="module")
def sampling_sampler(model_parts):
    graphdef, _ = model_parts
    # prefill_chunk=4: the prompt is appended in 4 chunks, the observation in the 2 that hold tokens.
    return Sampler(graphdef, SamplingConfig(
        max_new_tokens=N, eos_ids=EOS_IDS, kv_block=8, decode_segment=4, prefill_chunk=4, return_logits=True))


def _run_conversation(sampler, params, cfg, prompt_seed, obs_seed, keys, temperature, active1):
    tokens, valid = _prompts(prompt_seed)
    state = init_sampler_state(cfg, 4, MAX_LEN)
    state = sampler.append(params, state, tokens, valid)
    out1, state = sampler.generate(params, state, keys[0], temperature, active1)
    obs_tokens, obs_valid = _observations(obs_seed)
    state = sampler.append(params, state, obs_tokens, obs_valid)
    logits_after_obs = np.asarray(state.last_logits)  # the state is donated by the next call
    out2, state = sampler.generate(params, state, keys[1], temperature)
    return dict(prompt=(tokens, valid), obs=(obs_tokens, obs_valid), out1=out1, out2=out2,
                logits_after_obs=logits_after_obs, state=state)


@pytest.fixture(scope="module")
def conversation(sampling_sampler, model_parts, cfg):
    _, params = model_parts
    keys = jax.random.split(jax.random.key(7), 2)
    conv = _run_conversation(sampling_sampler, params, cfg, 0, 1, keys, TEMPERATURE,
                             CONV_ACTIVE_TURN1)
    (p_tok, p_val), (o_tok, o_val) = conv["prompt"], conv["obs"]
    out1, out2 = conv["out1"], conv["out2"]
    conv["tokens"] = np.concatenate(
        [p_tok, np.asarray(out1.tokens), o_tok, np.asarray(out2.tokens)], axis=1)
    conv["valid"] = np.concatenate(
        [p_val, np.asarray(out1.valid), o_val, np.asarray(out2.valid)], axis=1)
    return conv


def test_conversation_has_holes_of_every_kind(conversation):
    """Preconditions of the tests below: early stops, a full-length row and an inactive row."""
    lengths1 = np.asarray(conversation["out1"].lengths)
    lengths2 = np.asarray(conversation["out2"].lengths)
    assert lengths1[3] == 0  # inactive in turn 1
    assert np.any((lengths1[:3] > 0) & (lengths1[:3] < N)) or np.any((lengths2 > 0) & (lengths2 < N))
    assert np.any(np.concatenate([lengths1, lengths2]) == N)
    stopped = np.asarray(conversation["out1"].stopped)
    last = np.asarray(conversation["out1"].tokens)[np.arange(4), np.maximum(lengths1 - 1, 0)]
    np.testing.assert_array_equal(stopped, (lengths1 > 0) & np.isin(last, EOS_IDS))


def test_cached_logits_match_full_forward(conversation, full_forward, model_parts):
    """Every decoded token's logits (both turns, after an appended observation) equal the
    teacher-forced forward over the whole conversation at the previous valid position."""
    _, params = model_parts
    tokens, valid = conversation["tokens"], conversation["valid"]
    full = np.asarray(full_forward(params, tokens, valid))
    prev = _previous_valid(valid)
    starts = {"out1": PROMPT_LEN, "out2": PROMPT_LEN + N + OBS_LEN}
    checked = 0
    for name, start in starts.items():
        out = conversation[name]
        step_logits, out_valid = np.asarray(out.logits), np.asarray(out.valid)
        for b, i in zip(*np.nonzero(out_valid)):
            reference = full[b, prev[b, start + i]]
            np.testing.assert_allclose(step_logits[b, i], reference, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked == valid[:, PROMPT_LEN:].sum() - conversation["obs"][1].sum()

    # The logits the appended observation leaves behind (row 1 appended nothing: it keeps its own).
    obs_end = PROMPT_LEN + N + OBS_LEN
    last_before_turn2 = prev[:, obs_end]
    expected = full[np.arange(4), last_before_turn2]
    np.testing.assert_allclose(conversation["logits_after_obs"], expected, atol=1e-5, rtol=1e-5)
    # And the state after turn 2 predicts the token after the whole conversation.
    last = np.array([np.flatnonzero(v)[-1] for v in valid])
    np.testing.assert_allclose(np.asarray(conversation["state"].last_logits),
                               full[np.arange(4), last], atol=1e-5, rtol=1e-5)


def test_sampler_logprobs_equal_trainer_logprobs(conversation, trainer_logprobs, full_forward, model_parts, cfg):
    """Log-probs and entropies recorded while sampling equal ``sequence_logprobs`` recomputed on the
    conversation with its holes removed (what the trainer sees), within the float32 bound of two
    reduction orders (tests/_tolerance.py)."""
    _, params = model_parts
    compact_tokens, compact_valid, where = _compact(conversation["tokens"], conversation["valid"])
    logp, entropy = trainer_logprobs(params, compact_tokens, compact_valid, TEMPERATURE)
    logp, entropy = np.asarray(logp), np.asarray(entropy)
    # The compact rows have no holes: token j is predicted from position j - 1.
    logits = np.asarray(full_forward(params, compact_tokens, compact_valid))
    longest = max(cfg.intermediate_size, cfg.hidden_size, MAX_LEN)
    starts = {"out1": PROMPT_LEN, "out2": PROMPT_LEN + N + OBS_LEN}
    checked = 0
    for name, start in starts.items():
        out = conversation[name]
        out_valid = np.asarray(out.valid)
        for b, i in zip(*np.nonzero(out_valid)):
            j = where[b, start + i]
            z = logits[b, j - 1]
            logp_tol, entropy_tol = logprob_entropy_tolerance(
                z, TEMPERATURE, logit_tolerance(z, longest, depth=2 * cfg.num_layers + 1))
            np.testing.assert_allclose(np.asarray(out.logprobs)[b, i], logp[b, j], rtol=0, atol=logp_tol)
            np.testing.assert_allclose(np.asarray(out.entropy)[b, i], entropy[b, j], rtol=0, atol=entropy_tol)
            checked += 1
        np.testing.assert_array_equal(np.asarray(out.logprobs)[~out_valid], 0.0)
    assert checked > 0


def test_cache_bookkeeping_after_two_turns(conversation, cfg):
    """The static bound advances by T per append and N per generate. In the cache, the second append
    first moved each row's turn-1 tokens to its front (the early stops' and the inactive row's holes
    are gone), then wrote the observation's columns up to the last one any row fills, then one slot per
    decode step some row emitted in; every other slot is invalid. RoPE positions count only valid tokens."""
    state, valid = conversation["state"], conversation["valid"]
    assert state.end == PROMPT_LEN + N + OBS_LEN + N
    (_, p_val), (_, o_val) = conversation["prompt"], conversation["obs"]
    out1, out2 = conversation["out1"], conversation["out2"]
    turn1 = p_val.sum(axis=1) + np.asarray(out1.lengths)
    obs_used = int(np.max(np.nonzero(o_val.any(axis=0))[0])) + 1
    steps2 = int(np.asarray(out2.lengths).max())
    expected = np.zeros((4, state.max_len), bool)
    for b in range(4):
        row = np.concatenate([np.arange(turn1.max()) < turn1[b], o_val[b, :obs_used],
                              np.asarray(out2.valid)[b, :steps2]])
        expected[b, :row.size] = row
    assert int(state.cache.end) == turn1.max() + obs_used + steps2 < state.end
    np.testing.assert_array_equal(np.asarray(state.cache.slot_valid), expected)
    np.testing.assert_array_equal(np.asarray(state.cache.next_pos), valid.sum(axis=1))
    out1 = conversation["out1"]
    np.testing.assert_array_equal(np.asarray(out1.tokens)[~np.asarray(out1.valid)], 0)
    lengths = np.asarray(out1.lengths)
    for b in range(4):  # valid is a prefix of each row
        np.testing.assert_array_equal(np.asarray(out1.valid)[b], np.arange(N) < lengths[b])


def test_a_chunked_append_fills_the_cache_as_one_block_does(model_parts, cfg):
    """prefill_chunk runs the model over 4 columns at a time and stops after the last filled column:
    same slots, positions and end as one block, logits within float32 rounding of it."""
    graphdef, params = model_parts
    tokens, valid = _prompts(3)
    tokens, valid = np.pad(tokens, ((0, 0), (0, 7))), np.pad(valid, ((0, 0), (0, 7)))  # padding-only tail
    states = {}
    for chunk in (0, 4):
        sampler = Sampler(graphdef, SamplingConfig(max_new_tokens=N, kv_block=8, prefill_chunk=chunk))
        states[chunk] = sampler.append(params, init_sampler_state(cfg, 4, MAX_LEN), tokens, valid)
    whole, chunked = states[0], states[4]
    assert int(whole.cache.end) == int(chunked.cache.end) == PROMPT_LEN
    for name in ("slot_valid", "next_pos"):
        np.testing.assert_array_equal(np.asarray(getattr(chunked.cache, name)), np.asarray(getattr(whole.cache, name)))
    want = np.asarray(whole.last_logits)
    tol = logit_tolerance(want, max(cfg.intermediate_size, cfg.hidden_size, MAX_LEN), depth=2 * cfg.num_layers + 1)
    assert np.all(np.max(np.abs(np.asarray(chunked.last_logits) - want), axis=-1) <= tol)


def test_same_bucket_new_prompts_temperature_and_weights_do_not_retrace(
    conversation, sampling_sampler, model_parts, cfg
):
    _, params = model_parts
    counts = dict(sampling_sampler.trace_counts)
    assert counts == {"append": 2, "generate": 2}  # one per turn position (end is static)
    new_params = jax.tree.map(lambda x: x * 1.01, params)
    keys = jax.random.split(jax.random.key(99), 2)
    again = _run_conversation(sampling_sampler, new_params, cfg, 5, 6, keys, 1.3,
                              np.array([True, False, True, True]))
    assert sampling_sampler.trace_counts == counts
    assert not np.array_equal(np.asarray(again["out1"].tokens),
                              np.asarray(conversation["out1"].tokens))


# ----------------------------------------------------------------------------- greedy family


@pytest.fixture(scope="module")
def greedy_sampler(model_parts):
    return Sampler(model_parts[0], SamplingConfig(max_new_tokens=N, greedy=True, kv_block=8))


def _prefilled(greedy_sampler, params, cfg):
    """A fresh state holding three left-padded prompts (each generate donates its state)."""
    tokens, valid = _prompts(0, lengths=(5, 9, 12))
    return greedy_sampler.append(params, init_sampler_state(cfg, 3, MAX_LEN), tokens, valid)


@pytest.fixture(scope="module")
def greedy_run(greedy_sampler, model_parts, cfg):
    _, params = model_parts
    state = _prefilled(greedy_sampler, params, cfg)
    out, _ = greedy_sampler.generate(params, state, jax.random.key(0), 1.0)
    return out


def _greedy_reference(full_forward, params, tokens, valid):
    """Argmax decoding without a cache: re-run the whole sequence for every new token.  int32[B, N]"""
    buffer = np.concatenate([tokens, np.zeros((tokens.shape[0], N), np.int32)], axis=1)
    buffer_valid = np.concatenate([valid, np.zeros((tokens.shape[0], N), bool)], axis=1)
    for i in range(N):
        logits = np.asarray(full_forward(params, buffer, buffer_valid))
        buffer[:, PROMPT_LEN + i] = logits[:, PROMPT_LEN + i - 1].argmax(-1)
        buffer_valid[:, PROMPT_LEN + i] = True
    return buffer[:, PROMPT_LEN:]


def test_greedy_equals_argmax_decoding_of_full_forward(greedy_run, full_forward, model_parts):
    _, params = model_parts
    tokens, valid = _prompts(0, lengths=(5, 9, 12))
    reference = _greedy_reference(full_forward, params, tokens, valid)
    np.testing.assert_array_equal(np.asarray(greedy_run.tokens), reference)
    assert np.asarray(greedy_run.valid).all() and not np.asarray(greedy_run.stopped).any()


def test_generate_text_is_greedy_decoding_of_the_prompts(model_parts, full_forward):
    graphdef, params = model_parts
    tokenizer = CharTokenizer()
    prompts = ["Hello", "<|im_start|>user\nhi", "0123456789abcdef"]
    texts = generate_text(nnx.merge(graphdef, params), tokenizer, prompts, max_new_tokens=N,
                          greedy=True)
    tokens, valid = left_pad([tokenizer.encode(p) for p in prompts], PROMPT_LEN)
    reference = _greedy_reference(full_forward, params, tokens, valid).tolist()
    for row, text in zip(reference, texts):
        stops = [i for i, t in enumerate(row) if t in tokenizer.eos_ids]
        assert text == tokenizer.decode(row[: stops[0] + 1] if stops else row)


def test_inactive_rows_stay_untouched(greedy_sampler, greedy_run, model_parts, cfg):
    _, params = model_parts
    state = _prefilled(greedy_sampler, params, cfg)
    logits_before = np.asarray(state.last_logits)
    next_pos_before = np.asarray(state.cache.next_pos)
    out, state = greedy_sampler.generate(params, state, jax.random.key(0), 1.0,
                                         np.array([True, False, True]))
    np.testing.assert_array_equal(np.asarray(out.tokens)[[0, 2]],
                                  np.asarray(greedy_run.tokens)[[0, 2]])
    assert not np.asarray(out.valid)[1].any() and int(out.lengths[1]) == 0
    np.testing.assert_array_equal(np.asarray(out.tokens)[1], 0)
    np.testing.assert_array_equal(np.asarray(out.logprobs)[1], 0.0)
    assert not np.asarray(state.cache.slot_valid)[1, PROMPT_LEN:].any()
    assert int(state.cache.next_pos[1]) == next_pos_before[1]
    np.testing.assert_array_equal(np.asarray(state.last_logits)[1], logits_before[1])
    assert state.end == PROMPT_LEN + N


def _expected_stops(greedy_tokens, eos, stop_seq):
    """Plain-Python stop rule on the (prefix-consistent) greedy outputs: (lengths, stopped)."""
    lengths, stopped = [], []
    for row in greedy_tokens.tolist():
        length = len(row)
        for i, tok in enumerate(row):
            ends_with_seq = i + 1 >= len(stop_seq) and tuple(row[i + 1 - len(stop_seq): i + 1]) == stop_seq
            if tok == eos or ends_with_seq:
                length = i + 1
                break
        lengths.append(length)
        stopped.append(length < len(row) or row[-1] == eos)
    return np.array(lengths), np.array(stopped)


def test_per_row_stop_on_eos_and_on_a_stop_sequence(greedy_run, greedy_sampler, model_parts, cfg):
    _, params = model_parts
    greedy_tokens = np.asarray(greedy_run.tokens)
    # eos: the first token of row 0 that differs from its first token; the stop sequence: the first
    # change of token in row 2 (so one row stops on each rule; checked below).
    k = int(np.flatnonzero(greedy_tokens[0] != greedy_tokens[0, 0])[0])
    eos = int(greedy_tokens[0, k])
    m = int(np.flatnonzero(greedy_tokens[2, 1:] != greedy_tokens[2, :-1])[0]) + 1
    stop_seq = (int(greedy_tokens[2, m - 1]), int(greedy_tokens[2, m]))
    lengths, stopped = _expected_stops(greedy_tokens, eos, stop_seq)
    assert lengths[0] < N and lengths[2] < N and greedy_tokens[2, lengths[2] - 1] != eos

    sampler = Sampler(model_parts[0], SamplingConfig(
        max_new_tokens=N, greedy=True, kv_block=8, eos_ids=(eos,), stop_sequences=(stop_seq,),
        pad_id=3))
    state = _prefilled(greedy_sampler, params, cfg)
    out, state = sampler.generate(params, state, jax.random.key(0), 1.0)
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(out.stopped), stopped)
    for b in range(3):
        np.testing.assert_array_equal(np.asarray(out.tokens)[b, : lengths[b]],
                                      greedy_tokens[b, : lengths[b]])
        np.testing.assert_array_equal(np.asarray(out.tokens)[b, lengths[b]:], 3)
        valid_slots = np.asarray(state.cache.slot_valid)[b, PROMPT_LEN: PROMPT_LEN + N]
        np.testing.assert_array_equal(valid_slots, np.arange(N) < lengths[b])
    assert state.end == PROMPT_LEN + N and int(state.cache.end) == PROMPT_LEN + N


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p~0"])
def test_degenerate_top_k_and_top_p_equal_greedy(filters, greedy_run, greedy_sampler, model_parts,
                                                 cfg):
    """Sampling restricted to the single most likely token is greedy decoding, and the recorded
    log-probs stay those of the full-vocabulary distribution (not 0 = log 1 of the filtered one)."""
    _, params = model_parts
    sampler = Sampler(model_parts[0], SamplingConfig(max_new_tokens=N, kv_block=8, **filters))
    state = _prefilled(greedy_sampler, params, cfg)
    out, _ = sampler.generate(params, state, jax.random.key(3), 1.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy_run.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(greedy_run.logprobs), atol=1e-6)
    assert (np.asarray(out.logprobs) < -1e-3).any()


# ----------------------------------------------------------------------------- sampling rules


def _numpy_filter(z, top_k, top_p):
    z = np.array(z, np.float64)
    for row in z:
        if top_k:
            kth = np.sort(row)[::-1][top_k - 1]
            row[row < kth] = -np.inf
        if top_p < 1.0:
            order = np.argsort(-row)
            probs = np.exp(row[order] - row[order[0]])
            probs /= probs.sum()
            kept, mass = [], 0.0
            for idx, p in zip(order, probs):
                if mass >= top_p:
                    break
                kept.append(idx)
                mass += p
            mask = np.ones(row.shape, bool)
            mask[kept] = False
            row[mask] = -np.inf
    return z


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7), (10, 0.5), (0, 0.999)])
def test_filter_logits_matches_numpy(top_k, top_p):
    z = jax.random.normal(jax.random.key(0), (6, 40)) * 2.0
    got = np.asarray(filter_logits(z, top_k, top_p))
    expected = _numpy_filter(np.asarray(z), top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    np.testing.assert_allclose(got[np.isfinite(got)], np.asarray(z)[np.isfinite(got)])


def test_sampling_frequencies_follow_the_temperature_scaled_softmax():
    logits = jnp.array([1.0, 0.0, -0.5, 2.0])
    temperature = 2.0
    draws = pick_tokens(jnp.tile(logits, (40_000, 1)), jax.random.key(0),
                        jnp.float32(temperature), SamplingConfig(max_new_tokens=1))
    freq = np.bincount(np.asarray(draws), minlength=4) / draws.shape[0]
    expected = np.exp(np.asarray(logits) / temperature)
    expected /= expected.sum()
    np.testing.assert_allclose(freq, expected, atol=0.01)


# ----------------------------------------------------------------------------- user errors


def test_user_errors_name_the_fix(greedy_sampler, sampling_sampler, model_parts, cfg):
    _, params = model_parts
    state = init_sampler_state(cfg, 3, 20)
    with pytest.raises(ValueError, match="max_len"):
        greedy_sampler.append(params, state, np.zeros((3, 24), np.int32))
    with pytest.raises(ValueError, match="greedy=True"):
        sampling_sampler.generate(params, init_sampler_state(cfg, 4, MAX_LEN), jax.random.key(0), 0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="more than the padded length"):
        left_pad([[1, 2, 3]], length=2)
    tokens, valid = left_pad([[5, 6], [7]], pad_id=0, multiple=4)
    np.testing.assert_array_equal(tokens, [[0, 0, 5, 6], [0, 0, 0, 7]])
    np.testing.assert_array_equal(valid, [[0, 0, 1, 1], [0, 0, 0, 1]])
