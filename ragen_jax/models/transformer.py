"""Decoder-only transformer (Qwen2 / Llama family) in Flax NNX.

One module serves the trainer (full sequences, no cache) and the sampler (appending to a static KV
cache); there is no second implementation to keep in sync.

    logits, cache = model(tokens, valid)               # full causal forward, cache is None
    logits, cache = model(tokens, valid, cache=cache)  # append T tokens to the cache
    logits, window = model(tokens, valid, cache=window)  # the same on a KVWindow (decode loops)
    hidden, cache = model(tokens, valid, cache=cache, return_hidden=True)
    logits, _ = model(tokens, valid, segments=segments)  # several sequences packed into each row
    logits = model.lm_logits(hidden)                   # float32 logits from final hidden states

tokens: int32[B, T]; valid: bool[B, T] marks real tokens (padding may sit anywhere: left, right or in
holes). RoPE positions count valid tokens only: position of token t in row b = (tokens already in the
cache for row b) + (number of valid tokens before t), so padding never shifts positions and a
left-padded prompt gets the same logits as the unpadded one. segments: int32[B, T] (no cache), the
packed sequence each position belongs to, as contiguous runs of one id (``rl/packing.py``): a token
attends only to its own sequence and its position counts from that sequence's start, so each sequence
gets the logits it would get in a row of its own.

Block: x + Attn(RMSNorm(x)), then h + SwiGLU(RMSNorm(h)).
Attention: grouped-query, q/k/v bias when ``cfg.qkv_bias`` (Qwen2), softmax in float32; a sequence
attending to itself does so in blocks of ``cfg.attention_block`` tokens (``models/attention.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.attention import (causal_attention, masked_attention, prefix_attention, segment_mask,
                                        segment_starts)
from ragen_jax.models.config import ModelConfig, RopeScaling
from ragen_jax.models.kv_cache import KVCache, KVWindow, close_window, filled_columns, open_window

def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """inv_freq_i = theta^(-2i/d) for i < d/2, with Llama-3 scaling when configured.  f32[head_dim/2]"""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if cfg.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, cfg.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
    """Llama-3 frequency scaling: long wavelengths divided by ``factor``, short kept, medium blended."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, blended, scaled)


