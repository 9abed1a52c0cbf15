"""GGUF import: a local ``.gguf`` file (llama.cpp's format) -> Transformer, ModelConfig and HFTokenizer.

    model, cfg, tok = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")                 # float32 weights
    model, cfg, tok = load_gguf(path, dtype="bfloat16", compute_dtype="bfloat16")
    style, system = chat_settings(path)     # ("qwen", "You are a helpful AI assistant named SmolLM, ...")

Read with the ``gguf`` package's ``GGUFReader`` (memory-mapped); dequantized here, tensor by tensor,
to float32 and then cast to the parameter dtype. Supported:
- architectures: ``llama`` (Llama 2/3, SmolLM2, ...) and ``qwen2`` (Qwen2 / Qwen2.5);
- tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (block formats below);
- tokenizers: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE with merges), pre-tokenizers
  ``default`` / ``gpt-2``, ``smollm`` (and its llama.cpp aliases), ``qwen2``, ``llama-bpe``.
Anything else fails with a message naming the unsupported architecture, type or tokenizer.

Block formats (32 weights per block; ``d``, ``m`` float16; ``q`` the quantized values)::

    Q8_0  34 bytes: d, q int8[32]                   w_i = d * q_i
    Q4_0  18 bytes: d, 16 bytes of nibbles          w_i = d * (q_i - 8)
    Q4_1  20 bytes: d, m, 16 bytes of nibbles       w_i = d * q_i + m
    nibbles: byte j holds q_j in its low 4 bits and q_{j+16} in its high 4 bits.

Layout. A GGUF tensor of dims [ne0, ne1] (ne0 fastest) is the numpy / Hugging Face array [ne1, ne0],
i.e. ``[out, in]`` for projection weights, as in ``hf_io``'s name map, which this file reuses.

Q/K permutation (llama only). llama.cpp's ``llama`` graph applies RoPE to adjacent pairs
(x_{2j}, x_{2j+1}), while Hugging Face Llama rotates halves (x_j, x_{j+D/2}). The converter therefore
stores q_proj / k_proj with the rows of each head reordered so that HF rows j and j + D/2 become
adjacent rows 2j and 2j + 1::

    gguf = hf.reshape(H, 2, D/2, d_in).swapaxes(1, 2).reshape(H*D, d_in)   # H = heads (q) / kv heads (k)

and we undo it with ``reshape(H, D/2, 2, d_in).swapaxes(1, 2)``. Qwen2 files use the rotate-half
graph and are stored unpermuted.

Over 400 lines: the file reader, six block dequantizers, the Q/K un-permutation and the tokenizer
rebuild from metadata are one format's import; each part is small.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tokenizers
from flax import nnx
from gguf import GGMLQuantizationType, GGUFReader, ReaderField, ReaderTensor
from tokenizers import decoders, models, normalizers, pre_tokenizers

from ragen_jax.models.config import ModelConfig, RopeScaling
from ragen_jax.models.hf_io import _check_map_covers, _name_map, _variable
from ragen_jax.models.hf_tokenizer import END_TOKENS, PAD_CANDIDATES, HFTokenizer
from ragen_jax.models.tiktoken_convert import QWEN_SPLIT_PATTERN
from ragen_jax.models.transformer import Transformer, rope_inv_freq

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class GGUFError(ValueError):
    """A .gguf file that cannot be read as a model of ours; the message names the file and the cause."""


# ----------------------------------------------------------------------------------------------------
# Opening and metadata


def _directory_message(directory: Path) -> str:
    """Why a directory is not a model file, naming a few .gguf files inside it (a common slip: the
    folder a model was downloaded to instead of the file)."""
    found = sorted(p.name for p in directory.glob("*.gguf"))
    message = f"{directory} is a directory; expected a .gguf file"
    if found:
        message += f" such as {directory / found[0]}" + (f" (it holds {len(found)})" if len(found) > 1 else "")
    return message


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A memory-mapped reader for ``path``, with clear errors for a missing or non-GGUF file."""
    file = Path(path)
    if file.is_dir():
        raise GGUFError(_directory_message(file))
    if not file.is_file():
        raise GGUFError(f"GGUF file {file} does not exist")
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{file} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(str(file), "r")
    except Exception as e:  # the reader raises ValueError / KeyError on a truncated or corrupt file
        raise GGUFError(f"cannot read {file}: {e} (corrupt or truncated GGUF file: download it again)") from None
    if reader.byte_order != "I":
        raise GGUFError(f"{file} is a big-endian GGUF file; only little-endian files are supported")
    return reader


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python value (str, int, float, bool or list), or ``default`` if absent."""
    field: ReaderField | None = reader.fields.get(key)
    return default if field is None else field.contents()


def _file_name(reader: GGUFReader) -> str:
    return str(getattr(reader.data, "filename", None) or "the GGUF file")


def _f32_value(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores epsilons as float32:
    9.999999747378752e-06 -> 1e-05), so an exported config.json reads like the original."""
    return float(str(np.float32(x)))


