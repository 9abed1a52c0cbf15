"""Property tests: on-device parse == a plain-Python RAGEN regex reference, for any bytes and any
tokenization (CharTokenizer and a fake multi-byte tokenizer with tokens that straddle tag boundaries)."""

import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.text import ActionVocab, ResponseBytes, answer_pieces, byte_classes, clean_answer, parse_actions, parse_answer
from ragen_jax.models.tokenizers import SPECIAL_TOKENS, CharTokenizer

R = 96  # tokens per response
B = 16  # responses per device call (one compile per tokenizer)
K = 2
NAMES = ("Left", "Down", "Right", "Up", "StockBroker")
VOCAB = ActionVocab(NAMES, (1, 2, 3, 4, 5))
REMOVED = ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]
PARTS = REMOVED + [
    "||", "|", " ", "\n", "\t", "\x0b", "\x1c", "\x1f", "\u0085", "\u00a0", "\u1680", "\u2005", "\u2028",
    "\u202f", "\u3000", "\u212a", "\u0130", "Up", "up", "UP", "DOWN", "Left", "rIGHT", "k", "stoc", "broker",
    "x", "</th", "ink>", "<ans", "wer>", "</answer", "<|im", "_end|>", "\u00e9", "\ufffd", "<", ">", "/",
]


