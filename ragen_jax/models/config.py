"""Static model settings (a frozen dataclass) and the named presets.

One config describes both families the model code supports:
- Qwen2 / Qwen2.5: q/k/v projections with bias, plain RoPE (theta from the config).
- Llama 3.x / SmolLM2: no q/k/v bias, optionally Llama-3 RoPE frequency scaling.
"""

from __future__ import annotations

import dataclasses
import difflib

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 RoPE frequency scaling (Hugging Face ``rope_scaling`` with ``rope_type: llama3``)."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer.

    ``dtype`` is the compute dtype of matmuls (float32 or bfloat16); ``param_dtype`` is the storage
    dtype of the weights. Norms, softmax, RoPE tables and logits are always float32.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = True
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    param_dtype: str = "float32"
    architecture: str = "qwen2"  # "qwen2" or "llama": what HF export writes as model_type
    # Tokens per query/key block of a sequence attending to itself (update, warm start, scoring):
    # ragen_jax.models.attention.causal_attention, whose memory grows with T instead of T^2.
    # 0 materialises the [B, H, T, T] scores instead (masked_attention).
    attention_block: int = 128

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}")
        if self.attention_block < 0:
            raise ValueError(f"attention_block must be >= 0 (0: unblocked), got {self.attention_block}")
        if self.architecture not in ("qwen2", "llama"):
            raise ValueError(f"architecture must be 'qwen2' or 'llama', got {self.architecture!r}")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, h, kv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.qkv_bias:
            attn += h * hd + 2 * kv * hd
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + d


_LLAMA32_SCALING = RopeScaling(32.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    # CPU default and tests: ~3.2M parameters over the 264-id character tokenizer.
    "tiny": ModelConfig(
        vocab_size=264, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=64, rope_theta=10000.0, max_position_embeddings=4096,
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, head_dim=64, rope_theta=1e6, tie_embeddings=True,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, rope_theta=1e6, tie_embeddings=True,
    ),
    "qwen2.5-3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16,
        num_kv_heads=2, head_dim=128, rope_theta=1e6, tie_embeddings=True,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rope_theta=1e6, tie_embeddings=False,
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5, tie_embeddings=True,
        qkv_bias=False, rope_scaling=_LLAMA32_SCALING, max_position_embeddings=131072,
        architecture="llama",
    ),
    "llama3.2-3b": ModelConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, tie_embeddings=True,
        qkv_bias=False, rope_scaling=_LLAMA32_SCALING, max_position_embeddings=131072,
        architecture="llama",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True,
        qkv_bias=False, max_position_embeddings=8192, architecture="llama",
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named preset, with any field replaced by ``overrides`` (e.g. ``dtype="bfloat16"``)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}.{hint}")
    return dataclasses.replace(PRESETS[name], **overrides)
