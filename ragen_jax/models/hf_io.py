"""Hugging Face checkpoint I/O: ``config.json`` + safetensors (single file or sharded) <-> Transformer.

    model, cfg = load_hf_checkpoint("/ckpt/Qwen2.5-0.5B")            # weights as stored in the files
    model, cfg = load_hf_checkpoint("/ckpt/Qwen2.5-0.5B", dtype="float32")
    save_hf_checkpoint(model, "/out/policy", max_shard_bytes=2**30, tokenizer=tok)

Supported: ``Qwen2ForCausalLM`` (model_type ``qwen2``) and ``LlamaForCausalLM`` (``llama``), tied or untied
embeddings, grouped-query attention, Llama-3 RoPE scaling. Reading uses the ``safetensors`` numpy API
(bfloat16 through ml_dtypes), never torch.

Tensor names and layouts (HF ``nn.Linear.weight`` is [out, in]; our ``nnx.Linear.kernel`` is [in, out])::

    model.embed_tokens.weight                    [V, d]        -> embed.embedding            [V, d]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight [out, in] -> layers[i].attn.*.kernel    [in, out]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias [out]         -> layers[i].attn.*.bias      (qwen2)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight [out, in]  -> layers[i].mlp.*.kernel     [in, out]
    model.layers.{i}.input_layernorm.weight      [d]           -> layers[i].input_norm.weight
    model.layers.{i}.post_attention_layernorm.weight [d]       -> layers[i].post_attn_norm.weight
    model.norm.weight                            [d]           -> final_norm.weight
    lm_head.weight                               [V, d]        -> lm_head.kernel             [d, V] (untied)

Transposes and dtype-preserving copies are exact, so save -> load -> save reproduces every bit (and
the same file bytes: tensors, metadata and config.json are written in a fixed order).

Parameter dtype: ``load_hf_checkpoint(dtype=None)`` keeps the dtype the tensors are stored in (float32
or bfloat16; float16 files are widened to float32, which is exact, because the model supports only
those two); the compute dtype follows the parameter dtype unless ``compute_dtype`` is given.
``config_from_hf`` alone (no files) takes the same choice from ``torch_dtype`` / ``dtype`` in config.json.

Over 400 lines: reading and writing one format both ways (config mapping, name mapping, sharded
safetensors, header checks) share the tables; splitting reader and writer would duplicate them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from ragen_jax.models.config import ModelConfig, RopeScaling
from ragen_jax.models.transformer import Transformer

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# Tensors some checkpoints carry that hold no parameters of ours (recomputed RoPE tables).
_IGNORABLE = re.compile(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a model of ours; the message names the file/tensor."""


# ----------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _param_dtype_from_hf(name: str | None) -> str:
    # float16 has no ModelConfig setting; widening to float32 is exact.
    return "bfloat16" if name == "bfloat16" else "float32"