def ragen_reference(response: bytes) -> tuple[bool, list[int], int, list[str]]:
    """RAGEN ``_parse_response`` + action lookup on the decoded text, written plainly."""
    text = "<think>" + response.decode("utf-8", errors="replace")
    match = re.search(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", text, re.DOTALL)
    if not match:
        return False, [], 0, []
    answer = match.group(2)
    for special in REMOVED:
        answer = answer.replace(special, "").strip()
    pieces = [a.strip() for a in answer.split("||") if a.strip()][:K]
    lookup = {name.lower(): i + 1 for i, name in enumerate(NAMES)}
    valid = [lookup[p.lower()] for p in pieces if p.lower() in lookup]
    return True, valid, len(pieces), pieces


class FakeMultiByteTokenizer:
    """Byte-complete vocabulary (specials, 256 bytes) plus multi-byte tokens that cut tags and
    characters in odd places. ``encode_random`` picks a random segmentation of a byte string."""

    MULTI = [b"</", b"think", b"answer", b"<ans", b"wer>", b"||", b" |", b"| ", b"Up", b"Do", b"wn",
             b"Left", b"Rig", b"ht", b"\n\n", b"  ", b"<th", b"ink>", b"k></th", b">\n<", b"r>||", b"||U",
             b"\xe2\x80", b"\xa8 ", b"\xe2\x84\xaa", b"r>", b"</answer><"]

    def __init__(self) -> None:
        self._table = [s.encode() for s in SPECIAL_TOKENS] + [bytes([b]) for b in range(256)] + self.MULTI
        self.vocab_size = len(self._table)
        self.pad_id = 0
        self.eos_ids = (1, 3)

    def token_bytes(self):
        return list(self._table)

    def special_id(self, text):
        return SPECIAL_TOKENS.index(text) if text in SPECIAL_TOKENS else None

    def encode_random(self, data: bytes, rng: random.Random) -> list[int]:
        ids, i = [], 0
        while i < len(data):
            options = [t for t, piece in enumerate(self._table) if t != self.pad_id and piece and data.startswith(piece, i)]
            choice = rng.choice(options)
            ids.append(choice)
            i += len(self._table[choice])
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_random(text.encode(), random.Random(0))

    def decode(self, ids) -> str:
        return b"".join(self._table[i] for i in ids if i != self.pad_id).decode("utf-8", errors="replace")


CHAR = CharTokenizer()
FAKE = FakeMultiByteTokenizer()


def make_runner(tokenizer):
    response_bytes = ResponseBytes.from_tokenizer(tokenizer)

    def one(tokens, length):
        buf, n = response_bytes(tokens, length)
        classes = byte_classes(buf, n)
        span = parse_answer(buf, n, classes)
        ans, cls, ans_n = clean_answer(buf, n, span, classes)
        pieces = answer_pieces(ans, cls, ans_n, K, 24)
        return parse_actions(buf, n, VOCAB, K), pieces

    return jax.jit(jax.vmap(one))


@pytest.fixture(scope="module")
def runners():
    return {"char": make_runner(CHAR), "fake": make_runner(FAKE)}


def char_tokens(parts: list[tuple[bytes, bool]]) -> list[int]:
    """CharTokenizer ids: a special string as its single id when flagged, else one id per byte."""
    ids = []
    for data, as_special in parts:
        special = CHAR.special_id(data.decode("latin-1")) if as_special else None
        ids.extend([special] if special is not None else [CHAR.num_special + b for b in data])
    return ids


def run_batch(runner, token_lists, lengths, fill_rng):
    tokens = np.zeros((B, R), np.int32)
    lens = np.zeros((B,), np.int32)
    for row, (ids, length) in enumerate(zip(token_lists, lengths)):
        tokens[row] = fill_rng.integers(-3, CHAR.vocab_size + 40, R)  # garbage past the length
        tokens[row, : len(ids)] = ids
        lens[row] = length
    parsed, pieces = runner(jnp.asarray(tokens), jnp.asarray(lens))
    return jax.tree.map(np.asarray, parsed), jax.tree.map(np.asarray, pieces)


def check_rows(parsed, pieces, responses, compare_pieces):
    for row, response in enumerate(responses):
        matched, valid, n_parsed, ref_pieces = ragen_reference(response)
        got_valid = parsed.actions[row][: parsed.n_valid[row]].tolist()
        assert (bool(parsed.matched[row]), got_valid, int(parsed.n_parsed[row])) == (matched, valid, n_parsed), response
        assert bool(parsed.format_ok[row]) == (matched and len(valid) > 0 and len(valid) == n_parsed)
        if compare_pieces:
            for k, ref in enumerate(ref_pieces):
                length = int(pieces.lengths[row, k])
                if length <= pieces.bytes.shape[-1]:
                    assert bytes(pieces.bytes[row, k, :length]).decode("utf-8", errors="replace") == ref


part = st.one_of(
    st.tuples(st.sampled_from(PARTS).map(str.encode), st.booleans()),
    st.tuples(st.binary(min_size=1, max_size=3), st.just(False)),  # garbage bytes
)
response_parts = st.lists(part, max_size=24)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(st.tuples(response_parts, st.integers(0, 10**6), st.booleans()), min_size=1, max_size=B))
def test_parse_matches_reference_char_tokenizer(runners, batch):
    token_lists, lengths, responses = [], [], []
    for parts, cut, truncate in batch:
        ids = char_tokens(parts)[:R]
        length = cut % (len(ids) + 1) if truncate else len(ids)
        token_lists.append(ids)
        lengths.append(length)
        responses.append(b"".join(CHAR.token_bytes()[i] for i in ids[:length]))
    parsed, pieces = run_batch(runners["char"], token_lists, lengths, np.random.default_rng(len(batch)))
    check_rows(parsed, pieces, responses, compare_pieces=False)


valid_text = st.lists(st.one_of(st.sampled_from(PARTS), st.text(max_size=3)), max_size=20).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(st.tuples(valid_text, st.integers(0, 2**31)), min_size=1, max_size=B))
def test_parse_and_pieces_independent_of_token_boundaries(runners, batch):
    """The same bytes split into random multi-byte tokens parse the same, pieces included."""
    token_lists, responses = [], []
    for text, seed in batch:
        data = text.encode()
        ids = FAKE.encode_random(data, random.Random(seed))
        while len(ids) > R:  # keep whole tokens only
            ids = ids[:R]
        data = b"".join(FAKE.token_bytes()[i] for i in ids)
        token_lists.append(ids)
        responses.append(data)
    lengths = [len(ids) for ids in token_lists]
    parsed, pieces = run_batch(runners["fake"], token_lists, lengths, np.random.default_rng(0))
    check_rows(parsed, pieces, responses, compare_pieces=True)


