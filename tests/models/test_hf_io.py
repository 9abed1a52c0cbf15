"""Hugging Face checkpoint I/O: config conversion, bit-exact round trips, sharding, clear errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from ragen_jax.models.config import PRESETS, ModelConfig, RopeScaling, get_preset
from ragen_jax.models.hf_io import (
    CheckpointError,
    config_from_hf,
    config_to_hf,
    hf_state_dict,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from ragen_jax.models.transformer import Transformer

SMALL = {
    "qwen2-tied": ModelConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, tie_embeddings=True, qkv_bias=True, architecture="qwen2"),
    "llama-untied-bf16": ModelConfig(
        vocab_size=280, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=1,
        head_dim=16, rope_theta=500000.0, rms_norm_eps=1e-5, tie_embeddings=False, qkv_bias=False,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), architecture="llama", dtype="bfloat16",
        param_dtype="bfloat16"),
}


def _random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model whose every parameter (biases and norm scales too) is random."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        return jnp.asarray(rng.standard_normal(x.shape).astype(np.float32), x.dtype)

    nnx.update(model, jax.tree_util.tree_map_with_path(draw, nnx.state(model, nnx.Param)))
    return model


def _params(model: Transformer) -> dict[str, np.ndarray]:
    return {
        "/".join(map(str, path)): np.asarray(var.get_value())
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _assert_bit_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def _file_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module", params=list(SMALL))
def saved(request, tmp_path_factory):
    """(config, model, directory of its single-file checkpoint)."""
    cfg = SMALL[request.param]
    model = _random_model(cfg)
    directory = save_hf_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return cfg, model, directory


# -- config.json ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_round_trip_for_every_preset(name):
    cfg = PRESETS[name]
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


def test_config_from_real_qwen25_config():
    """Fields of Qwen/Qwen2.5-0.5B's published config.json (transformers v4 layout)."""
    hf = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "rope_scaling": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24,
    }
    expected = get_preset("qwen2.5-0.5b", dtype="bfloat16", param_dtype="bfloat16")
    assert config_from_hf(hf) == expected


def test_config_from_real_llama32_config():
    """Fields of meta-llama/Llama-3.2-1B's published config.json."""
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "head_dim": 64, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "bfloat16",
    }
    expected = get_preset("llama3.2-1b", dtype="bfloat16", param_dtype="bfloat16")
    assert config_from_hf(hf) == expected


def test_config_from_transformers_v5_rope_parameters():
    hf = config_to_hf(SMALL["llama-untied-bf16"])
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {**scaling, "rope_theta": hf.pop("rope_theta")}
    hf["dtype"] = hf.pop("torch_dtype")
    assert config_from_hf(hf) == SMALL["llama-untied-bf16"]


def test_config_dtype_choice():
    hf = config_to_hf(SMALL["qwen2-tied"])
    for stored, expected in (("float16", "float32"), ("float32", "float32"), ("bfloat16", "bfloat16")):
        cfg = config_from_hf({**hf, "torch_dtype": stored})
        assert (cfg.param_dtype, cfg.dtype) == (expected, expected)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "Qwen2MoeForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_config_from_hf_rejects_unsupported(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**config_to_hf(SMALL["qwen2-tied"]), **change})


def test_config_to_hf_rejects_unrepresentable():
    with pytest.raises(ValueError, match="qkv_bias"):
        config_to_hf(dataclasses.replace(SMALL["qwen2-tied"], qkv_bias=False))
    with pytest.raises(ValueError, match="o_proj"):
        config_to_hf(dataclasses.replace(SMALL["llama-untied-bf16"], qkv_bias=True))


# -- round trips ---------------------------------------------------------------------------------------


def test_save_load_round_trip_is_bit_exact(saved):
    cfg, model, directory = saved
    loaded, loaded_cfg = load_hf_checkpoint(directory)
    assert loaded_cfg == cfg
    _assert_bit_equal(_params(model), _params(loaded))


def test_save_load_save_gives_identical_files(saved, tmp_path):
    _, _, directory = saved
    loaded, _ = load_hf_checkpoint(directory)
    save_hf_checkpoint(loaded, tmp_path)
    assert _file_bytes(directory) == _file_bytes(tmp_path)


def test_saved_tensors_are_hf_named_and_laid_out(saved):
    """Independent check of the layout: read the file with plain safetensors and compare to the
    module's arrays, transposing [in, out] kernels by hand."""
    cfg, model, directory = saved
    tensors = load_file(str(directory / "model.safetensors"))
    attn = model.layers[1].attn
    np.testing.assert_array_equal(
        tensors["model.layers.1.self_attn.k_proj.weight"], np.asarray(attn.k_proj.kernel[...]).T)
    np.testing.assert_array_equal(
        tensors["model.embed_tokens.weight"], np.asarray(model.embed.embedding[...]))
    np.testing.assert_array_equal(tensors["model.norm.weight"], np.asarray(model.final_norm.weight[...]))
    assert ("lm_head.weight" in tensors) == (not cfg.tie_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in tensors) == cfg.qkv_bias
    expected_dtype = ml_dtypes.bfloat16 if cfg.param_dtype == "bfloat16" else np.float32
    assert all(t.dtype == expected_dtype for t in tensors.values())
    assert len(tensors) == len(hf_state_dict(model))


