"""GGUF import on tiny files written here with ``gguf.GGUFWriter``.

References: the ``gguf`` package's own dequantizer (``gguf.quants.dequantize``), transformers'
LlamaForCausalLM / Qwen2ForCausalLM built from the original (un-permuted) weights, and the
``tokenizers`` tokenizer the file's vocabulary was exported from. The Q/K permutation is written into
the files the way llama.cpp's converter does it (``_permute`` below), so logit parity with
transformers checks that the loader undoes it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ragen_jax.models.config import RopeScaling  # noqa: E402
from ragen_jax.models.gguf import (  # noqa: E402
    GGUFError, chat_settings, config_from_gguf, dequantize, load_gguf, open_gguf, tokenizer_from_gguf,
)

Q = gguf.GGMLQuantizationType
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SYSTEM = "You are a tiny test model"
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
)
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16


# ------------------------------------------------------------------------------------------ helpers


def _encode_tensor(array: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for GGUFWriter.add_tensor: the array stored as ``type_name``."""
    if type_name == "F32":
        return array.astype(np.float32), None
    if type_name == "F16":
        return array.astype(np.float16), None
    qtype = Q[type_name]
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def _roundtrip(array: np.ndarray, type_name: str) -> np.ndarray:
    """What a reader should get back: the gguf package's dequantization of the stored form."""
    data, qtype = _encode_tensor(array, type_name)
    if qtype is None:
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, qtype).reshape(array.shape)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation: per head, rows j and j + D/2 -> 2j and 2j + 1."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _trained_tokenizer() -> tokenizers.Tokenizer:
    """A small byte-level BPE with SmolLM2's pre-tokenization (digits split, then GPT-2's regex)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The capital of France is Paris. The capital of Italy is Rome.",
        "You are in a frozen lake; move left, right, up or down. Answer: <answer>Left</answer>",
        "Sokoban: push the box onto the target. 1234 + 5678 = 6912",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def _vocab_metadata(tok: tokenizers.Tokenizer) -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges as "a b", token types) as llama.cpp's converter writes them."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]  # 3 = control, 1 = normal
    return tokens, merges, types


def _hf_weights(arch: str, vocab: int, tie: bool, seed: int) -> dict[str, np.ndarray]:
    """Random Hugging Face-named weights ([out, in]) of a 2-layer model."""
    rng = np.random.default_rng(seed)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tie:
        w["lm_head.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": (q, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
        })
        if arch == "qwen2":
            w.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)})
    out = {}
    for name, shape in w.items():
        if name.endswith("norm.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return out


_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_tensor_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_PARTS[module]}.{kind}"


def _write_model(path, arch: str, hf: dict, type_of, tok: tokenizers.Tokenizer, pre: str = "smollm",
                 eps: float = 1e-5, theta: float = 10000.0) -> dict[str, np.ndarray]:
    """Write ``hf`` as a GGUF file (matrices stored as ``type_of(i)``, 1-D tensors F32, Q/K permuted for
    llama); return the weights a reader should recover (each matrix round-tripped through its type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_dimension_count(HEAD_DIM)
    tokens, merges, types = _vocab_metadata(tok)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(TEMPLATE)
    expected = {}
    for i, (name, array) in enumerate(hf.items()):
        stored = array
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            stored = _permute(array, HEADS if "q_proj" in name else KV_HEADS)
        type_name = "F32" if array.ndim == 1 else type_of(i)
        data, raw = _encode_tensor(stored, type_name)
        writer.add_tensor(_gguf_tensor_name(name), data, raw_dtype=raw)
        # Rows are quantized independently, so the row permutation commutes with quantization.
        expected[name] = _roundtrip(array, type_name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _hf_logits(arch: str, weights: dict, vocab: int, tie: bool, tokens: np.ndarray, eps: float,
               theta: float) -> np.ndarray:
    common = dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        tie_word_embeddings=tie, rope_theta=theta, rms_norm_eps=eps, max_position_embeddings=512,
    )
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set()), (missing, unexpected)
    if tie:
        model.tie_weights()
    with torch.no_grad():
        return model.eval()(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


# ------------------------------------------------------------------------------------------ dequantization


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One file holding the same random [6, 96] matrix (3 blocks per row) in every supported type."""
    rng = np.random.default_rng(0)
    source = rng.standard_normal((6, 96)).astype(np.float32)
    source[0, :32] = 0.0  # an all-zero block (scale 0)
    source[1, 5] = 40.0  # an outlier dominating its block's scale
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in TYPES:
        data, raw = _encode_tensor(source, name)
        writer.add_tensor(name, data, raw_dtype=raw)
    data, raw = _encode_tensor(source, "Q5_0")
    writer.add_tensor("Q5_0", data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, source


# Largest |dequantized - original| allowed, relative to the largest |value| of the row's block.
_QUANT_ERROR = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15}


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf_dequantizer(typed_file, type_name):
    path, source = typed_file
    tensor = {t.name: t for t in open_gguf(path).tensors}[type_name]
    assert tensor.tensor_type == Q[type_name]
    ours = dequantize(tensor)
    theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(source.shape)
    assert ours.dtype == np.float32 and ours.shape == source.shape
    np.testing.assert_array_equal(ours, theirs)
    # And it is a dequantization of the source, not just the same bytes reinterpreted.
    block_max = np.abs(source.reshape(6, 3, 32)).max(axis=-1, keepdims=True)
    err = np.abs(ours - source).reshape(6, 3, 32)
    assert np.all(err <= _QUANT_ERROR[type_name] * block_max + 1e-7)


def test_unsupported_tensor_type_is_named(typed_file):
    path, _ = typed_file
    tensor = {t.name: t for t in open_gguf(path).tensors}["Q5_0"]
    with pytest.raises(GGUFError, match=r"tensor 'Q5_0'.*Q5_0 is not supported"):
        dequantize(tensor)


# ------------------------------------------------------------------------------------------ models


@pytest.fixture(scope="module")
def tokenizer():
    return _trained_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """name -> (path, arch, tie, expected weights) for the model files under test."""
    vocab = tokenizer.get_vocab_size()
    out = {}
    specs = {
        # arch, tie, type of the i-th tensor, eps, theta
        "llama-f32-tied": ("llama", True, lambda i: "F32", 1e-5, 10000.0),
        "llama-mixed-untied": ("llama", False, lambda i: TYPES[i % len(TYPES)], 1e-6, 100000.0),
        "qwen2-mixed-tied": ("qwen2", True, lambda i: TYPES[(i + 3) % len(TYPES)], 1e-6, 1e6),
    }
    directory = tmp_path_factory.mktemp("models")
    for seed, (name, (arch, tie, type_of, eps, theta)) in enumerate(specs.items()):
        hf = _hf_weights(arch, vocab, tie, seed)
        path = directory / f"{name}.gguf"
        expected = _write_model(path, arch, hf, type_of, tokenizer, eps=eps, theta=theta)
        out[name] = (path, arch, tie, expected, eps, theta)
    return out


@pytest.mark.parametrize("name", ["llama-f32-tied", "llama-mixed-untied", "qwen2-mixed-tied"])
def test_logits_match_transformers(files, tokenizer, name):
    path, arch, tie, expected, eps, theta = files[name]
    model, cfg, _ = load_gguf(path)
    vocab = tokenizer.get_vocab_size()
    tokens = np.random.default_rng(1).integers(0, vocab, (2, 11)).astype(np.int32)
    ours, _ = model(tokens, np.ones(tokens.shape, bool))
    reference = _hf_logits(arch, expected, vocab, tie, tokens, eps, theta)
    np.testing.assert_allclose(np.asarray(ours), reference, atol=1e-4, rtol=1e-4)


def test_config_from_metadata(files, tokenizer):
    path, *_ = files["llama-mixed-untied"]
    cfg = config_from_gguf(open_gguf(path), dtype="bfloat16")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        tokenizer.get_vocab_size(), HIDDEN, FFN, LAYERS)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-6  # float32 in the file, clean here
    assert cfg.max_position_embeddings == 512 and cfg.rope_scaling is None
    assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.architecture) == (False, False, "llama")
    assert (cfg.param_dtype, cfg.dtype) == ("bfloat16", "bfloat16")
    qwen = config_from_gguf(open_gguf(files["qwen2-mixed-tied"][0]))
    assert (qwen.architecture, qwen.qkv_bias, qwen.tie_embeddings) == ("qwen2", True, True)
    assert qwen.rope_theta == 1e6


def test_bfloat16_load_casts_the_dequantized_weights(files):
    path, _, _, expected, *_ = files["llama-f32-tied"]
    model, cfg, _ = load_gguf(path, dtype="bfloat16")
    embedding = np.asarray(model.embed.embedding[...])
    assert cfg.param_dtype == "bfloat16" and embedding.dtype.name == "bfloat16"
    np.testing.assert_array_equal(
        embedding.astype(np.float32),
        expected["model.embed_tokens.weight"].astype(embedding.dtype).astype(np.float32),
    )


def test_tokenizer_from_metadata_encodes_like_the_original(files, tokenizer):
    path, *_ = files["llama-f32-tied"]
    ours = tokenizer_from_gguf(path)
    texts = [
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "1234 + 5678 = 6912, it's   spaced\n\n and\ttabbed",
        "naïve café ☃ <answer>Left || Up</answer><|endoftext|>",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == text.replace("<|endoftext|>", "")  # the pad token decodes to nothing
    assert ours.special_id("<|im_start|>") == tokenizer.token_to_id("<|im_start|>")
    assert ours.eos_ids[0] == tokenizer.token_to_id("<|im_end|>")
    assert ours.pad_id == tokenizer.token_to_id("<|endoftext|>")
    assert ours.vocab_size == tokenizer.get_vocab_size() and ours.kind == "byte_level"


def test_pad_declared_as_end_of_turn_is_replaced(tmp_path, tokenizer):
    tokens, merges, types = _vocab_metadata(tokenizer)

    def vocab(writer):  # as in SmolLM2's file: eos and pad are both <|im_end|>
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|im_end|>"))

    path = tmp_path / "pad.gguf"
    _write_minimal(path, "llama", vocab)
    tok = tokenizer_from_gguf(path)
    assert tok.eos_ids[0] == tokens.index("<|im_end|>")
    assert tok.pad_id == tokens.index("<|endoftext|>")
    assert tok.decode(tok.encode("Hi<|im_end|>")) == "Hi<|im_end|>"


def test_chat_settings_from_template(files):
    assert chat_settings(files["llama-f32-tied"][0]) == ("qwen", SYSTEM)


# ------------------------------------------------------------------------------------------ errors


def _write_minimal(path, arch: str, extra=None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_embedding_length(64)
    writer.add_head_count(1)
    writer.add_block_count(0)
    writer.add_feed_forward_length(64)
    if extra:
        extra(writer)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    _write_minimal(path, "falcon")
    with pytest.raises(GGUFError, match=r"unsupported architecture 'falcon'.*\['llama', 'qwen2'\]"):
        load_gguf(path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    path = tmp_path / "no_norm.gguf"
    _write_minimal(path, "llama")  # 0 layers, only token_embd.weight
    with pytest.raises(GGUFError, match=r"tensor 'output_norm.weight' is missing"):
        load_gguf(path)

    def extra(writer):
        writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float32))

    path = tmp_path / "extra.gguf"
    _write_minimal(path, "llama", extra)
    with pytest.raises(GGUFError, match=r"unexpected tensor 'blk.0.attn_q.weight'"):
        load_gguf(path)


def test_unsupported_tokenizers_are_named(tmp_path):
    def sentencepiece(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "a"])

    path = tmp_path / "spm.gguf"
    _write_minimal(path, "llama", sentencepiece)
    with pytest.raises(GGUFError, match=r"tokenizer model 'llama'.*only 'gpt2'"):
        tokenizer_from_gguf(path)

    def odd_pre(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smolm")
        writer.add_token_list(["a", "b"])

    path = tmp_path / "pre.gguf"
    _write_minimal(path, "llama", odd_pre)
    with pytest.raises(GGUFError, match=r"pre-tokenizer 'smolm'.*Did you mean 'smollm'"):
        tokenizer_from_gguf(path)


def test_not_a_gguf_file(tmp_path):
    with pytest.raises(GGUFError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        load_gguf(bad)


def _llama3_divisors(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's rope_freqs for Llama 3.1 (low 1, high 4, 8192 positions)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    def rope(writer):
        writer.add_rope_freq_base(500000.0)
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(500000.0, 64, 8.0))

    path = tmp_path / "llama31.gguf"
    _write_minimal(path, "llama", rope)
    cfg = config_from_gguf(open_gguf(path))
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)

    def other(writer):
        writer.add_tensor("rope_freqs.weight", np.linspace(1.0, 3.0, 32).astype(np.float32))

    path = tmp_path / "odd_rope.gguf"
    _write_minimal(path, "llama", other)
    with pytest.raises(GGUFError, match="not Llama-3 scaling"):
        config_from_gguf(open_gguf(path))
