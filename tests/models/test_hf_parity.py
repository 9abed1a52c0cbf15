"""Logit parity with transformers' PyTorch Qwen2ForCausalLM / LlamaForCausalLM on random tiny checkpoints.

Each config builds a random HF model (every weight, bias and norm scale perturbed so nothing is
trivially zero or one), saves it with ``save_pretrained`` (safetensors), loads it with
``load_hf_checkpoint`` and compares float32 logits on a left-padded batch. HF gets the same
positions our model derives (position_ids = clip(cumsum(mask) - 1, 0)) and the attention mask, so
both treat padding alike; only logits of real tokens are compared.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ragen_jax.models.config import ModelConfig, RopeScaling  # noqa: E402
from ragen_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from ragen_jax.models.kv_cache import init_cache  # noqa: E402
from ragen_jax.models.transformer import Transformer  # noqa: E402

TOL = 1e-4
# Llama-3 scaling small enough to act at head_dim 16, theta 1e4: wavelengths 2*pi*1e4^(i/8) are
# 6.3, 19.9, 62.8, 199, ...; with original_max 64 the 2nd and 3rd are blended, the rest divided by 8.
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS = {
    "qwen2-tied-gqa4:2": dict(
        arch="qwen2", vocab=320, hidden=64, heads=4, kv=2, tie=True, rope_scaling=None, theta=10000.0),
    "qwen2-untied-gqa4:1": dict(
        arch="qwen2", vocab=400, hidden=64, heads=4, kv=1, tie=False, rope_scaling=None, theta=1e6),
    "llama-tied-llama3rope": dict(
        arch="llama", vocab=300, hidden=64, heads=4, kv=2, tie=True, rope_scaling=LLAMA3_SCALING,
        theta=10000.0),
    "llama-untied-gqa6:2": dict(
        arch="llama", vocab=352, hidden=96, heads=6, kv=2, tie=False, rope_scaling=None, theta=500000.0),
}
BATCH, LENGTH = 3, 12
PAD_LEFT = (0, 3, 7)  # left padding per row


def _hf_model(spec: dict, seed: int):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=2 * spec["hidden"],
        num_hidden_layers=2, num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"],
        tie_word_embeddings=spec["tie"], rope_theta=spec["theta"], rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )
    if spec["arch"] == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common, rope_scaling=spec["rope_scaling"])
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def _batch(vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (BATCH, LENGTH)).astype(np.int32)
    mask = np.ones((BATCH, LENGTH), bool)
    for row, pad in enumerate(PAD_LEFT):
        mask[row, :pad] = False
        tokens[row, :pad] = 0
    return tokens, mask


def _hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    """(name, HF model, checkpoint dir, our model, our config, tokens, mask, HF logits)."""
    torch.set_num_threads(2)
    spec = CONFIGS[request.param]
    hf = _hf_model(spec, seed=len(request.param))
    directory = tmp_path_factory.mktemp("hf_" + request.param.replace(":", "_"))
    hf.save_pretrained(directory, safe_serialization=True)
    model, cfg = load_hf_checkpoint(directory)
    tokens, mask = _batch(spec["vocab"], seed=1)
    return request.param, hf, directory, model, cfg, tokens, mask, _hf_logits(hf, tokens, mask)


def test_loaded_config_matches_hf(case):
    name, hf, _, _, cfg, *_ = case
    spec = CONFIGS[name]
    assert cfg.architecture == spec["arch"]
    assert cfg.qkv_bias == (spec["arch"] == "qwen2")
    assert cfg.tie_embeddings == spec["tie"]
    head_dim = spec["hidden"] // spec["heads"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (spec["heads"], spec["kv"], head_dim)
    assert cfg.rope_theta == spec["theta"]
    if spec["rope_scaling"] is None:
        assert cfg.rope_scaling is None
    else:
        s = spec["rope_scaling"]
        assert cfg.rope_scaling == RopeScaling(
            s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"])
    assert cfg.param_dtype == "float32"


def test_full_forward_logits_match_transformers(case):
    _, _, _, model, _, tokens, mask, ref = case
    ours, cache = model(jnp.asarray(tokens), jnp.asarray(mask))
    assert cache is None
    diff = np.abs(np.asarray(ours) - ref)[mask]
    assert diff.max() <= TOL, f"max |logit diff| {diff.max():.3g} > {TOL}"
    assert np.abs(ref[mask]).max() > 0.1  # the comparison is not between near-zero logits


def test_cache_in_two_chunks_matches_transformers(case):
    """Prefill the first 8 columns into a KV cache, append the last 4: same logits as HF's one pass."""
    _, _, _, model, cfg, tokens, mask, ref = case
    cache = init_cache(cfg, BATCH, max_len=16)
    split = 8
    first, cache = model(jnp.asarray(tokens[:, :split]), jnp.asarray(mask[:, :split]), cache=cache)
    second, cache = model(jnp.asarray(tokens[:, split:]), jnp.asarray(mask[:, split:]), cache=cache)
    ours = np.concatenate([np.asarray(first), np.asarray(second)], axis=1)
    diff = np.abs(ours - ref)[mask]
    assert diff.max() <= TOL, f"max |logit diff| {diff.max():.3g} > {TOL}"
    np.testing.assert_array_equal(np.asarray(cache.next_pos), mask.sum(axis=1))


