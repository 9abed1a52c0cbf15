"""The static-shape KV cache shared by the sampler, the rollout and the MI cross-scoring.

Layout (chosen for CPU and accelerator speed: decode reads keys/values contiguously per head)::

    k, v:      [num_layers, B, num_kv_heads, S, head_dim]   keys already rotated by RoPE
    slot_valid: bool[B, S]    slot s of row b holds a real token (padding leaves holes)
    end:        int32[]       next write slot, the same for every row ("batch-uniform index")
    next_pos:   int32[B]      RoPE position the next real token of row b gets

Every call that appends T tokens writes slots [end, end + T) of all rows; rows whose new tokens are
padding get invalid slots there, so their RoPE positions stay contiguous (padding never shifts
positions) and attention skips the holes. ``end`` then advances past the last of those columns that
any row filled (columns of padding only take no slot), and ``compact`` moves each row's tokens to
its front, so holes do not accumulate; attention walks key blocks up to ``end`` only
(``models.attention.prefix_attention``). Memory: 2 * num_layers * B * num_kv_heads * S * head_dim
elements of the compute dtype, plus B * S booleans. The caller sizes S to the whole conversation and
must not append past it (``append`` raises on the host when it can tell; inside jit it is the caller's
static bookkeeping).

A decode loop works on a ``KVWindow`` instead: the first W slots of every layer as a buffer of its own
([B, num_kv_heads, W, head_dim] per layer), attended whole. XLA cannot hand a slice of a buffer to a
matmul without copying it, so attending to layer i's filled slots straight out of the stacked cache
costs a copy of them per layer and step; a window's buffers go to the attention as they are, and each
step's append updates them in place (the attention slices one key block at a time out of them). ``open_window`` copies the attended slots out once per
``generate``, ``widen_window`` grows the window between decode segments, and ``close_window`` writes
back only the slots the loop appended. While a loop runs the window sits beside the cache: up to
another ``cache_bytes`` (the attended slots only), on top of the one copy of each slot per ``generate``.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ragen_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    slot_valid: jax.Array
    end: jax.Array
    next_pos: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens (slots)."""
    dtype = cfg.compute_dtype if dtype is None else jnp.dtype(dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        slot_valid=jnp.zeros((batch, max_len), bool),
        end=jnp.zeros((), jnp.int32),
        next_pos=jnp.zeros((batch,), jnp.int32),
    )


def filled_columns(valid: jax.Array) -> jax.Array:
    """int32[]: one past the last column of valid bool[B, T] that any row fills (0 if none): the slots
    an append of those columns advances ``end`` by."""
    t = valid.shape[1]
    return jnp.max(jnp.where(jnp.any(valid, axis=0), jnp.arange(1, t + 1), 0))


def compact(cache: KVCache) -> KVCache:
    """``cache`` with each row's valid slots moved to its front, in their order, and ``end`` at the
    longest row's count: the holes that padding and early-stopped rows left are gone, so what comes
    next is written, and attended, over the real tokens only. Attention is unchanged (keys carry their
    RoPE positions, and their order, hence the causal mask, is kept)."""
    order = jnp.argsort(~cache.slot_valid, axis=1, stable=True)  # [B, S]
    count = jnp.sum(cache.slot_valid, axis=1, dtype=jnp.int32)

    def take(x):  # [layers, B, heads, S, head_dim]
        return jnp.take_along_axis(x, order[None, :, None, :, None], axis=3)

    return cache.replace(
        k=take(cache.k), v=take(cache.v),
        slot_valid=jnp.arange(cache.max_len)[None, :] < count[:, None],
        end=jnp.max(count),
    )


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int) -> int:
    """Memory of ``init_cache(cfg, batch, max_len)`` in bytes."""
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_len * cfg.head_dim
    return kv * cfg.compute_dtype.itemsize + batch * max_len


def repeat_rows(cache: KVCache, index: jax.Array) -> KVCache:
    """A cache whose row i is row ``index[i]`` of ``cache`` (e.g. one prompt prefill shared by S samples).

    index: int32[B_new]
    """
    return KVCache(
        k=cache.k[:, index],
        v=cache.v[:, index],
        slot_valid=cache.slot_valid[index],
        end=cache.end,
        next_pos=cache.next_pos[index],
    )


@flax.struct.dataclass
class KVWindow:
    """Slots [0, W) of a ``KVCache``, one buffer per layer (see the module docstring).

    k, v: tuples of num_layers arrays [B, num_kv_heads, W, head_dim]; slot_valid: bool[B, W];
    end, next_pos: as in ``KVCache`` (end <= W).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    slot_valid: jax.Array
    end: jax.Array
    next_pos: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


def open_window(cache: KVCache, width: int) -> KVWindow:
    """The first ``width`` slots of ``cache`` (static, <= its capacity) as per-layer buffers."""
    if not 0 < width <= cache.max_len:
        raise ValueError(f"a window of {width} slots does not fit a cache of {cache.max_len}")
    layers = range(cache.k.shape[0])
    return KVWindow(
        k=tuple(cache.k[i, :, :, :width] for i in layers),
        v=tuple(cache.v[i, :, :, :width] for i in layers),
        slot_valid=cache.slot_valid[:, :width],
        end=cache.end,
        next_pos=cache.next_pos,
    )


def widen_window(window: KVWindow, width: int) -> KVWindow:
    """``window`` grown to ``width`` slots (static); the new slots are empty (zeros, invalid)."""
    extra = width - window.max_len
    if extra < 0:
        raise ValueError(f"cannot narrow a window of {window.max_len} slots to {width}")
    if extra == 0:
        return window
    pad = ((0, 0), (0, 0), (0, extra), (0, 0))
    return window.replace(
        k=tuple(jnp.pad(k, pad) for k in window.k),
        v=tuple(jnp.pad(v, pad) for v in window.v),
        slot_valid=jnp.pad(window.slot_valid, ((0, 0), (0, extra))),
    )


def close_window(cache: KVCache, window: KVWindow, start, count: int) -> KVCache:
    """``cache`` with slots [start, start + count) taken from ``window`` (the rest unchanged).

    start: int or int32[] (traced is fine); count: static, start + count <= window.max_len. ``end``
    and ``next_pos`` come from the window.
    """
    start = jnp.asarray(start, jnp.int32)
    zero = jnp.zeros((), jnp.int32)

    def put(stacked, layers):
        for i, layer in enumerate(layers):
            new = jax.lax.dynamic_slice_in_dim(layer, start, count, axis=2)
            stacked = jax.lax.dynamic_update_slice(stacked, new[None], (i, zero, zero, start, zero))
        return stacked

    valid = jax.lax.dynamic_slice_in_dim(window.slot_valid, start, count, axis=1)
    return KVCache(
        k=put(cache.k, window.k),
        v=put(cache.v, window.v),
        slot_valid=jax.lax.dynamic_update_slice(cache.slot_valid, valid, (zero, start)),
        end=window.end,
        next_pos=window.next_pos,
    )
