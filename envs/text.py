"""Device-side text building blocks: read model responses and write observations inside ``jit``.

Everything here is pure JAX over fixed-shape arrays (jit- and vmap-able, no Python control flow on
traced values). Host-side setup (token tables) happens once per (env, tokenizer).

Reading a response (RAGEN semantics, ``ragen/llm_agent/ctx_manager.py::_parse_response``)
------------------------------------------------------------------------------------------
1. ``ResponseBytes(tokens int32[R], length) -> (bytes uint8[R*W], n_bytes)``: gathers every token's
   bytes from the tokenizer's token -> bytes table and compacts them (cumsum of lengths + scatter).
   Tokens at positions >= length and ids outside [0, V) contribute no bytes. Special tokens
   contribute their literal text (``<think>`` is the 7 bytes "<think>"), as
   ``decode(skip_special_tokens=False)`` would. Parsing therefore works on BYTES and does not depend on
   token boundaries (a BPE that splits "<answer>" into 3 tokens parses the same).
2. ``parse_answer(bytes, n) -> AnswerSpan``. RAGEN appends the literal "<think>" to the rollout prompt,
   generates after it, prepends "<think>" to the decoded response and takes the FIRST match of
   ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (re.DOTALL). ``parse_answer`` takes the response
   WITHOUT that leading "<think>" (exactly the generated tokens) and prepends it logically. Because the
   logical text starts with "<think>", the first match always starts at 0, and it is the one with the
   leftmost "</think>" that is followed by optional whitespace, "<answer>", and somewhere later an
   "</answer>"; the answer is the text up to the first "</answer>" after "<answer>".
   ``\\s`` is Python's ``str`` whitespace, exactly: ASCII \\t \\n \\v \\f \\r, 0x1C-0x1F, space, and
   the non-ASCII whitespace characters (U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F,
   U+205F, U+3000) recognised by their UTF-8 byte sequences. (Invalid UTF-8 decodes to U+FFFD in the
   reference, which is not whitespace; a valid sequence is recognised at its lead byte, so invalid
   neighbours never change the result.)
3. ``clean_answer``: RAGEN removes the strings "<think>", "</think>", "<answer>", "</answer>",
   "<|im_start|>", "<|im_end|>" from the answer, one after another with ``str.replace`` (a removal can
   create a new occurrence of a later string; this is reproduced with one compaction pass per string).
4. ``answer_pieces``: ``[a.strip() for a in answer.split("||") if a.strip()][:K]``: split on "||"
   (left-to-right, non-overlapping), strip whitespace, drop empty pieces, keep the first K.
   Language envs (Countdown) read these raw pieces.
5. ``ActionVocab.match``: map each kept piece with ``str.lower()`` to an action id (action names are
   ASCII; ASCII letters are lower-cased, and U+212A KELVIN SIGN, the only non-ASCII character that
   Python lower-cases to an ASCII letter, is folded to "k"). Unknown pieces are dropped; the valid
   ids are compacted to the front in order.

   Whitespace and Kelvin signs are classified on the ORIGINAL response bytes and the class travels with
   each byte through the compactions, so a multi-byte character split by a removed tag (which the
   reference decodes as U+FFFD characters) is never mistaken for whitespace or "k".

Writing an observation
----------------------
``TokenFragments`` tokenizes static strings once on the host; ``AtomTable`` is a small table of
pre-tokenized strings (digits, symbols, punctuation) indexed on device. A render is a list of items,
``Static(ids)`` or ``Dynamic(table, idx int32[m], enabled bool[m])``, that ``assemble`` writes into a fixed
buffer ``int32[max_len]`` (max_len = the sum of every item's longest form) plus its length; positions
past the length hold the pad id. The result decodes to exactly the host text built from the same
pieces, but it need not equal ``tokenizer.encode(text)`` for BPE tokenizers (fragments are tokenized
separately, so merges across fragment boundaries do not happen). Numbers: ``int_items`` (decimal,
leading minus) and ``fixed_items`` (fixed decimals; value rounded half-to-even in float32, "-" only if
the rounded value is negative); ``format_fixed`` is the host mirror.

Over 400 lines: the device-side text toolbox (response parsing, answer windows, observation
writing, number rendering) shared by every env; each function is small and independent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ragen_jax.models.tokenizers import Tokenizer, token_byte_table

SPECIAL_STRINGS_REMOVED: tuple[bytes, ...] = (
    b"<think>", b"</think>", b"<answer>", b"</answer>", b"<|im_start|>", b"<|im_end|>"
)
ACTION_SEPARATOR = "||"

# Byte classes carried alongside answer bytes.
CLS_PLAIN, CLS_WHITESPACE, CLS_KELVIN_LEAD, CLS_KELVIN_CONT = 0, 1, 2, 3



# --------------------------------------------------------------------------------------------------
# Response tokens -> bytes
# --------------------------------------------------------------------------------------------------
@struct.dataclass
class ResponseBytes:
    """The tokenizer's token -> bytes table on device; call it to detokenize a response.

    table: uint8[V, W] (row i = bytes of token i, zero-padded); lengths: int32[V] (0 for pad).
    """

    table: jax.Array
    lengths: jax.Array

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> "ResponseBytes":
        table, lengths = token_byte_table(tokenizer)
        return cls(table=jnp.asarray(table), lengths=jnp.asarray(lengths))

    @property
    def width(self) -> int:
        return int(self.table.shape[1])

    def __call__(
        self, tokens: jax.Array, length: jax.Array, max_bytes: int | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """tokens: int32[R], length: int32[] -> (bytes uint8[N], n_bytes int32[]), N = R*W or max_bytes.

        offsets = cumsum(token byte lengths) - own length; byte j of token r goes to offsets[r] + j.
        ``max_bytes`` (static) caps the buffer: a longer response is cut after max_bytes bytes, as if
        generation had stopped there. Every later pass is O(N), so the cap is what keeps parsing cheap
        for tokenizers with long tokens (W is 13 for CharTokenizer because of "<|endoftext|>").
        """
        num_tokens = tokens.shape[0]
        size = num_tokens * self.table.shape[1] if max_bytes is None else min(max_bytes, num_tokens * self.table.shape[1])
        vocab, width = self.table.shape
        in_vocab = (tokens >= 0) & (tokens < vocab)
        safe = jnp.where(in_vocab, tokens, 0)
        live = in_vocab & (jnp.arange(num_tokens) < length)
        tok_len = jnp.where(live, self.lengths[safe], 0)
        offsets = jnp.cumsum(tok_len) - tok_len
        cols = jnp.arange(width)
        dest = offsets[:, None] + cols[None, :]
        dest = jnp.where(cols[None, :] < tok_len[:, None], dest, size)
        out = jnp.zeros((size,), jnp.uint8)
        out = out.at[dest.reshape(-1)].set(self.table[safe].reshape(-1), mode="drop")
        return out, jnp.minimum(jnp.sum(tok_len), size).astype(jnp.int32)


# --------------------------------------------------------------------------------------------------
# Byte-level matching helpers
# --------------------------------------------------------------------------------------------------
def match_at(buf: jax.Array, n: jax.Array, pattern: bytes) -> jax.Array:
    """bool[N]: pattern occurs at position i, entirely inside the first n bytes."""
    size = buf.shape[0]
    padded = jnp.concatenate([buf.astype(jnp.int32), jnp.zeros((len(pattern),), jnp.int32)])
    hit = jnp.ones((size,), bool)
    for k, byte in enumerate(pattern):
        hit = hit & (padded[k : k + size] == byte)
    return hit & (jnp.arange(size) + len(pattern) <= n)


def _shift_right(mask: jax.Array, k: int) -> jax.Array:
    """out[i] = mask[i - k] (False for i < k)."""
    return jnp.concatenate([jnp.zeros((k,), mask.dtype), mask[:-k]]) if k else mask


def byte_classes(buf: jax.Array, n: jax.Array) -> jax.Array:
    """int32[N]: CLS_WHITESPACE for every byte of a Python-whitespace character, CLS_KELVIN_* for
    the bytes of U+212A, CLS_PLAIN otherwise (and past n).

    UTF-8 forms: 0x09-0x0D, 0x1C-0x20; C2 85, C2 A0; E1 9A 80; E2 80 80-8A, E2 80 A8/A9/AF; E2 81 9F;
    E3 80 80. Kelvin sign: E2 84 AA.
    """
    size = buf.shape[0]
    idx = jnp.arange(size)
    b = jnp.where(idx < n, buf.astype(jnp.int32), 0)
    b1 = jnp.concatenate([b[1:], jnp.zeros((1,), jnp.int32)])
    b2 = jnp.concatenate([b[2:], jnp.zeros((2,), jnp.int32)])
    ws1 = ((b >= 0x09) & (b <= 0x0D)) | ((b >= 0x1C) & (b <= 0x20))
    ws2 = (b == 0xC2) & ((b1 == 0x85) | (b1 == 0xA0))
    e2_80 = (b == 0xE2) & (b1 == 0x80) & (((b2 >= 0x80) & (b2 <= 0x8A)) | (b2 == 0xA8) | (b2 == 0xA9) | (b2 == 0xAF))
    ws3 = (
        ((b == 0xE1) & (b1 == 0x9A) & (b2 == 0x80))
        | e2_80
        | ((b == 0xE2) & (b1 == 0x81) & (b2 == 0x9F))
        | ((b == 0xE3) & (b1 == 0x80) & (b2 == 0x80))
    )
    member = ws1 | ws2 | ws3 | _shift_right(ws2, 1) | _shift_right(ws3, 1) | _shift_right(ws3, 2)
    kelvin = (b == 0xE2) & (b1 == 0x84) & (b2 == 0xAA)
    kelvin_cont = _shift_right(kelvin, 1) | _shift_right(kelvin, 2)
    cls = jnp.where(member, CLS_WHITESPACE, CLS_PLAIN)
    cls = jnp.where(kelvin, CLS_KELVIN_LEAD, cls)
    return jnp.where(kelvin_cont, CLS_KELVIN_CONT, cls).astype(jnp.int32)


def _first_at_or_after(mask: jax.Array) -> jax.Array:
    """int32[N+1]: smallest j >= i with mask[j], or N; entry N is N."""
    size = mask.shape[0]
    pos = jnp.where(mask, jnp.arange(size), size).astype(jnp.int32)
    pos = jnp.concatenate([pos, jnp.array([size], jnp.int32)])
    return jax.lax.cummin(pos, reverse=True)


def compact(keep: jax.Array, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Move the kept entries of each array to the front (order preserved), zeros after.

    keep: bool[N]; arrays: [N]. Returns (*compacted arrays, n_kept int32[]).
    """
    size = keep.shape[0]
    dest = jnp.where(keep, jnp.cumsum(keep) - 1, size)
    out = tuple(jnp.zeros_like(a).at[dest].set(a, mode="drop") for a in arrays)
    return (*out, jnp.sum(keep).astype(jnp.int32))