def segment_start_counts(counted: jax.Array, valid: jax.Array, segments: jax.Array) -> jax.Array:
    """int32[B, T]: valid tokens before the start of each position's segment (all [B, T]; ``counted`` is
    the running count of valid tokens, inclusive). Segments are contiguous runs, so the count at the
    latest segment start is a running maximum."""
    return jax.lax.cummax(jnp.where(segment_starts(segments), counted - valid.astype(jnp.int32), 0), axis=1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face convention).

    x: [B, heads, T, D]; positions: int32[B, T]; inv_freq: f32[D/2].
    x' = x * cos(p * f) + rotate_half(x) * sin(p * f), rotate_half([a, b]) = [-b, a].
    """
    angles = positions[:, None, :, None].astype(jnp.float32) * inv_freq  # [B, 1, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * normed).astype(x.dtype)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
        kernel_init=nnx.initializers.normal(0.02), rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg, d, h * hd, cfg.qkv_bias, rngs)
        self.k_proj = _linear(cfg, d, kv * hd, cfg.qkv_bias, rngs)
        self.v_proj = _linear(cfg, d, kv * hd, cfg.qkv_bias, rngs)
        self.o_proj = _linear(cfg, h * hd, d, False, rngs)

    def __call__(self, x, positions, inv_freq, attend):
        """x: [B, T, d]; positions: int32[B, T]; attend(q, k_new, v_new) -> out.

        q: [B, Hkv, G, T, D] (query heads grouped by the key/value head they share); k_new/v_new:
        [B, Hkv, T, D], this call's keys (RoPE applied) and values; out: [B, Hkv, G, T, D]. ``attend``
        decides which keys the queries see: this sequence's own (causal) or a cache's slots.
        """
        cfg = self.cfg
        b, t, _ = x.shape
        groups = cfg.num_heads // cfg.num_kv_heads
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 2, 1, 3)
        q = apply_rope(q, positions, inv_freq).reshape(b, cfg.num_kv_heads, groups, t, cfg.head_dim)
        k = apply_rope(k, positions, inv_freq)
        out = attend(q, k, v)
        out = out.reshape(b, cfg.num_heads, t, cfg.head_dim).transpose(0, 2, 1, 3)
        return self.o_proj(out.reshape(b, t, cfg.num_heads * cfg.head_dim))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, False, rngs)
        self.up_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, False, rngs)
        self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, False, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, inv_freq, attend):
        x = x + self.attn(self.input_norm(x), positions, inv_freq, attend)
        return x + self.mlp(self.post_attn_norm(x))


class Transformer(nnx.Module):
    """The decoder. See the module docstring for the call contract."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
            embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
        )
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] from final (normed) hidden states [..., d]."""
        if self.cfg.tie_embeddings:
            w = self.embed.embedding[...].astype(self.cfg.compute_dtype)
            return jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)
        w = self.lm_head.kernel[...].astype(self.cfg.compute_dtype)
        return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        valid: jax.Array,
        cache: KVCache | KVWindow | None = None,
        *,
        return_hidden: bool = False,
        kv_len: int | None = None,
        remat: bool = False,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | KVWindow | None]:
        """Logits f32[B, T, V] (or final hidden [B, T, d]) and the updated cache (None without one).

        kv_len (static, cache only): attend to cache slots [0, kv_len) only. A caller that knows the
        filled part of the cache is shorter than its capacity uses it to skip the empty tail; it must
        be >= end + T. A ``KVWindow`` (the decode loop's form of the cache) is attended whole and comes
        back as a window; kv_len must then be None or its width.
        remat (static, no cache only): a gradient taken through this forward recomputes each block from
        its input instead of keeping the block's activations, the same numbers in less memory.
        segments (no cache only): int32[B, T], see the module docstring.
        """
        valid = valid.astype(bool)
        if segments is not None and cache is not None:
            raise ValueError("segments (packed sequences) are for a forward without a cache")
        base = jnp.zeros(tokens.shape[:1], jnp.int32) if cache is None else cache.next_pos
        counted = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
        if segments is not None:
            counted = counted - segment_start_counts(counted, valid, segments)
        positions = jnp.maximum(base[:, None] + counted - 1, 0)
        inv_freq = rope_inv_freq(self.cfg)
        x = self.embed(tokens)

        if cache is None:
            attend = self._self_attend(valid, segments)

            def block(layer, x):
                return layer(x, positions, inv_freq, attend)

            if remat:
                # Without it the backward pass keeps every layer's float32 attention scores and
                # probabilities ([B, H, T, T] each), the bulk of an update's memory at T ~ 1,000.
                block = nnx.remat(block)
            for layer in self.layers:
                x = block(layer, x)
            new_cache = None
        else:
            x, new_cache = self._cached_layers(x, positions, inv_freq, valid, cache, kv_len)

        hidden = self.final_norm(x)
        if return_hidden:
            return hidden, new_cache
        return self.lm_logits(hidden), new_cache

    def _self_attend(self, valid, segments):
        """attend(q, k, v) of a sequence to itself: causal, padding keys and other packed sequences skipped."""
        block, t = self.cfg.attention_block, valid.shape[1]
        if block and t > block:
            return lambda q, k, v: causal_attention(q, k, v, valid, block, segments)
        # One block's worth of scores: materialising them costs no more memory than a block would.
        mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
        if segments is not None:
            mask = mask & segment_mask(segments, segments)
        return lambda q, k, v: masked_attention(q, k, v, mask)

    def _cached_layers(self, x, positions, inv_freq, valid, cache: KVCache | KVWindow, kv_len):
        if isinstance(cache, KVWindow):
            if kv_len not in (None, cache.max_len):
                raise ValueError(
                    f"kv_len={kv_len} with a window of {cache.max_len} slots: a window is attended "
                    "whole (open it with the width to attend)"
                )
            return self._window_layers(x, positions, inv_freq, valid, cache)
        width = cache.max_len if kv_len is None else kv_len
        x, window = self._window_layers(x, positions, inv_freq, valid, open_window(cache, width))
        return x, close_window(cache, window, cache.end, x.shape[1])

    def _window_layers(self, x, positions, inv_freq, valid, window: KVWindow):
        """Append T tokens at slot ``window.end`` of every layer's buffer and attend to the filled slots.

        Each layer's keys and values go to the attention as the whole buffer its append just updated,
        so XLA updates it in place and copies nothing (a slice of it would be copied). With
        ``cfg.attention_block`` the attention walks key blocks up to the filled length only
        (``prefix_attention``); with 0 it attends all W slots. ``end`` advances past the last column
        that holds a valid token in any row: trailing all-padding columns leave no hole.
        """
        t = x.shape[1]
        slot_valid = jax.lax.dynamic_update_slice(window.slot_valid, valid, (0, window.end))
        query_slot = window.end + jnp.arange(t)
        ks, vs = list(window.k), list(window.v)
        for i, layer in enumerate(self.layers):

            def attend(q, k_new, v_new, i=i):
                start = (0, 0, window.end, 0)
                ks[i] = jax.lax.dynamic_update_slice(ks[i], k_new.astype(ks[i].dtype), start)
                vs[i] = jax.lax.dynamic_update_slice(vs[i], v_new.astype(vs[i].dtype), start)
                return prefix_attention(q, ks[i], vs[i], slot_valid, query_slot, window.end + t,
                                        self.cfg.attention_block)

            x = layer(x, positions, inv_freq, attend)
        new_window = KVWindow(
            k=tuple(ks),
            v=tuple(vs),
            slot_valid=slot_valid,
            end=window.end + filled_columns(valid),
            next_pos=window.next_pos + jnp.sum(valid, axis=1, dtype=jnp.int32),
        )
        return x, new_window
