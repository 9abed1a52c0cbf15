"""RAGEN's MetaMathQA answer check on device: ``normalize(answer) == normalize(label)`` over bytes.

RAGEN (``ragen/env/metamathqa/env.py::_check_answer``) compares ``re.sub(r"\\s+", "", s.lower())`` of the
answer and of the label. The label is normalised on the host (``envs.math_qa_data.normalize``); the
answer is normalised here, inside jit, from its UTF-8 bytes, exactly as Python would:

1. Decode: a position starts a character when its bytes form a valid UTF-8 sequence (no overlong forms,
   no surrogates, <= U+10FFFF). Any other byte makes the answer invalid: the reference decodes it as
   U+FFFD, which no label contains (``math_qa_data`` drops such labels), so an invalid answer is wrong.
2. Lower-case every character with Python's ``str.lower`` mapping (a sorted table of the characters it
   changes, 1,433 in CPython 3.11, looked up with a binary search; U+0130 becomes two characters), including
   the final-sigma rule: U+03A3 lowers to "ς" when a cased character precedes it and none follows it
   (skipping case-ignorable characters), else to "σ"; the Cased and Case_Ignorable properties are
   probed from ``str.lower`` itself, so they are the running Python's.
3. Drop every whitespace character (Python's ``str`` whitespace, ``\\s``).
4. Compare the remaining bytes with the label's.

Cost: O(N log M) for an answer of N bytes; the table is built once per process on the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

CAPITAL_SIGMA, FINAL_SIGMA = 0x03A3, 0x03C2


@functools.lru_cache(maxsize=1)
def whitespace() -> np.ndarray:
    """int32[S]: the codepoints ``\\s`` matches in ``str`` patterns (``re`` and ``str.isspace`` share
    CPython's ``Py_UNICODE_ISSPACE``)."""
    return np.asarray([c for c in range(0x110000) if chr(c).isspace()], np.int32)


@functools.lru_cache(maxsize=1)
def lower_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Python's lower-casing as a table: (codepoints int32[M] sorted, UTF-8 of the lowered text
    uint8[M, 4], its length int32[M]) over the characters that ``str.lower`` changes."""
    changed = [(c, chr(c).lower().encode("utf-8")) for c in range(0x110000)
               if not 0xD800 <= c < 0xE000 and chr(c).lower() != chr(c)]
    width = max(len(b) for _, b in changed)
    keys = np.asarray([c for c, _ in changed], np.int32)
    out = np.zeros((len(changed), width), np.uint8)
    lengths = np.zeros((len(changed),), np.int32)
    for i, (_, b) in enumerate(changed):
        out[i, : len(b)] = np.frombuffer(b, np.uint8)
        lengths[i] = len(b)
    return keys, out, lengths


def _ranges(flags: list[bool]) -> np.ndarray:
    """int32[R, 2]: the [start, end) codepoint ranges where ``flags`` (one per codepoint) hold."""
    out, start = [], None
    for c, flag in enumerate(flags + [False]):
        if flag and start is None:
            start = c
        elif not flag and start is not None:
            out.append((start, c))
            start = None
    return np.asarray(out, np.int32).reshape(-1, 2)


@functools.lru_cache(maxsize=1)
def sigma_tables() -> tuple[np.ndarray, np.ndarray]:
    """(cased ranges, case-ignorable ranges) as CPython's final-sigma rule sees them, probed through
    ``str.lower``: "A" + c + "Σ" ends in "ς" iff c is ignorable or cased, and "AΣ" + c keeps "ς" iff c is
    ignorable or not cased, so their conjunction is "ignorable". An ignorable character is always
    skipped, so its own casedness never matters: cased = first probe and not ignorable."""
    sigma, final = chr(CAPITAL_SIGMA), chr(FINAL_SIGMA)
    chars = [chr(c) if not 0xD800 <= c < 0xE000 else "" for c in range(0x110000)]
    ign_or_cased = [bool(ch) and ("A" + ch + sigma).lower().endswith(final) for ch in chars]
    ign_or_uncased = [bool(ch) and ("A" + sigma + ch).lower()[1] == final for ch in chars]
    ignorable = [a and b for a, b in zip(ign_or_cased, ign_or_uncased)]
    cased = [a and not i for a, i in zip(ign_or_cased, ignorable)]
    return _ranges(cased), _ranges(ignorable)


def _in_ranges(cp: jax.Array, ranges: np.ndarray) -> jax.Array:
    """bool[N]: cp[i] lies in one of the sorted [start, end) ranges."""
    if ranges.shape[0] == 0:
        return jnp.zeros(cp.shape, bool)
    starts, ends = jnp.asarray(ranges[:, 0]), jnp.asarray(ranges[:, 1])
    k = jnp.searchsorted(starts, cp, side="right") - 1
    return (k >= 0) & (cp < ends[jnp.maximum(k, 0)])


def decode_utf8(text: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """UTF-8 decoding of text[:n] (text: uint8[N]): (lead bool[N]: a valid character starts here,
    codepoint int32[N] (at leads), length int32[N] (bytes of the character at a lead, else 0),
    ok bool[N]: the byte belongs to a valid character (True past n))."""
    size = text.shape[0]
    idx = jnp.arange(size)
    b = jnp.where(idx < n, text.astype(jnp.int32), -1)
    pad = jnp.full((3,), -1, jnp.int32)
    b1, b2, b3 = (jnp.concatenate([b[k:], pad[:k]]) for k in (1, 2, 3))
    cont = lambda x: (x >= 0x80) & (x <= 0xBF)  # noqa: E731
    one = (b >= 0) & (b < 0x80)
    two = (b >= 0xC2) & (b <= 0xDF) & cont(b1)
    three = ((b >= 0xE0) & (b <= 0xEF) & cont(b1) & cont(b2)
             & ((b != 0xE0) | (b1 >= 0xA0)) & ((b != 0xED) | (b1 <= 0x9F)))
    four = ((b >= 0xF0) & (b <= 0xF4) & cont(b1) & cont(b2) & cont(b3)
            & ((b != 0xF0) | (b1 >= 0x90)) & ((b != 0xF4) | (b1 <= 0x8F)))
    length = jnp.where(one, 1, jnp.where(two, 2, jnp.where(three, 3, jnp.where(four, 4, 0)))).astype(jnp.int32)
    low = lambda x: x & 0x3F  # noqa: E731
    cp = jnp.where(one, b, 0)
    cp = jnp.where(two, ((b & 0x1F) << 6) | low(b1), cp)
    cp = jnp.where(three, ((b & 0x0F) << 12) | (low(b1) << 6) | low(b2), cp)
    cp = jnp.where(four, ((b & 0x07) << 18) | (low(b1) << 12) | (low(b2) << 6) | low(b3), cp)
    # Continuation bytes are never leads, so the leads found independently are the real characters, and
    # the text is valid iff they cover every byte exactly.
    lead = length > 0
    ends = jnp.where(lead, idx + length, 0)
    covered_to = jax.lax.cummax(ends)  # the furthest byte a character starting at or before i reaches
    covered_before = jnp.concatenate([jnp.zeros((1,), jnp.int32), covered_to[:-1]])
    ok = jnp.where(lead, covered_before <= idx, covered_before > idx)
    return lead, cp.astype(jnp.int32), length, ok | (idx >= n)


def normalize_bytes(text: jax.Array, n: jax.Array, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``normalize`` of text[:n] on device: (bytes uint8[width] (cut at width, zeros after),
    length int32[] (the full normalised length, may exceed width), valid bool[] (text[:n] is UTF-8))."""
    size = text.shape[0]
    idx = jnp.arange(size)
    lead, cp, length, ok = decode_utf8(text, n)
    valid = jnp.all(ok)
    keys, lowered, lowered_len = (jnp.asarray(t) for t in lower_table())
    k = jnp.clip(jnp.searchsorted(keys, cp), 0, keys.shape[0] - 1)
    changes = lead & (keys[k] == cp)

    # Final sigma: the nearest non-ignorable character before (and after) each position must be cased
    # (must be absent or uncased).
    cased_ranges, ignorable_ranges = sigma_tables()
    cased, ignorable = _in_ranges(cp, cased_ranges), _in_ranges(cp, ignorable_ranges)
    anchor = lead & ~ignorable
    prev_anchor = jax.lax.cummax(jnp.where(anchor, idx, -1))
    prev_anchor = jnp.concatenate([jnp.full((1,), -1, jnp.int32), prev_anchor[:-1]])
    next_anchor = jax.lax.cummin(jnp.where(anchor, idx, size), reverse=True)
    next_anchor = jnp.concatenate([next_anchor[1:], jnp.full((1,), size, jnp.int32)])
    before_cased = (prev_anchor >= 0) & cased[jnp.maximum(prev_anchor, 0)]
    after_cased = (next_anchor < size) & cased[jnp.minimum(next_anchor, size - 1)]
    final = lead & (cp == CAPITAL_SIGMA) & before_cased & ~after_cased
    sigma_bytes = jnp.asarray(list(chr(FINAL_SIGMA).encode("utf-8")) + [0, 0], jnp.uint8)

    raw = jnp.stack([text[jnp.minimum(idx + j, size - 1)] for j in range(4)], axis=-1)  # [N, 4]
    out = jnp.where(changes[:, None], lowered[k], raw)
    out = jnp.where(final[:, None], sigma_bytes[None, :], out)
    out_len = jnp.where(changes, lowered_len[k], length)
    out_len = jnp.where(final, 2, out_len)
    space = jnp.isin(cp, jnp.asarray(whitespace()))
    out_len = jnp.where(lead & ~space & (idx < n), out_len, 0)

    offsets = jnp.cumsum(out_len) - out_len
    cols = jnp.arange(4)
    dest = jnp.where(cols[None, :] < out_len[:, None], offsets[:, None] + cols[None, :], width)
    buf = jnp.zeros((width,), jnp.uint8).at[dest.reshape(-1)].set(out.reshape(-1), mode="drop")
    return buf, jnp.sum(out_len).astype(jnp.int32), valid


def answer_matches(text: jax.Array, n: jax.Array, label: jax.Array, label_len: jax.Array) -> jax.Array:
    """bool[]: RAGEN's check of the answer text[:n] (uint8[N]) against a normalised label
    (label: uint8[A] zero-padded, label_len: int32[])."""
    norm, norm_len, valid = normalize_bytes(text, n, label.shape[0])
    return valid & (norm_len == label_len) & jnp.all(norm == label.astype(jnp.uint8))