# --------------------------------------------------------------------------------------------------
# The regex: <think>(.*?)</think>\s*<answer>(.*?)</answer>
# --------------------------------------------------------------------------------------------------
class AnswerSpan(NamedTuple):
    """Where the first regex match puts the answer, in response-byte coordinates.

    start, length: the answer group (group 2); matched: the regex matched;
    think_len: the think group (group 1) is bytes [0, think_len) of the response.
    All int32[] / bool[]; start = length = think_len = 0 when not matched.
    """

    start: jax.Array
    length: jax.Array
    matched: jax.Array
    think_len: jax.Array


def parse_answer(buf: jax.Array, n: jax.Array, classes: jax.Array | None = None) -> AnswerSpan:
    """First match of RAGEN's pattern on "<think>" + response. buf: uint8[N], n: int32[]."""
    size = buf.shape[0]
    idx = jnp.arange(size)
    if classes is None:
        classes = byte_classes(buf, n)
    close_think = match_at(buf, n, b"</think>")
    open_answer = jnp.concatenate([match_at(buf, n, b"<answer>"), jnp.zeros((1,), bool)])
    close_answer_from = _first_at_or_after(match_at(buf, n, b"</answer>"))
    non_ws_from = _first_at_or_after((classes != CLS_WHITESPACE) | (idx >= n))
    # For a "</think>" at p: \s* is greedy and "<answer>" starts with a non-space, so the answer tag must
    # sit at the first non-whitespace position q after p + 8; then the lazy group 2 ends at the first
    # "</answer>" at or after q + 8.
    q = non_ws_from[jnp.minimum(idx + 8, size)]
    answer_start = jnp.minimum(q + 8, size)
    answer_end = close_answer_from[answer_start]
    valid = close_think & open_answer[q] & (answer_end < size)
    p = jnp.min(jnp.where(valid, idx, size))
    matched = p < size
    p_safe = jnp.minimum(p, size - 1)
    start = jnp.where(matched, answer_start[p_safe], 0).astype(jnp.int32)
    length = jnp.where(matched, answer_end[p_safe] - answer_start[p_safe], 0).astype(jnp.int32)
    think_len = jnp.where(matched, p, 0).astype(jnp.int32)
    return AnswerSpan(start=start, length=length, matched=matched, think_len=think_len)