@pytest.mark.parametrize("case", ["llama-tied-llama3rope"], indirect=True)
def test_llama3_rope_scaling_is_exercised(case, tmp_path):
    """Sensitivity check: dropping rope_scaling from the checkpoint must move the logits far past TOL,
    so the parity above really covers the Llama-3 frequency scaling."""
    name, _, directory, _, _, tokens, mask, ref = case
    assert CONFIGS[name]["rope_scaling"] is not None
    unscaled = tmp_path / "unscaled"
    shutil.copytree(directory, unscaled)
    config = json.loads((unscaled / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": CONFIGS[name]["theta"]}
    (unscaled / "config.json").write_text(json.dumps(config))
    model, cfg = load_hf_checkpoint(unscaled)
    assert cfg.rope_scaling is None
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(mask))
    assert np.abs(np.asarray(logits) - ref)[mask].max() > 100 * TOL


# --------------------------------------------------------------------------------------------------
# Export: our random model -> save_hf_checkpoint -> transformers.from_pretrained -> same logits

EXPORT_CONFIGS = {
    "qwen2-untied-gqa4:2": ModelConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rope_theta=10000.0, tie_embeddings=False, qkv_bias=True, architecture="qwen2"),
    "llama-tied-llama3rope": ModelConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=1,
        head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=True, qkv_bias=False,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), architecture="llama"),
}


def _randomize(model: Transformer, seed: int) -> None:
    """Every parameter random: norm scales 1 + 0.1 z, everything else 0.1 z."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        z = rng.standard_normal(x.shape).astype(np.float32)
        is_norm = any("norm" in str(p) for p in path)
        return jnp.asarray((1.0 + 0.1 * z) if is_norm else 0.1 * z, x.dtype)

    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map_with_path(draw, state))


@pytest.mark.parametrize("name", list(EXPORT_CONFIGS))
def test_exported_checkpoint_loads_in_transformers(name, tmp_path):
    torch.set_num_threads(2)
    cfg = EXPORT_CONFIGS[name]
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    _randomize(model, seed=3)
    save_hf_checkpoint(model, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True)
    hf = hf.float().eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[cfg.architecture]
    tokens, mask = _batch(cfg.vocab_size, seed=2)
    ref = _hf_logits(hf, tokens, mask)
    ours, _ = model(jnp.asarray(tokens), jnp.asarray(mask))
    diff = np.abs(np.asarray(ours) - ref)[mask]
    assert diff.max() <= TOL, f"max |logit diff| {diff.max():.3g} > {TOL}"