def test_sharded_round_trip(saved, tmp_path):
    cfg, model, _ = saved
    embed_bytes = cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.param_dtype).itemsize
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=embed_bytes)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    assert all((tmp_path / s).exists() for s in shards)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in hf_state_dict(model).values())
    loaded, _ = load_hf_checkpoint(tmp_path)
    _assert_bit_equal(_params(model), _params(loaded))
    # Saving unsharded into the same directory removes the stale shards.
    save_hf_checkpoint(loaded, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_load_with_dtype_override(saved):
    cfg, model, directory = saved
    loaded, loaded_cfg = load_hf_checkpoint(directory, dtype="float32", compute_dtype="bfloat16")
    assert (loaded_cfg.param_dtype, loaded_cfg.dtype) == ("float32", "bfloat16")
    emb = np.asarray(loaded.embed.embedding[...])
    assert emb.dtype == np.float32
    np.testing.assert_array_equal(emb, np.asarray(model.embed.embedding[...]).astype(np.float32))


def test_loads_a_transformers_bfloat16_checkpoint_bit_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False)
    hf = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, cfg = load_hf_checkpoint(tmp_path)
    assert cfg.param_dtype == "bfloat16"
    ref = hf.model.layers[0].self_attn.q_proj.weight.detach().view(torch.int16).numpy()
    ours = np.asarray(model.layers[0].attn.q_proj.kernel[...])
    assert ours.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(ours.T.view(np.int16), ref)
    ref_bias = hf.model.layers[0].self_attn.v_proj.bias.detach().view(torch.int16).numpy()
    np.testing.assert_array_equal(np.asarray(model.layers[0].attn.v_proj.bias[...]).view(np.int16), ref_bias)


# -- errors --------------------------------------------------------------------------------------------


def _copy_checkpoint(directory, tmp_path):
    for p in directory.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    return tmp_path


def _rewrite_tensors(directory, edit) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_is_named(saved, tmp_path):
    directory = _copy_checkpoint(saved[2], tmp_path)
    _rewrite_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_checkpoint(directory)


def test_wrong_shape_names_tensor_shapes_and_file(saved, tmp_path):
    cfg, _, directory = saved
    directory = _copy_checkpoint(directory, tmp_path)
    name = "model.layers.0.self_attn.v_proj.weight"
    rows, cols = cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size

    def edit(t):
        t[name] = np.zeros((t[name].shape[0] + 16, t[name].shape[1]), t[name].dtype)

    _rewrite_tensors(directory, edit)
    with pytest.raises(CheckpointError) as err:
        load_hf_checkpoint(directory)
    text = str(err.value)
    assert name in text and "model.safetensors" in text
    assert f"shape [{rows + 16}, {cols}], expected [{rows}, {cols}]" in text


def test_unexpected_tensor_is_named_and_inv_freq_is_ignored(saved, tmp_path):
    directory = _copy_checkpoint(saved[2], tmp_path)
    _rewrite_tensors(directory, lambda t: t.update({
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    load_hf_checkpoint(directory)  # known-ignorable
    _rewrite_tensors(directory, lambda t: t.update({"model.layers.0.extra.weight": np.ones(4, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_hf_checkpoint(directory)


def test_tied_checkpoint_with_different_lm_head_fails(tmp_path):
    model = _random_model(SMALL["qwen2-tied"])
    save_hf_checkpoint(model, tmp_path)
    _rewrite_tensors(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        load_hf_checkpoint(tmp_path)
    # An lm_head.weight equal to the embedding is accepted (some exporters write both).
    _rewrite_tensors(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    load_hf_checkpoint(tmp_path)


def test_architecture_mismatch_between_config_and_tensors(saved, tmp_path):
    """A qwen2 file read under a llama config (or vice versa) names the offending tensor."""
    cfg, _, directory = saved
    directory = _copy_checkpoint(directory, tmp_path)
    other = dataclasses.replace(
        cfg, architecture="llama" if cfg.architecture == "qwen2" else "qwen2", qkv_bias=not cfg.qkv_bias,
        rope_scaling=None)
    (directory / "config.json").write_text(json.dumps(config_to_hf(other)))
    with pytest.raises(CheckpointError, match=r"self_attn\.[qkv]_proj\.bias"):
        load_hf_checkpoint(directory)


def test_unknown_architecture_names_it(saved, tmp_path):
    directory = _copy_checkpoint(saved[2], tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_hf_checkpoint(directory)


def test_truncated_safetensors_names_the_file(saved, tmp_path):
    directory = _copy_checkpoint(saved[2], tmp_path)
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(corrupt|truncated)"):
        load_hf_checkpoint(directory)


def test_bad_config_json_names_the_file(saved, tmp_path):
    directory = _copy_checkpoint(saved[2], tmp_path)
    text = (directory / "config.json").read_text()
    (directory / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_hf_checkpoint(directory)


def test_missing_shard_names_it(saved, tmp_path):
    _, model, _ = saved
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=1)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.norm.weight"]
    (tmp_path / victim).unlink()
    with pytest.raises(CheckpointError, match=f"shard .*{victim}.* is missing"):
        load_hf_checkpoint(tmp_path)


def test_missing_files_have_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(SMALL["qwen2-tied"])))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf_checkpoint(tmp_path)


def test_load_builds_the_module_abstractly(saved, monkeypatch):
    """Loading must not run the random initialisers on real arrays (a 7B model would first allocate
    28 GB of random weights): every initialiser call must happen under nnx.eval_shape."""
    import flax.nnx.nn.linear as linear_module

    calls = []
    original = linear_module.Linear.__init__

    def spy(self, *args, **kwargs):
        calls.append(isinstance(jnp.zeros(()), jax.core.Tracer))
        original(self, *args, **kwargs)

    monkeypatch.setattr(linear_module.Linear, "__init__", spy)
    load_hf_checkpoint(saved[2])
    assert calls and all(calls), "Linear layers were initialised outside eval_shape"