def clean_answer(
    buf: jax.Array,
    n: jax.Array,
    span: AnswerSpan,
    classes: jax.Array | None = None,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The answer with RAGEN's special strings removed (sequential str.replace passes).

    Returns (bytes uint8[A], classes int32[A], n_bytes int32[]); empty when not matched.
    A = ``window`` (static) or N: an answer longer than the window is read from its first A bytes
    (None = exact for any answer).
    """
    size = buf.shape[0] if window is None else window
    idx = jnp.arange(size)
    if classes is None:
        classes = byte_classes(buf, n)
    src = jnp.minimum(span.start + idx, buf.shape[0] - 1)
    inside = idx < span.length
    ans = jnp.where(inside, buf[src], 0).astype(jnp.uint8)
    cls = jnp.where(inside, classes[src], CLS_PLAIN)
    ans_n = jnp.minimum(span.length, size)
    for pattern in SPECIAL_STRINGS_REMOVED:
        # Occurrences of these tags never overlap (each starts with its only "<" and ends with ">").
        start_hit = match_at(ans, ans_n, pattern)
        covered = start_hit
        for k in range(1, len(pattern)):
            covered = covered | _shift_right(start_hit, k)
        ans, cls, ans_n = compact(~covered & (idx < ans_n), ans, cls)
    return ans, cls, ans_n


class Pieces(NamedTuple):
    """The first K non-empty stripped "||"-pieces of an answer.

    bytes: uint8[K, P] (piece k truncated to P bytes, zero-padded); classes: int32[K, P];
    lengths: int32[K] (the full stripped length, may exceed P; 0 for k >= n_parsed);
    n_parsed: int32[] = min(#non-empty pieces, K);
    complete: bool[]: False when the answer was cut by the answer window before K pieces ended in a
    separator inside it (then the pieces are not known exactly; parsers treat the turn as invalid).
    """

    bytes: jax.Array
    classes: jax.Array
    lengths: jax.Array
    n_parsed: jax.Array
    complete: jax.Array


def answer_pieces(
    ans: jax.Array,
    cls: jax.Array,
    n: jax.Array,
    max_pieces: int,
    piece_width: int,
    cut: jax.Array | bool = False,
) -> Pieces:
    """``[a.strip() for a in answer.split("||") if a.strip()][:max_pieces]`` on bytes.

    cut: bool[], the answer continues past the buffer (see ``clean_answer``'s window); only pieces
    closed by a separator inside the buffer are then certain.
    """
    size = ans.shape[0]
    idx = jnp.arange(size)
    inside = idx < n
    pipe = (ans == ord("|")) & inside
    # str.split scans left to right: in a run of pipes, separators start at even offsets of the run.
    last_non_pipe = jax.lax.cummax(jnp.where(pipe, -1, idx))
    offset_in_run = idx - last_non_pipe - 1
    next_pipe = jnp.concatenate([pipe[1:], jnp.zeros((1,), bool)])
    sep_start = pipe & next_pipe & (offset_in_run % 2 == 0)
    sep_member = sep_start | _shift_right(sep_start, 1)
    piece_id = jnp.cumsum(sep_start)
    content = inside & ~sep_member & (cls != CLS_WHITESPACE)
    num_ids = size // 2 + 2
    first = jnp.full((num_ids,), size, jnp.int32).at[piece_id].min(jnp.where(content, idx, size))
    last = jnp.full((num_ids,), -1, jnp.int32).at[piece_id].max(jnp.where(content, idx, -1))
    nonempty = first < size
    rank = jnp.cumsum(nonempty) - 1
    n_parsed = jnp.minimum(jnp.sum(nonempty), max_pieces).astype(jnp.int32)
    closed = jnp.arange(num_ids) < jnp.sum(sep_start)  # the last piece has no separator after it
    complete = ~jnp.asarray(cut) | (jnp.sum(nonempty & closed) >= max_pieces)
    chosen = jnp.zeros((max_pieces,), jnp.int32).at[
        jnp.where(nonempty & (rank < max_pieces), rank, max_pieces)
    ].set(jnp.arange(num_ids, dtype=jnp.int32), mode="drop")
    kept = jnp.arange(max_pieces) < n_parsed
    starts = jnp.where(kept, first[chosen], 0)
    lengths = jnp.where(kept, last[chosen] + 1 - starts, 0).astype(jnp.int32)
    cols = jnp.arange(piece_width)
    src = jnp.minimum(starts[:, None] + cols[None, :], size - 1)
    valid = cols[None, :] < lengths[:, None]
    piece_bytes = jnp.where(valid, ans[src], 0).astype(jnp.uint8)
    piece_cls = jnp.where(valid, cls[src], CLS_PLAIN)
    return Pieces(bytes=piece_bytes, classes=piece_cls, lengths=lengths, n_parsed=n_parsed, complete=complete)


# --------------------------------------------------------------------------------------------------
# Action vocabulary
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActionVocab:
    """Case-insensitive lookup of action names -> ids (built on the host from ASCII names)."""

    names: tuple[str, ...]
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.ids) or not self.names:
            raise ValueError("ActionVocab needs one id per name and at least one name")
        lowered = [name.lower() for name in self.names]
        if any(not name.isascii() or not name.strip() for name in self.names):
            raise ValueError(f"action names must be non-empty ASCII strings, got {self.names}")
        if len(set(lowered)) != len(lowered):
            raise ValueError(f"action names must be distinct ignoring case, got {self.names}")

    @property
    def max_name_len(self) -> int:
        return max(len(name) for name in self.names)

    @property
    def piece_width(self) -> int:
        """Bytes of a piece to look at: a name letter "k" may be written as the 3-byte Kelvin sign."""
        return 3 * self.max_name_len

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        width = self.max_name_len
        table = np.zeros((len(self.names), width), np.int32)
        lengths = np.zeros((len(self.names),), np.int32)
        for i, name in enumerate(self.names):
            encoded = name.lower().encode("ascii")
            table[i, : len(encoded)] = np.frombuffer(encoded, np.uint8)
            lengths[i] = len(encoded)
        return table, lengths, np.asarray(self.ids, np.int32)

    def lookup(self, pieces: Pieces) -> tuple[jax.Array, jax.Array]:
        """Per piece: (name index int32[K] (0 if none), found bool[K])."""
        table, lengths, _ = self.tables()
        width = self.max_name_len
        cols = jnp.arange(pieces.bytes.shape[1])

        def fold(row: jax.Array, row_cls: jax.Array, row_len: jax.Array):
            keep = (cols < row_len) & (row_cls != CLS_KELVIN_CONT)
            folded = jnp.where(row_cls == CLS_KELVIN_LEAD, ord("k"), row.astype(jnp.int32))
            folded, folded_len = compact(keep, folded)
            upper = (folded >= ord("A")) & (folded <= ord("Z"))
            return jnp.where(upper, folded + 32, folded), folded_len

        folded, folded_len = jax.vmap(fold)(pieces.bytes, pieces.classes, pieces.lengths)
        head = folded[:, :width]
        name_cols = jnp.arange(width)
        same = (head[:, None, :] == table[None, :, :]) | (name_cols[None, None, :] >= lengths[None, :, None])
        hit = jnp.all(same, axis=-1) & (folded_len[:, None] == lengths[None, :])
        hit = hit & (pieces.lengths <= pieces.bytes.shape[1])[:, None]
        hit = hit & (jnp.arange(pieces.lengths.shape[0]) < pieces.n_parsed)[:, None]
        return jnp.argmax(hit, axis=-1).astype(jnp.int32), jnp.any(hit, axis=-1)

    def match(self, pieces: Pieces) -> tuple[jax.Array, jax.Array]:
        """(action ids int32[K] of the recognised pieces compacted to the front (0 after), n_valid)."""
        index, found = self.lookup(pieces)
        _, _, ids = self.tables()
        actions, n_valid = compact(found, jnp.asarray(ids)[index])
        return actions, n_valid


@struct.dataclass
class Parsed:
    """One parsed turn. actions: int32[K] (valid ids first, 0 padding); n_valid, n_parsed: int32[];
    matched: the format regex matched; format_ok = matched & n_valid > 0 & n_valid == n_parsed
    (RAGEN adds the format penalty to a turn when this is False)."""

    actions: jax.Array
    n_valid: jax.Array
    n_parsed: jax.Array
    matched: jax.Array
    format_ok: jax.Array


def parse_actions(
    buf: jax.Array, n: jax.Array, vocab: ActionVocab, max_actions: int, answer_window: int | None = None
) -> Parsed:
    """The whole RAGEN pipeline for envs with an action lookup: bytes -> Parsed."""
    classes = byte_classes(buf, n)
    span = parse_answer(buf, n, classes)
    ans, cls, ans_n = clean_answer(buf, n, span, classes, answer_window)
    pieces = answer_pieces(ans, cls, ans_n, max_actions, vocab.piece_width, answer_cut(span, answer_window))
    actions, n_valid = vocab.match(pieces)
    return make_parsed(actions, n_valid, pieces.n_parsed, span.matched, pieces.complete)


def answer_cut(span: AnswerSpan, window: int | None) -> jax.Array:
    """bool[]: the answer is longer than the window that ``clean_answer`` reads."""
    return jnp.asarray(False) if window is None else span.length > window


def make_parsed(
    actions: jax.Array, n_valid: jax.Array, n_parsed: jax.Array, matched: jax.Array, complete: jax.Array | bool = True
) -> Parsed:
    """Parsed with RAGEN's format rule; an incomplete read (answer window) counts as an invalid turn:
    no actions, n_parsed >= 1."""
    complete = jnp.asarray(complete)
    actions = jnp.where(complete, actions, 0)
    n_valid = jnp.where(complete, n_valid, 0).astype(jnp.int32)
    n_parsed = jnp.where(complete, n_parsed, jnp.maximum(n_parsed, 1)).astype(jnp.int32)
    format_ok = matched & (n_valid > 0) & (n_valid == n_parsed)
    return Parsed(actions=actions, n_valid=n_valid, n_parsed=n_parsed, matched=matched, format_ok=format_ok)


# --------------------------------------------------------------------------------------------------
# Rendering: fragments and assembly
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AtomTable:
    """Pre-tokenized strings indexed on device. ids: int32[S, L] (pad-filled), lengths: int32[S]."""

    texts: tuple[str, ...]
    ids: np.ndarray
    lengths: np.ndarray

    def index(self, text: str) -> int:
        return self.texts.index(text)


@dataclass(frozen=True)
class Static:
    ids: np.ndarray  # int32[L]


@dataclass(frozen=True)
class Dynamic:
    table: AtomTable
    idx: jax.Array  # int32[m]
    enabled: jax.Array  # bool[m]


class TokenFragments:
    """Host-side tokenization of render fragments for one tokenizer (cached per string)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, np.ndarray] = {}
        self._tables: dict[tuple[str, ...], AtomTable] = {}
        self.digits = self.table([str(d) for d in range(10)] + ["-", "."])

    def encode(self, text: str) -> np.ndarray:
        if text not in self._cache:
            ids = np.asarray(self.tokenizer.encode(text), np.int32)
            if self.tokenizer.decode(ids.tolist()) != text:
                raise ValueError(f"tokenizer does not round-trip the render fragment {text!r}")
            self._cache[text] = ids
        return self._cache[text]

    def static(self, text: str) -> Static:
        return Static(self.encode(text))

    def table(self, texts: Sequence[str]) -> AtomTable:
        key = tuple(texts)
        if key not in self._tables:
            encoded = [self.encode(t) for t in key]
            width = max(1, max(len(e) for e in encoded))
            ids = np.full((len(key), width), self.tokenizer.pad_id, np.int32)
            lengths = np.zeros((len(key),), np.int32)
            for i, e in enumerate(encoded):
                ids[i, : len(e)] = e
                lengths[i] = len(e)
            self._tables[key] = AtomTable(key, ids, lengths)
        return self._tables[key]

    def optional(self, text: str, enabled: jax.Array) -> Dynamic:
        """``text`` when ``enabled`` (bool[]), nothing otherwise."""
        return Dynamic(self.table([text]), jnp.zeros((1,), jnp.int32), jnp.reshape(enabled, (1,)))

    def choice(self, texts: Sequence[str], index: jax.Array) -> Dynamic:
        """One of ``texts`` chosen by ``index`` (int32[])."""
        return Dynamic(self.table(texts), jnp.reshape(index, (1,)).astype(jnp.int32), jnp.ones((1,), bool))

    def int_items(self, value: jax.Array, max_digits: int) -> Dynamic:
        """Decimal text of an integer with |value| < 10**max_digits: "-" if negative, no leading zeros."""
        value = jnp.asarray(value, jnp.int32)
        magnitude = jnp.abs(value)
        powers = jnp.asarray([10**k for k in range(max_digits - 1, -1, -1)], jnp.int32)
        digits = (magnitude // powers) % 10
        significant = (magnitude >= powers) | (jnp.arange(max_digits) == max_digits - 1)
        idx = jnp.concatenate([jnp.array([10], jnp.int32), digits.astype(jnp.int32)])
        enabled = jnp.concatenate([jnp.reshape(value < 0, (1,)), significant])
        return Dynamic(self.digits, idx, enabled)

    def fixed_items(self, value: jax.Array, decimals: int, max_int_digits: int) -> Dynamic:
        """Fixed-decimal text: q = round_half_even(float32(value) * 10**decimals); see ``format_fixed``."""
        scaled = jnp.round(jnp.asarray(value, jnp.float32) * jnp.float32(10**decimals)).astype(jnp.int32)
        magnitude = jnp.abs(scaled)
        scale = 10**decimals
        whole = self.int_items(magnitude // scale, max_int_digits)
        idx, enabled = whole.idx.at[0].set(10), whole.enabled.at[0].set(scaled < 0)
        if decimals == 0:
            return Dynamic(self.digits, idx, enabled)
        frac_powers = jnp.asarray([10**k for k in range(decimals - 1, -1, -1)], jnp.int32)
        frac_digits = ((magnitude % scale) // frac_powers) % 10
        idx = jnp.concatenate([idx, jnp.array([11], jnp.int32), frac_digits.astype(jnp.int32)])
        enabled = jnp.concatenate([enabled, jnp.ones((decimals + 1,), bool)])
        return Dynamic(self.digits, idx, enabled)


def format_fixed(value: float, decimals: int) -> str:
    """Host mirror of ``TokenFragments.fixed_items`` (float32 scaling, round half to even)."""
    scaled = int(np.round(np.float32(value) * np.float32(10**decimals)))
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**decimals)
    return f"{sign}{whole}" + (f".{frac:0{decimals}d}" if decimals else "")


def max_length(items: Sequence[Static | Dynamic]) -> int:
    total = 0
    for item in items:
        if isinstance(item, Static):
            total += len(item.ids)
        else:
            total += int(item.idx.shape[0]) * int(item.table.lengths.max())
    return total


def assemble(items: Sequence[Static | Dynamic], pad_id: int, size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Concatenate render items into (tokens int32[size], length int32[]); pad after length.

    size defaults to ``max_length(items)`` (the longest possible render), which also guarantees that
    every write fits (a static write at offset o <= sum of earlier maxima never runs off the end).
    """
    bound = max_length(items)
    size = bound if size is None else size
    if size < bound:
        raise ValueError(f"render buffer of {size} tokens is shorter than the longest render ({bound})")
    buf = jnp.full((size,), pad_id, jnp.int32)
    offset = jnp.zeros((), jnp.int32)
    for item in items:
        if isinstance(item, Static):
            if len(item.ids):
                buf = jax.lax.dynamic_update_slice(buf, jnp.asarray(item.ids), (offset,))
                offset = offset + len(item.ids)
            continue
        table_ids = jnp.asarray(item.table.ids)[item.idx]  # [m, W]
        lens = jnp.where(item.enabled, jnp.asarray(item.table.lengths)[item.idx], 0)
        starts = offset + jnp.cumsum(lens) - lens
        cols = jnp.arange(table_ids.shape[1])
        dest = jnp.where(cols[None, :] < lens[:, None], starts[:, None] + cols[None, :], size)
        buf = buf.at[dest.reshape(-1)].set(table_ids.reshape(-1), mode="drop")
        offset = offset + jnp.sum(lens)
    buf = jnp.where(jnp.arange(size) < offset, buf, pad_id)
    return buf, offset.astype(jnp.int32)