# ----------------------------------------------------------------------------------------------------
# Dequantization


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """The raw bytes of a tensor as uint8[num_blocks, block_bytes]."""
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, block_bytes)


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 scale bytes uint8[n, 2] -> f32[n, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8[n, 16] -> uint8[n, 32]: the low nibbles are values 0..15, the high nibbles 16..31."""
    return np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=1)


def dequantize_array(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of numpy ``shape`` from a tensor's stored data (as ``ReaderTensor.data`` holds it).

    shape: the numpy shape, i.e. the GGUF dims reversed. Raises GGUFError for an unsupported type.
    """
    if qtype == Q.F32:
        out = np.asarray(data).view(np.float32)
    elif qtype == Q.F16:
        out = np.asarray(data).view(np.float16).astype(np.float32)
    elif qtype == Q.BF16:
        # bfloat16 is the top half of a float32: shift its 16 bits up.
        bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << np.uint32(16)
        out = bits.view(np.float32)
    elif qtype == Q.Q8_0:
        raw = _blocks(data, 34)
        out = raw[:, 2:].view(np.int8).astype(np.float32) * _f16(raw[:, :2])
    elif qtype == Q.Q4_0:
        raw = _blocks(data, 18)
        q = _nibbles(raw[:, 2:]).astype(np.int8) - np.int8(8)
        out = _f16(raw[:, :2]) * q.astype(np.float32)
    elif qtype == Q.Q4_1:
        raw = _blocks(data, 20)
        out = _f16(raw[:, :2]) * _nibbles(raw[:, 4:]).astype(np.float32) + _f16(raw[:, 2:4])
    else:
        name = getattr(qtype, "name", str(qtype))
        raise GGUFError(
            f"tensor type {name} is not supported; supported: {[t.name for t in SUPPORTED_TYPES]}. "
            "Re-quantize the model to one of them (e.g. llama-quantize ... Q8_0) or convert it to F16."
        )
    return out.reshape(shape)


def dequantize(tensor: ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy layout (dims reversed: [ne1, ne0] for a matrix)."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    try:
        return dequantize_array(tensor.data, tensor.tensor_type, shape)
    except GGUFError as e:
        raise GGUFError(f"tensor {tensor.name!r}: {e}") from None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (see the module docstring).  [H*D, ...] -> [H*D, ...]"""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


# ----------------------------------------------------------------------------------------------------
# Config


def _architecture(reader: GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{_file_name(reader)}: unsupported architecture {arch!r} (general.architecture); "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope_scaling_from_freqs(factors: np.ndarray, base: ModelConfig) -> RopeScaling:
    """The Llama-3 RopeScaling whose per-frequency divisors equal ``rope_freqs.weight``.

    llama.cpp stores Llama-3.1/3.2 scaling as divisors f_i = inv_freq_i / scaled_inv_freq_i; the largest
    is ``factor``; low/high frequency factors 1 / 4 and 8192 original positions are Meta's settings.
    """
    candidate = RopeScaling(float(np.max(factors)), 1.0, 4.0, 8192)
    plain = np.asarray(rope_inv_freq(base))
    scaled = np.asarray(rope_inv_freq(dataclasses.replace(base, rope_scaling=candidate)))
    if factors.shape != plain.shape or not np.allclose(plain / scaled, factors, rtol=1e-4):
        raise GGUFError(
            "rope_freqs.weight holds RoPE frequency factors that are not Llama-3 scaling "
            f"(factor={candidate.factor}, low/high 1/4, 8192 positions); this RoPE variant is not supported"
        )
    return candidate


def config_from_gguf(
    reader: GGUFReader, dtype: str = "float32", compute_dtype: str | None = None
) -> ModelConfig:
    """ModelConfig from the file's ``{arch}.*`` metadata and tensor shapes.

    vocab_size is the embedding's rows; tie_embeddings is "no output.weight tensor"; head_dim is
    ``attention.key_length`` (default hidden / heads). Raises GGUFError naming an unsupported setting.
    """
    arch = _architecture(reader)
    name = _file_name(reader)

    def key(suffix: str, default: Any = None, required: bool = False) -> Any:
        value = _field(reader, f"{arch}.{suffix}", default)
        if required and value is None:
            raise GGUFError(f"{name}: metadata key {arch}.{suffix} is missing")
        return value

    if key("expert_count", 0):
        raise GGUFError(f"{name}: mixture-of-experts models ({arch}.expert_count) are not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{name}: tensor 'token_embd.weight' is missing")
    vocab, hidden = (int(n) for n in reversed(tensors["token_embd.weight"].shape.tolist()))
    declared_vocab = key("vocab_size")
    if declared_vocab is not None and int(declared_vocab) != vocab:
        raise GGUFError(f"{name}: {arch}.vocab_size={declared_vocab} but token_embd.weight has {vocab} rows")
    heads = int(key("attention.head_count", required=True))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(f"{name}: partial RoPE ({arch}.rope.dimension_count={rotary} < head_dim {head_dim}) "
                        "is not supported")
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise GGUFError(f"{name}: RoPE scaling {scaling_type!r} ({arch}.rope.scaling.type) is not supported")
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=int(key("embedding_length", required=True)),
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_layers=int(key("block_count", required=True)),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_f32_value(key("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_value(key("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(key("context_length", 32768)),
        dtype=compute_dtype or dtype,
        param_dtype=dtype,
        architecture=arch,
    )
    if cfg.hidden_size != hidden:
        raise GGUFError(f"{name}: {arch}.embedding_length={cfg.hidden_size} but token_embd.weight is "
                        f"{hidden} wide")
    if "rope_freqs.weight" in tensors:
        factors = dequantize(tensors["rope_freqs.weight"])
        cfg = dataclasses.replace(cfg, rope_scaling=_rope_scaling_from_freqs(factors, cfg))
    return cfg


# ----------------------------------------------------------------------------------------------------
# Tokenizer

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    """(pre-tokenizer, normalizer) equivalent to llama.cpp's regexes for ``tokenizer.ggml.pre``."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2"):
        return gpt2, None
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp: every digit on its own ("\p{N}"), then GPT-2's regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), None
    if pre == "qwen2":
        return _split_then_bytes(QWEN_SPLIT_PATTERN), normalizers.NFC()
    if pre == "llama-bpe":
        return _split_then_bytes(_LLAMA3_SPLIT), None
    known = ["default", "gpt-2", "smollm", "starcoder", "refact", "codeshell", "qwen2", "llama-bpe"]
    close = difflib.get_close_matches(pre, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise GGUFError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {known}.{hint}")


# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_from_gguf(source: str | os.PathLike | GGUFReader, vocab_size: int | None = None) -> HFTokenizer:
    """The byte-level BPE tokenizer stored in the file's ``tokenizer.ggml.*`` metadata.

    vocab (token -> id = its index in tokenizer.ggml.tokens) and merges ("a b" strings) make a
    ``tokenizers`` BPE; control tokens (type 3) become special added tokens and user-defined ones
    (type 4) plain added tokens, at their own ids. End tokens: ``eos_token_id`` and ``eot_token_id``
    plus the known end-of-turn tokens present (as HFTokenizer does); pad: ``padding_token_id`` unless
    that is the end-of-turn token (see ``_pad_token``).
    vocab_size: the model's embedding rows (default: the number of tokens).
    """
    reader = source if isinstance(source, GGUFReader) else open_gguf(source)
    name = _file_name(reader)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise GGUFError(f"{name} holds no tokenizer (no tokenizer.ggml.model); pass a tokenizer separately")
    if kind != "gpt2":
        raise GGUFError(
            f"{name}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; only 'gpt2' "
            "(byte-level BPE, as in Llama-3, Qwen2, SmolLM2). SentencePiece ('llama') files are not read."
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = _field(reader, "tokenizer.ggml.merges", [])
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{name}: tokenizer.ggml.tokens holds duplicate tokens")
    pairs = []
    for merge in merges:
        a, sep, b = merge.partition(" ")
        if not sep:
            raise GGUFError(f"{name}: malformed merge {merge!r} in tokenizer.ggml.merges (expected 'a b')")
        pairs.append((a, b))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer, normalizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    added = [
        tokenizers.AddedToken(t, special=ty == _CONTROL, normalized=False)
        for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)  # contents already in the vocabulary keep their ids

    def token(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise GGUFError(f"{name}: tokenizer.ggml.{key}={i} is outside the {len(tokens)} tokens")
        return tokens[int(i)]

    declared = [t for t in (token("eos_token_id"), token("eot_token_id")) if t is not None]
    added_contents = {a.content for a in added}
    eos = list(dict.fromkeys(declared + [t for t in END_TOKENS if t in added_contents]))
    return HFTokenizer(
        tok, vocab_size=vocab_size or len(tokens), pad_token=_pad_token(token("padding_token_id"), eos,
                                                                        added_contents),
        eos_tokens=eos or None,
    )


def _pad_token(declared: str | None, eos: list[str], added: set[str]) -> str | None:
    """The pad token: the file's, unless it is the end-of-turn token (SmolLM2 declares <|im_end|>).

    A pad id fills the slots a row leaves empty and ``HFTokenizer.decode`` drops it, so it must not be
    the token the chat format writes after every message; then the first of HFTokenizer's pad
    candidates (``<|endoftext|>`` first) that is not that token is used instead.
    """
    end_of_turn = eos[0] if eos else None
    if declared is None or declared != end_of_turn:
        return declared
    for candidate in PAD_CANDIDATES:
        if candidate in added and candidate != end_of_turn:
            return candidate
    return declared


def chat_template(source: str | os.PathLike | GGUFReader) -> str | None:
    """The Jinja chat template stored in the file (``tokenizer.chat_template``), if any."""
    reader = source if isinstance(source, GGUFReader) else open_gguf(source)
    return _field(reader, "tokenizer.chat_template")


_DEFAULT_SYSTEM_RE = re.compile(r"<\|im_start\|>system\n(.+?)<\|im_end\|>", re.S)


def chat_settings(source: str | os.PathLike | GGUFReader) -> tuple[str, str | None]:
    """(chat style for ``ragen_jax.models.chat``, the template's default system prompt or None).

    The style comes from the template's turn markers: ``<|im_start|>`` (ChatML: Qwen, SmolLM2) ->
    "qwen"; ``<|start_header_id|>`` -> "llama3". The default system prompt is the literal text a
    ChatML template writes when the first message is not a system one (SmolLM2: "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face").
    """
    template = chat_template(source)
    if template is None:
        raise GGUFError("the file has no tokenizer.chat_template; choose the chat style by hand")
    if "<|im_start|>" in template:
        match = _DEFAULT_SYSTEM_RE.search(template)
        return "qwen", match.group(1) if match else None
    if "<|start_header_id|>" in template:
        return "llama3", None
    raise GGUFError("the file's chat template is neither ChatML nor Llama-3; choose the chat style by hand")


# ----------------------------------------------------------------------------------------------------
# Weights


def _gguf_name(hf_name: str) -> str:
    """Hugging Face tensor name (hf_io's name map) -> GGUF tensor name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name).groups()
    parts = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def load_gguf(
    path: str | os.PathLike, dtype: str = "float32", compute_dtype: str | None = None
) -> tuple[Transformer, ModelConfig, HFTokenizer]:
    """Read a local .gguf file into (Transformer, ModelConfig, HFTokenizer); no random init first.

    dtype: parameter dtype ("float32" / "bfloat16"; weights are dequantized to float32, then cast).
    compute_dtype: matmul dtype; None means ``dtype``.
    Raises GGUFError naming the file and the unsupported architecture / tensor type / tokenizer, or
    the missing, unexpected or misshapen tensor.
    """
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, dtype, compute_dtype)
    tensors = {t.name: t for t in reader.tensors}
    entries = _name_map(cfg)
    wanted = {_gguf_name(e.hf_name): e for e in entries}
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise GGUFError(
            f"{path}: tensor {missing[0]!r} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; the metadata describes a {cfg.architecture} model with {cfg.num_layers} layers"
        )
    unexpected = sorted(set(tensors) - set(wanted) - {"rope_freqs.weight"})
    if unexpected:
        raise GGUFError(f"{path}: unexpected tensor {unexpected[0]!r}; it does not belong to a "
                        f"{cfg.architecture} model of {cfg.num_layers} layers")

    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    # Abstract module (shapes only): weights are set straight from the file, never randomly initialised.
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    _check_map_covers(model, entries)
    for gguf_name, e in wanted.items():
        array = dequantize(tensors[gguf_name])
        if array.shape != e.shape:
            raise GGUFError(f"{path}: tensor {gguf_name!r} has shape {list(array.shape)}, expected "
                            f"{list(e.shape)} from the metadata")
        if cfg.architecture == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_heads if ".attn_q." in gguf_name else cfg.num_kv_heads
            array = unpermute_qk(array, heads)
        array = array.T if e.transpose else array
        array = np.ascontiguousarray(array.astype(target, copy=False))
        _variable(model, e.path).set_value(jnp.asarray(array))
    tokenizer = tokenizer_from_gguf(reader, vocab_size=cfg.vocab_size)
    return model, cfg, tokenizer