def _rope_settings(c: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers v4 keys (rope_theta, rope_scaling) or v5 rope_parameters."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    spec = scaling or params
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if float(spec.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported: RoPE must rotate the whole head")
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; only 'llama3' (Llama 3.1/3.2) is. "
            "Remove rope_scaling from config.json only if the model was trained without it."
        )
    scale = RopeScaling(
        factor=float(spec["factor"]),
        low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(
            spec.get("original_max_position_embeddings", c.get("max_position_embeddings", 8192))
        ),
    )
    return float(theta), scale


def config_from_hf(config_json: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face ``config.json`` dict (Qwen2ForCausalLM or LlamaForCausalLM).

    Raises ValueError naming the unsupported architecture or setting (other RoPE scalings, sliding
    window, MLP bias, biased o_proj, activations other than SiLU).
    """
    c = config_json
    model_type = c.get("model_type")
    archs = c.get("architectures") or []
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs or model_type!r} (model_type {model_type!r}); "
            f"supported: {sorted(_ARCHITECTURES.values())}"
        )
    if archs and archs[0] != _ARCHITECTURES[model_type]:
        raise ValueError(
            f"unsupported architecture {archs[0]!r}; for model_type {model_type!r} only "
            f"{_ARCHITECTURES[model_type]!r} is supported"
        )
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
    if c.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported (the MLP has no biases)")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
        if c.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=true is not supported (full attention only)")
    else:
        if c.get("attention_bias", False):
            raise ValueError("Llama attention_bias=true (biases on q/k/v and o_proj) is not supported")
        qkv_bias = False
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    theta, scaling = _rope_settings(c)
    param_dtype = _param_dtype_from_hf(c.get("torch_dtype", c.get("dtype")))
    return ModelConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),  # Qwen2Config / LlamaConfig default
        qkv_bias=qkv_bias,
        rope_scaling=scaling,
        max_position_embeddings=int(c.get("max_position_embeddings", 32768)),
        dtype=param_dtype,
        param_dtype=param_dtype,
        architecture=model_type,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` dict transformers (v4 and v5) and HF-compatible servers read for ``cfg``."""
    if cfg.architecture == "qwen2" and not cfg.qkv_bias:
        raise ValueError("a qwen2 model must have qkv_bias=True; use architecture='llama' for no biases")
    if cfg.architecture == "llama" and cfg.qkv_bias:
        raise ValueError(
            "Hugging Face Llama cannot express q/k/v biases without an o_proj bias; "
            "use architecture='qwen2' for a model with qkv_bias=True"
        )
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.param_dtype,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if cfg.architecture == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out


# ----------------------------------------------------------------------------------------------------
# The name map


@dataclasses.dataclass(frozen=True)
class _Entry:
    hf_name: str
    path: tuple[str | int, ...]  # attribute / list-index path of the nnx.Param in Transformer
    shape: tuple[int, ...]  # HF shape
    transpose: bool  # HF [out, in] <-> ours [in, out]


def _name_map(cfg: ModelConfig) -> list[_Entry]:
    d, hd, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv, ff = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    entries = [_Entry("model.embed_tokens.weight", ("embed", "embedding"), (v, d), False)]
    for i in range(cfg.num_layers):
        pre, at = f"model.layers.{i}.", ("layers", i, "attn")
        for name, out_dim in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            entries.append(_Entry(f"{pre}self_attn.{name}.weight", at + (name, "kernel"), (out_dim, d), True))
            if cfg.qkv_bias:
                entries.append(_Entry(f"{pre}self_attn.{name}.bias", at + (name, "bias"), (out_dim,), False))
        entries.append(_Entry(f"{pre}self_attn.o_proj.weight", at + ("o_proj", "kernel"), (d, q), True))
        mlp = ("layers", i, "mlp")
        for name, shape in (("gate_proj", (ff, d)), ("up_proj", (ff, d)), ("down_proj", (d, ff))):
            entries.append(_Entry(f"{pre}mlp.{name}.weight", mlp + (name, "kernel"), shape, True))
        norms = (("input_layernorm", "input_norm"), ("post_attention_layernorm", "post_attn_norm"))
        for hf_norm, ours in norms:
            entries.append(_Entry(f"{pre}{hf_norm}.weight", ("layers", i, ours, "weight"), (d,), False))
    entries.append(_Entry("model.norm.weight", ("final_norm", "weight"), (d,), False))
    if not cfg.tie_embeddings:
        entries.append(_Entry("lm_head.weight", ("lm_head", "kernel"), (v, d), True))
    return entries


def _variable(model: Transformer, path: tuple[str | int, ...]) -> nnx.Variable:
    obj: Any = model
    for p in path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return obj


def _check_map_covers(model: Transformer, entries: list[_Entry]) -> None:
    """Guard against the module's parameter tree and this file's name map drifting apart."""
    params = {tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    mapped = {e.path for e in entries}
    if params != mapped:
        raise RuntimeError(
            f"hf_io name map out of date with Transformer: unmapped {sorted(params - mapped, key=str)}, "
            f"missing {sorted(mapped - params, key=str)}"
        )


# ----------------------------------------------------------------------------------------------------
# Loading


def _read_json(file: Path) -> dict:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{file} not found: a Hugging Face checkpoint directory needs it") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the file is corrupt or truncated") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, found {type(data).__name__}")
    return data


def _tensor_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the file header or the shard index)."""
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.exists():
        return {name: single for name in _header_keys(single)}
    if not index.exists():
        found = sorted(p.name for p in directory.glob("*")) if directory.is_dir() else []
        raise CheckpointError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {directory} (found: {found}). PyTorch .bin "
            "checkpoints are not read: re-save them with save_pretrained(safe_serialization=True)."
        )
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no 'weight_map' object")
    files: dict[str, Path] = {}
    for shard in sorted(set(weight_map.values())):
        path = directory / shard
        if not path.exists():
            names = sorted(k for k, v in weight_map.items() if v == shard)
            raise CheckpointError(
                f"shard {path} listed in {index} is missing (it should hold {len(names)} tensors, "
                f"e.g. {names[0]!r})"
            )
        keys = _header_keys(path)
        for name in sorted(k for k, v in weight_map.items() if v == shard):
            if name not in keys:
                raise CheckpointError(f"{index} puts tensor {name!r} in {path}, but that file lacks it")
            files[name] = path
    return files


def _header_keys(file: Path) -> set[str]:
    try:
        with safe_open(str(file), framework="numpy") as f:
            return set(f.keys())
    except Exception as e:  # safetensors raises its own error type for a bad header / size
        raise CheckpointError(
            f"cannot read {file}: {e} (corrupt or truncated safetensors file: download or save it again)"
        ) from None


def _read_tensors(files: dict[str, Path], names: Iterable[str]) -> Iterable[tuple[str, np.ndarray]]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, file_names in by_file.items():
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in file_names:
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensors from {file}: {e}") from None


def _header_info(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype tag such as "F32" / "BF16"), reading each file's header once."""
    info = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                info[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    return info


def _validate(
    files: dict[str, Path], info: dict, entries: list[_Entry], cfg: ModelConfig, directory: Path
) -> None:
    expected = {e.hf_name for e in entries}
    missing = sorted(expected - set(files))
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} lacks tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; config.json describes a {_ARCHITECTURES[cfg.architecture]} with {cfg.num_layers} layers, "
            f"tie_word_embeddings={cfg.tie_embeddings}"
        )
    tolerated = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unexpected = sorted(
        n for n in files if n not in expected and n not in tolerated and not _IGNORABLE.fullmatch(n)
    )
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {unexpected[0]!r} in {files[unexpected[0]]}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + f": it does not belong to a {_ARCHITECTURES[cfg.architecture]} described by config.json"
        )
    for e in entries:
        shape, dtype = info[e.hf_name]
        if shape != e.shape:
            raise CheckpointError(
                f"tensor {e.hf_name!r} in {files[e.hf_name]} has shape {list(shape)}, expected "
                f"{list(e.shape)} from config.json"
            )
        if dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(
                f"tensor {e.hf_name!r} in {files[e.hf_name]} has dtype {dtype}; expected F32, BF16 or F16"
            )


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint directory's ``config.json``; CheckpointError names the file and
    what is wrong (missing, not JSON, a required field missing or mistyped, an unsupported setting)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    config_file = directory / CONFIG_FILE
    try:
        return config_from_hf(_read_json(config_file))
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{config_file} lacks or mistypes required field {e}") from None
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from None