def generated_response(rng: random.Random) -> str:
    """Mostly well-formed answers with noise: the shapes a policy actually produces."""
    think = "".join(rng.choice(PARTS + ["a", "b", " "]) for _ in range(rng.randint(0, 6)))
    actions = [rng.choice(NAMES + ("up ", " DOWN", "foo", "", "\u212aeft")) for _ in range(rng.randint(0, 4))]
    sep = rng.choice(["||", " || ", "|", "|||"])
    gap = rng.choice(["", " ", "\n", "\u3000", "x"])
    tail = rng.choice(["", "</answer>", "junk", "<think>"])
    return f"{think}</think>{gap}<answer>{sep.join(actions)}</answer>{tail}"


def test_thousands_of_generated_responses(runners):
    rng = random.Random(1234)
    fill = np.random.default_rng(1)
    total = 0
    for _ in range(64):
        token_lists, lengths = [], []
        for _ in range(B):
            data = generated_response(rng).encode()
            ids = (FAKE.encode_random(data, rng) if rng.random() < 0.5 else char_tokens([(data, False)]))[:R]
            token_lists.append(ids)
            lengths.append(len(ids) if rng.random() < 0.8 else rng.randint(0, len(ids)))
        # Route each response to the runner of the tokenizer that produced its ids.
        char_rows = [i for i, ids in enumerate(token_lists) if all(t < CHAR.vocab_size for t in ids)]
        for name, tok in (("char", CHAR), ("fake", FAKE)):
            rows = char_rows if name == "char" else [i for i in range(B) if i not in char_rows]
            if not rows:
                continue
            batch_ids = [token_lists[i] for i in rows]
            batch_len = [lengths[i] for i in rows]
            table = tok.token_bytes()
            responses = [b"".join(table[t] for t in ids[:n]) for ids, n in zip(batch_ids, batch_len)]
            parsed, pieces = run_batch(runners[name], batch_ids, batch_len, fill)
            check_rows(parsed, pieces, responses, compare_pieces=True)
            total += len(rows)
    assert total == 64 * B


def test_answer_window_is_exact_or_an_invalid_turn():
    """With a 16-byte answer window: exact whenever the answer fits or K pieces close inside it;
    otherwise the turn is invalid (no actions, format not ok), never a different valid reading."""
    window = 16
    response_bytes = ResponseBytes.from_tokenizer(CHAR)
    run = jax.jit(jax.vmap(lambda t, n: parse_actions(*response_bytes(t, n), VOCAB, K, answer_window=window)))
    rng = random.Random(7)
    fill = np.random.default_rng(2)
    inexact = 0
    for _ in range(16):
        texts = [generated_response(rng) + rng.choice(["", " " * 20 + "Up</answer>"]) for _ in range(B)]
        texts = [t.replace("<answer>", "<answer>" + " " * rng.choice([0, 0, 12, 30]), 1) for t in texts]
        ids = [char_tokens([(t.encode(), False)])[:R] for t in texts]
        tokens = np.zeros((B, R), np.int32)
        for row, row_ids in enumerate(ids):
            tokens[row] = fill.integers(0, CHAR.vocab_size, R)
            tokens[row, : len(row_ids)] = row_ids
        parsed = jax.tree.map(np.asarray, run(jnp.asarray(tokens), jnp.asarray([len(i) for i in ids], jnp.int32)))
        for row, row_ids in enumerate(ids):
            data = b"".join(CHAR.token_bytes()[t] for t in row_ids)
            matched, valid, n_parsed, _ = ragen_reference(data)
            match = re.search(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", "<think>" + data.decode(), re.DOTALL)
            got = (bool(parsed.matched[row]), parsed.actions[row][: parsed.n_valid[row]].tolist(), int(parsed.n_parsed[row]))
            if got != (matched, valid, n_parsed):
                inexact += 1
                assert match is not None and len(match.group(2).encode()) > window
                assert parsed.n_valid[row] == 0 and not parsed.format_ok[row] and parsed.n_parsed[row] >= 1
    assert inexact > 0  # the generator does produce answers longer than the window
