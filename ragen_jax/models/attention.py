"""Grouped-query attention: masked (any mask, scores materialised) and causal blockwise (no score matrix).

Both take queries grouped by the key/value head they share::

    q: [B, K, G, T, D]   K key/value heads, G = num_heads / K query heads per key head
    k, v: [B, K, S, D]
    out: [B, K, G, T, D] in q's dtype

``masked_attention`` builds the f32[B, K, G, T, S] scores over every key it is given.
``prefix_attention`` is for appending to a KV cache (a prefill block or one decode token): the buffer
has a static width, but only its first ``length`` slots (a traced number) hold anything, so it walks
key blocks up to there and its cost follows the filled length, not the width (a decode step's single
query attends the whole buffer when the walk would not save memory traffic). ``causal_attention`` is
for a whole sequence attending to itself (the update,
the warm start, log-prob scoring), where that tensor and its softmax, kept for the backward pass, are
[B, H, T, T] float32 each: at T ~ 1,000 they are most of an update's memory. It walks query and key
blocks of ``block`` tokens with an online softmax, skips the key blocks above the diagonal, and its
custom VJP recomputes each block's probabilities from the saved row log-sum-exp, so what it keeps is
O(B H T D). Same numbers as ``masked_attention`` with the causal mask up to float32 rounding (the
softmax is normalised per block and the sums run in a different order).
With segment ids (sequences packed side by side in one row, ``rl/packing.py``; each sequence one
contiguous run of its id) a query also skips the keys of every other sequence, and the block loops skip
the blocks no row's sequences share: query block i starts at the key block holding the earliest start of
a sequence it contains, key block j stops at the query block holding the latest end of a sequence it
contains (``segment_block_bounds``). A skipped block is one whose every score is masked, so the result
is the same to the bit.

Forward (FlashAttention-2, Dao 2023, Algorithm 1), for query block i over key blocks j <= i:
    s = q_i k_j^T / sqrt(D), masked to -1e30
    m' = max(m, rowmax s);  p = exp(s - m');  l' = l e^(m - m') + rowsum p;  a' = a e^(m - m') + p v_j
    o_i = a / l;  lse_i = m + log l
Backward (Algorithm 2), with delta = rowsum(dO * O), for key block j over query blocks i >= j:
    p = exp(s - lse_i);  dV_j += p^T dO_i;  ds = p * (dO_i v_j^T - delta_i)
    dQ_i += ds k_j / sqrt(D);  dK_j += ds^T q_i / sqrt(D)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Large negative instead of -inf so that a query with no visible key (padding) gives a finite,
# uniform softmax rather than NaN.
MASKED = -1e30


def query_key_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """f32[B, K, G, T, S] = q k^T (unscaled).

    One query per row (a decode step) on XLA:CPU: G matrix-vector products k [S, D] . q_g [D] per (row,
    key head) instead of one [G, D] x [D, S] dot. XLA:CPU runs that small batched dot at a fraction of
    memory speed and the products at close to it (decode attention 1.5-2.5x faster at 256-2,186 slots,
    ``benchmarks/decode_attention.py``); accelerators keep the one dot, which reads each key once.
    """
    if q.shape[3] == 1 and jax.default_backend() == "cpu":
        per_head = [jnp.einsum("bksd,bkd->bks", k, q[:, :, g, 0], preferred_element_type=jnp.float32)
                    for g in range(q.shape[2])]
        return jnp.stack(per_head, axis=2)[:, :, :, None]
    return jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D) where mask) v.  mask: bool[B, T, S] (query t sees key s)."""
    scores = query_key_scores(q, k)
    scores = scores / math.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bksd->bkgtd", probs, v)


def prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, slot_valid: jax.Array, query_slot: jax.Array,
                     length: jax.Array, block: int) -> jax.Array:
    """Attention of T new queries to the first ``length`` slots of a KV buffer (forward only).

    q: [B, K, G, T, D]; k, v: [B, K, W, D]; slot_valid: bool[B, W]; query_slot: int32[T], the slot of
    each query (it sees keys at slots <= its own); length: int32[] (traced), <= W, past every slot a
    query may see. Key blocks of ``block`` slots (static) from slot 0 up to ``length``; a block that
    would run past W starts at W - block instead and skips the slots already seen. All W slots are
    attended at once (masked) when ``block`` is 0 or at least W, and for a single query when the walk
    would cover two thirds of them or more (see below).
    """
    w = k.shape[2]

    def whole(q, k, v):
        slot = jnp.arange(w)
        mask = (slot[None, :] <= query_slot[:, None])[None] & slot_valid[:, None, :]
        return masked_attention(q, k, v, mask)

    def walk(q, k, v):
        return _walk_key_blocks(q, k, v, slot_valid, query_slot, length, block)

    if not block or block >= w:  # one block's worth of scores costs no more than a block, without the loop
        return whole(q, k, v)
    if q.shape[3] == 1:
        # One query per row (a decode step) reads each key once and is bound by memory traffic. A block
        # walk copies every block it visits out of the buffer before its products (XLA:CPU cannot hand
        # a dynamic slice to a dot) but keeps the block in cache: measured on the tiny preset's decode
        # shapes (32 rows, 960 and 2,186 slots), a walked slot costs 1-1.5x a slot of the whole buffer,
        # so walk only when under two thirds of the buffer is walked.
        walked = (length + block - 1) // block * block
        return jax.lax.cond(3 * walked < 2 * w, walk, whole, q, k, v)
    return walk(q, k, v)


def _walk_key_blocks(q, k, v, slot_valid, query_slot, length, block):
    """prefix_attention as an online softmax over key blocks up to ``length`` (0 < block < W)."""
    w = k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    shape = q.shape[:-1]

    def key_block(j, carry):
        m, l, acc = carry
        start = jnp.minimum(j * block, w - block)
        k_j, v_j = _slice_t(k, start, block, 2), _slice_t(v, start, block, 2)
        slot = start + jnp.arange(block)
        seen = (slot[None, :] <= query_slot[:, None]) & (slot >= j * block)[None, :]
        mask = seen[None] & _slice_t(slot_valid, start, block, 1)[:, None, :]  # [B, T, block]
        s = query_key_scores(q, k_j) * scale
        s = jnp.where(mask[:, None, None], s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
        return m_new, l * rescale + jnp.sum(p, axis=-1), acc * rescale[..., None] + pv

    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(q.shape, jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, (length + block - 1) // block, key_block, init)
    return (acc / l[..., None]).astype(q.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, block: int,
                     segments: jax.Array | None = None) -> jax.Array:
    """Attention of a sequence to itself, query t seeing key s iff s <= t, key_valid[:, s] and (with
    ``segments``) segments[:, s] == segments[:, t].

    q: [B, K, G, T, D]; k, v: [B, K, T, D]; key_valid: bool[B, T]; block (static): tokens per query /
    key block; segments: int32[B, T] or None, which of the sequences packed into a row each position
    belongs to (``segment_mask``). T is padded up to a multiple of ``block`` (padding keys invalid,
    padding queries dropped), so a block larger than T attends in one block.
    """
    t = q.shape[3]
    block = max(1, min(block, t))
    pad = -t % block
    segments = jnp.zeros(key_valid.shape, jnp.int32) if segments is None else segments.astype(jnp.int32)
    if pad:
        q = jnp.pad(q, [(0, 0)] * 3 + [(0, pad), (0, 0)])
        k = jnp.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)])
        v = jnp.pad(v, [(0, 0), (0, 0), (0, pad), (0, 0)])
        key_valid = jnp.pad(key_valid, [(0, 0), (0, pad)])
        segments = jnp.pad(segments, [(0, 0), (0, pad)])
    out = _blockwise(q, k, v, key_valid, segments, block)
    return out[:, :, :, :t]


def segment_starts(segments: jax.Array) -> jax.Array:
    """bool[B, T]: the first position of each run of one id in segments int32[B, T] (column 0 included)."""
    return jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """bool[B, T, S]: query t and key s belong to the same packed sequence (int32[B, T], int32[B, S])."""
    return query_segments[:, :, None] == key_segments[:, None, :]


def _block_scores(q_i, k_j, key_valid_j, seg_i, seg_j, i, j, block):
    """f32[B, K, G, block, block] masked scores of query block i against key block j."""
    s = jnp.einsum("bkgtd,bksd->bkgts", q_i, k_j, preferred_element_type=jnp.float32)
    s = s / math.sqrt(q_i.shape[-1])
    q_pos = i * block + jnp.arange(block)
    k_pos = j * block + jnp.arange(block)
    mask = (k_pos[None, :] <= q_pos[:, None])[None] & key_valid_j[:, None, :]  # [B, block, block]
    mask = mask & segment_mask(seg_i, seg_j)
    return jnp.where(mask[:, None, None], s, MASKED)