def _layout(directory: Path) -> tuple[ModelConfig, dict[str, Path], dict]:
    """(config, tensor name -> file, tensor name -> (shape, dtype tag)) after checking that config.json
    and the safetensors headers describe one model of ours; reads headers only, no tensor data."""
    cfg = read_hf_config(directory)
    files = _tensor_files(directory)
    info = _header_info(files)
    _validate(files, info, _name_map(cfg), cfg, directory)
    return cfg, files, info


def check_hf_checkpoint(path: str | os.PathLike) -> ModelConfig:
    """Everything ``load_hf_checkpoint`` checks before reading tensor data (config.json, the weight
    files' headers and sizes, tensor names and shapes), reading no tensor data; raises CheckpointError."""
    return _layout(Path(path))[0]


def load_hf_checkpoint(
    path: str | os.PathLike, dtype: str | None = None, compute_dtype: str | None = None
) -> tuple[Transformer, ModelConfig]:
    """Read a local HF checkpoint directory into a Transformer (no random initialisation first).

    dtype: parameter dtype ("float32" / "bfloat16"); None keeps the stored dtype (float16 -> float32).
    compute_dtype: matmul dtype; None means the parameter dtype.
    Raises CheckpointError naming the file and tensor for a missing, unexpected, misshapen or corrupt one.
    """
    directory = Path(path)
    cfg, files, info = _layout(directory)
    entries = _name_map(cfg)

    if dtype is None:
        dtype = "bfloat16" if info[entries[0].hf_name][1] == "BF16" else "float32"
    cfg = dataclasses.replace(cfg, param_dtype=dtype, dtype=compute_dtype or dtype)
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)

    # Abstract module: shapes and dtypes only, so a 7B model never materialises random weights.
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    _check_map_covers(model, entries)
    by_name = {e.hf_name: e for e in entries}
    names = list(by_name) + (["lm_head.weight"] if cfg.tie_embeddings and "lm_head.weight" in files else [])
    embedding = None
    for name, array in _read_tensors(files, names):
        if name not in by_name:  # tied model whose file also stores lm_head.weight: must equal embed
            if embedding is None or array.shape != embedding.shape or not np.array_equal(array, embedding):
                raise CheckpointError(
                    f"config.json says tie_word_embeddings=true but lm_head.weight in {files[name]} differs "
                    "from model.embed_tokens.weight; set tie_word_embeddings=false"
                )
            continue
        if name == "model.embed_tokens.weight" and "lm_head.weight" in names:
            embedding = array  # kept only to check a stored tied lm_head.weight against it
        e = by_name[name]
        array = array.T if e.transpose else array
        array = np.ascontiguousarray(array.astype(target, copy=False))
        _variable(model, e.path).set_value(jnp.asarray(array))
    return model, cfg


