"""The static-shape KV cache shared by the sampler, the rollout and the MI cross-scoring.

Layout (chosen for CPU and accelerator speed: decode reads keys/values contiguously per head)::

    k, v:      [num_layers, B, num_kv_heads, S, head_dim]   keys already rotated by RoPE
    slot_valid: bool[B, S]    slot s of row b holds a real token (padding leaves holes)
    end:        int32[]       next write slot, the same for every row ("batch-uniform index")
    next_pos:   int32[B]      RoPE position the next real token of row b gets

Every call that appends T tokens writes slots [end, end + T) of all rows; rows whose new tokens are
padding get invalid slots there, so their RoPE positions stay contiguous (padding never shifts
positions) and attention skips the holes. Memory: 2 * num_layers * B * num_kv_heads * S * head_dim
elements of the compute dtype, plus B * S booleans. The caller sizes S to the whole conversation and
must not append past it (``append`` raises on the host when it can tell; inside jit it is the caller's
static bookkeeping).
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
