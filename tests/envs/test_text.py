"""Device text blocks: detokenization, number rendering, assembly, hand-checked parse cases."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs.text import (
    ActionVocab,
    AtomTable,
    Dynamic,
    ResponseBytes,
    Static,
    TokenFragments,
    assemble,
    format_fixed,
    parse_actions,
    parse_answer,
)
from ragen_jax.models.tokenizers import CharTokenizer

TOK = CharTokenizer()
R = 48
VOCAB = ActionVocab(("Left", "Down", "Right", "Up"), (1, 2, 3, 4))


def pad(ids, size=R, fill=0):
    out = np.full((size,), fill, np.int32)
    out[: len(ids)] = ids
    return jnp.asarray(out)


@pytest.fixture(scope="module")
def response_bytes():
    return ResponseBytes.from_tokenizer(TOK)


@pytest.fixture(scope="module")
def parse_fn(response_bytes):
    @jax.jit
    def run(tokens, length):
        buf, n = response_bytes(tokens, length)
        return parse_actions(buf, n, VOCAB, 2)

    return run


def test_response_bytes_matches_host_decode(response_bytes):
    text = "ab<think>\u00e9\u221a</answer>z"
    ids = TOK.encode(text)
    buf, n = jax.jit(lambda t, l: response_bytes(t, l))(pad(ids), len(ids))
    assert bytes(np.asarray(buf[: int(n)])) == text.encode("utf-8")
    assert not np.asarray(buf[int(n):]).any()
    # Truncation by length, and garbage ids (out of range, pad) contribute no bytes.
    garbage = pad(ids[:5] + [-7, TOK.vocab_size + 3, TOK.pad_id] + ids[5:], fill=99)
    buf, n = jax.jit(lambda t, l: response_bytes(t, l))(garbage, 8)
    assert bytes(np.asarray(buf[: int(n)])) == TOK.decode(ids[:5]).encode("utf-8")


@pytest.mark.parametrize(
    "response, expected",
    [
        ("go</think><answer>Up || left</answer>", (True, [4, 1], 2)),
        ("</think>\n \t<answer>DOWN</answer>tail", (True, [2], 1)),
        ("</think>x<answer>Up</answer>", (False, [], 0)),  # text between the tags
        ("a</think>b</think>\u3000<answer>Up||x</answer>", (True, [4], 2)),  # second </think> matches
        ("</think><answer>Up||Down||Left</answer>", (True, [4, 2], 2)),  # keep the first 2 pieces
        ("</think><answer>|||up||||</answer>", (True, [], 1)),  # "|up" is not an action
        ("</think><answer>U<|im_end|>p</answer>", (True, [4], 1)),  # special strings are removed
        ("</think><answer></answer>", (True, [], 0)),
        ("</think><answer>Up", (False, [], 0)),
        ("", (False, [], 0)),
        ("</think><answer>\u212aup</answer>", (True, [], 1)),  # Kelvin sign folds to k: "kup"
    ],
)
def test_parse_hand_cases(parse_fn, response, expected):
    ids = TOK.encode(response)
    parsed = parse_fn(pad(ids), len(ids))
    got = (bool(parsed.matched), np.asarray(parsed.actions)[: int(parsed.n_valid)].tolist(), int(parsed.n_parsed))
    assert got == expected
    assert bool(parsed.format_ok) == (expected[0] and len(expected[1]) > 0 and len(expected[1]) == expected[2])


def test_kelvin_sign_matches_python_lower():
    vocab = ActionVocab(("StockBroker", "Teacher"), (7, 9))
    rb = ResponseBytes.from_tokenizer(TOK)
    ids = TOK.encode("</think><answer> Stoc\u212aBROKER || teacher </answer>")
    parsed = jax.jit(lambda t, l: parse_actions(*rb(t, l), vocab, 2))(pad(ids, 96), len(ids))
    assert "Stoc\u212aBROKER".lower() == "stockbroker"
    assert np.asarray(parsed.actions).tolist() == [7, 9] and bool(parsed.format_ok)


def test_parse_answer_span_and_think_length(response_bytes):
    response = "abc</think> <answer>Left||Up</answer></answer>"
    ids = TOK.encode(response)
    buf, n = jax.jit(lambda t, l: response_bytes(t, l))(pad(ids, 64), len(ids))
    span = jax.jit(parse_answer)(buf, n)
    match = re.search(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", "<think>" + response, re.DOTALL)
    answer = bytes(np.asarray(buf[int(span.start): int(span.start) + int(span.length)])).decode()
    assert answer == match.group(2) and int(span.think_len) == len(match.group(1))


@pytest.mark.parametrize("value", [0, 7, 10, 99, 100, 12345, -1, -40, -999])
def test_int_render(value):
    frags = TokenFragments(TOK)
    tokens, n = jax.jit(lambda v: assemble([frags.int_items(v, 5)], TOK.pad_id))(jnp.int32(value))
    assert TOK.decode(np.asarray(tokens[: int(n)]).tolist()) == str(value)


@pytest.mark.parametrize("decimals", [0, 1, 2])
def test_fixed_render_matches_host_format(decimals):
    frags = TokenFragments(TOK)
    values = np.float32([0.0, 0.1, 1.0, -0.1, -0.2, 10.9, -1.5, 0.25, 2.5, 123.456, -0.04, 0.96])
    run = jax.jit(jax.vmap(lambda v: assemble([frags.fixed_items(v, decimals, 4)], TOK.pad_id)))
    tokens, lengths = run(jnp.asarray(values))
    for v, t, n in zip(values, np.asarray(tokens), np.asarray(lengths)):
        assert TOK.decode(t[:n].tolist()) == format_fixed(float(v), decimals)
    # The host mirror agrees with Python's own fixed formatting away from rounding ties.
    assert format_fixed(10.9, 1) == "10.9" and format_fixed(-0.2, 2) == "-0.20" and format_fixed(1.0, 0) == "1"


def test_assemble_mixed_items_and_padding():
    frags = TokenFragments(TOK)
    table = frags.table(["ab", "\u221a", "", "xyz"])
    assert isinstance(table, AtomTable)

    def build(idx, on):
        items = [Static(frags.encode("[")), Dynamic(table, idx, on), frags.optional("!", on[0]), frags.static("]")]
        return assemble(items, TOK.pad_id)

    run = jax.jit(build)
    for idx, on in [([0, 1, 3], [True, True, True]), ([3, 2, 0], [False, True, True]), ([1, 1, 1], [False] * 3)]:
        tokens, n = run(jnp.asarray(idx, jnp.int32), jnp.asarray(on))
        expected = "[" + "".join(table.texts[i] for i, o in zip(idx, on) if o) + ("!" if on[0] else "") + "]"
        assert TOK.decode(np.asarray(tokens[: int(n)]).tolist()) == expected
        assert (np.asarray(tokens[int(n):]) == TOK.pad_id).all()


def test_assemble_rejects_short_buffer():
    frags = TokenFragments(TOK)
    with pytest.raises(ValueError, match="shorter than the longest render"):
        assemble([frags.static("hello")], TOK.pad_id, size=3)


def test_action_vocab_rejects_bad_names():
    with pytest.raises(ValueError, match="distinct"):
        ActionVocab(("Up", "UP"), (1, 2))
    with pytest.raises(ValueError, match="ASCII"):
        ActionVocab(("Up", "\u00dcber"), (1, 2))


# ------------------------------------------------------------------------------------------------------
# Host mode's parse (TextEnv.parse_pieces): the env maps RAGEN's answer pieces itself
# ------------------------------------------------------------------------------------------------------
def test_parse_pieces_maps_names_case_blind_and_drops_unknown_ones():
    from envs.frozen_lake import FrozenLake

    env = FrozenLake()
    parsed, n_valid = env.parse_pieces(("up", "LEFT", "Jump"), True, True, None, env.default_params, 3)
    assert n_valid == 2 and np.asarray(parsed.actions).tolist() == [4, 1, 0]
    assert int(parsed.n_parsed) == 3 and not bool(parsed.format_ok)  # one piece is not an action
    parsed, n_valid = env.parse_pieces((), True, False, None, env.default_params, 2)  # cut by the window
    assert (n_valid, int(parsed.n_parsed), bool(parsed.format_ok)) == (0, 1, False)


def test_parse_pieces_uses_the_state_names_of_bandit_and_the_free_text_of_countdown():
    from envs.bandit import ARM_NAMES, Bandit
    from envs.base import TextEnv
    from envs.countdown import Countdown

    env = Bandit()
    state = env.reset_env(jax.random.PRNGKey(0), env.default_params)[1]
    first, second = (ARM_NAMES[int(i)] for i in np.asarray(state.arms))
    parsed, n_valid = env.parse_pieces((second.upper(),), True, True, state, env.default_params, 1)
    assert n_valid == 1 and int(parsed.actions[0]) == 2 and bool(parsed.format_ok)
    assert env.parse_pieces(("arm 1",), True, True, state, env.default_params, 1)[1] == 0

    countdown = Countdown()
    parsed, n_valid = countdown.parse_pieces(("1 + 2",), True, True, None, countdown.default_params, 1)
    assert n_valid == 1 and int(parsed.action.length) == 5
    assert bytes(np.asarray(parsed.action.text)[:5]) == b"1 + 2"

    class FreeText(Countdown):  # a free-text env that did not write its host parse
        parse_pieces = TextEnv.parse_pieces

    with pytest.raises(TypeError, match="FreeText has no action_lookup"):
        FreeText().parse_pieces(("x",), True, True, None, countdown.default_params, 1)