def _slice_t(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def segment_block_bounds(segments: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(first_key_block int32[n], end_query_block int32[n]) for segments int32[B, Tp] (Tp = n * block).

    Query block i sees no key before block first_key_block[i]: the start of the run holding its first
    query, the earliest over the rows (runs are contiguous, so later queries of the block start no
    earlier). Key block j is seen by no query at or after block end_query_block[j]: one past the block
    holding the end of the run of its last key, the latest over the rows.
    """
    t = segments.shape[1]
    position = jnp.arange(t, dtype=jnp.int32)
    starts = segment_starts(segments)
    ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)
    run_start = jax.lax.cummax(jnp.where(starts, position, 0), axis=1)
    run_end = jax.lax.cummin(jnp.where(ends, position, t - 1), axis=1, reverse=True)
    first_key_block = jnp.min(run_start[:, ::block], axis=0) // block
    end_query_block = jnp.max(run_end[:, block - 1::block], axis=0) // block + 1
    return first_key_block.astype(jnp.int32), end_query_block.astype(jnp.int32)


def _forward(q, k, v, key_valid, segments, block):
    """(out [B, K, G, Tp, D] in q's dtype, lse f32[B, K, G, Tp])."""
    n = q.shape[3] // block
    first_key_block, _ = segment_block_bounds(segments, block)

    def query_block(i, first):
        q_i = _slice_t(q, i * block, block, 3)
        seg_i = _slice_t(segments, i * block, block, 1)
        shape = q_i.shape[:-1]

        def key_block(j, carry):
            m, l, acc = carry
            k_j, v_j = _slice_t(k, j * block, block, 2), _slice_t(v, j * block, block, 2)
            s = _block_scores(q_i, k_j, _slice_t(key_valid, j * block, block, 1), seg_i,
                              _slice_t(segments, j * block, block, 1), i, j, block)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            scale = jnp.exp(m - m_new)
            l = l * scale + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, l, acc * scale[..., None] + pv

        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(q_i.shape, jnp.float32))
        m, l, acc = jax.lax.fori_loop(first, i + 1, key_block, init)
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    # [n, B, K, G, block, D], [n, B, K, G, block]
    out, lse = jax.lax.map(lambda xs: query_block(*xs), (jnp.arange(n), first_key_block))
    out = jnp.moveaxis(out, 0, 3).reshape(q.shape)
    lse = jnp.moveaxis(lse, 0, 3).reshape(q.shape[:-1])
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blockwise(q, k, v, key_valid, segments, block):
    return _forward(q, k, v, key_valid, segments, block)[0]


def _blockwise_fwd(q, k, v, key_valid, segments, block):
    out, lse = _forward(q, k, v, key_valid, segments, block)
    return out, (q, k, v, key_valid, segments, out, lse)


def _blockwise_bwd(block, residuals, d_out):
    q, k, v, key_valid, segments, out, lse = residuals
    n = q.shape[3] // block
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)  # [B, K, G, Tp]
    _, end_query_block = segment_block_bounds(segments, block)

    def key_block(dq, xs):
        j, end = xs
        k_j, v_j = _slice_t(k, j * block, block, 2), _slice_t(v, j * block, block, 2)
        valid_j = _slice_t(key_valid, j * block, block, 1)
        seg_j = _slice_t(segments, j * block, block, 1)

        def query_block(i, carry):
            dk, dv, dq = carry
            q_i = _slice_t(q, i * block, block, 3)
            do_i = _slice_t(d_out, i * block, block, 3)
            s = _block_scores(q_i, k_j, valid_j, _slice_t(segments, i * block, block, 1), seg_j, i, j, block)
            p = jnp.exp(s - _slice_t(lse, i * block, block, 3)[..., None])
            dv = dv + jnp.einsum("bkgts,bkgtd->bksd", p, do_i)
            dp = jnp.einsum("bkgtd,bksd->bkgts", do_i, v_j.astype(jnp.float32))
            ds = p * (dp - _slice_t(delta, i * block, block, 3)[..., None]) * scale
            dk = dk + jnp.einsum("bkgts,bkgtd->bksd", ds, q_i.astype(jnp.float32))
            dq_i = _slice_t(dq, i * block, block, 3) + jnp.einsum("bkgts,bksd->bkgtd", ds, k_j.astype(jnp.float32))
            return dk, dv, jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=3)

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(j, end, query_block, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), (jnp.arange(n), end_query_block))
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape)  # [n, B, K, block, D] -> [B, K, Tp, D]
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