# ----------------------------------------------------------------------------------------------------
# Saving


def hf_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named, HF-shaped host arrays (in the stored parameter dtype)."""
    entries = _name_map(model.cfg)
    _check_map_covers(model, entries)
    out = {}
    for e in entries:
        array = np.asarray(_variable(model, e.path).get_value())
        out[e.hf_name] = np.ascontiguousarray(array.T if e.transpose else array)
    return out


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_hf_checkpoint(
    model: Transformer,
    path: str | os.PathLike,
    max_shard_bytes: int | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write ``config.json`` and the weights (``model.safetensors``, or shards + index.json when they
    exceed ``max_shard_bytes``) into ``path``; with ``tokenizer`` (an HFTokenizer, or a directory
    holding tokenizer files), also the tokenizer files. Returns the directory.

    Earlier weight files in ``path`` (model.safetensors, model-*-of-*.safetensors, the index) are
    removed first so that a stale shard can never be mixed into the new checkpoint.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    for old in directory.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(old.name):
            old.unlink()
    _write_json(directory / CONFIG_FILE, config_to_hf(model.cfg))
    metadata = {"format": "pt"}  # transformers refuses safetensors files without this tag

    total = sum(a.nbytes for a in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(directory / SINGLE_FILE), metadata=metadata)
    else:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name, array in tensors.items():  # greedy in name-map order; a huge tensor gets its own shard
            if shards[-1] and size + array.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = array
            size += array.nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        _write_json(directory / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    if tokenizer is not None:
        _save_tokenizer(tokenizer, directory)
    return directory


_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"
)


def _save_tokenizer(tokenizer: Any, directory: Path) -> None:
    if hasattr(tokenizer, "save"):
        tokenizer.save(directory)
        return
    source = Path(tokenizer)
    if not (source / "tokenizer.json").exists():
        raise ValueError(
            f"tokenizer must be an HFTokenizer or a directory with tokenizer.json; {source} has none"
        )
    for name in _TOKENIZER_FILES:
        if (source / name).exists() and source.resolve() != directory.resolve():
            (directory / name).write_bytes((source / name).read_bytes())
