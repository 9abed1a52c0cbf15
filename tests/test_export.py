"""``ragen_jax.export``: a run's checkpoint -> a Hugging Face directory that ``transformers`` loads.

The run is the test suite's shrunk FrozenLake config (tiny preset cut to 2 layers, d=64, PPO with a
critic). Its checkpoints are written the way ``trainer.train`` writes them (``build_run``, the state
placed on the mesh with ``sharding.shard_run``, ``Checkpointer.save(step, TrainState.tree(), meta)``),
with the actor moved away from its initial weights, so that no training program has to compile here;
tests/models/test_smollm2_train.py exports the checkpoint of a real two-step ``train`` run.
The reference for the logits is ``transformers``' own Qwen2ForCausalLM on the exported files.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
import tokenizers
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ragen_jax.parallel import sharding  # noqa: E402
from ragen_jax.train.checkpoint import Checkpointer  # noqa: E402
from ragen_jax.export import ExportError, export_hf, main, restore_policy  # noqa: E402
from ragen_jax.models.config import get_preset  # noqa: E402
from ragen_jax.models.hf_io import save_hf_checkpoint  # noqa: E402
from ragen_jax.models.hf_tokenizer import HFTokenizer  # noqa: E402
from ragen_jax.models.transformer import Transformer  # noqa: E402
from ragen_jax.train.loop import build_run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "configs"))
from small import get_config as small_config  # noqa: E402
from tests._damage import truncate_checkpoint  # noqa: E402

STEPS = (1, 2)


def _moved(params, seed: int):
    """params + 0.02 * N(0, 1) noise, leaf by leaf (a stand-in for training updates)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.02 * jax.random.normal(k, x.shape, x.dtype)
                                        for x, k in zip(leaves, keys)])


def _write_run(directory, config) -> tuple[dict, object]:
    """config.json (as ragen_jax.main writes it) and checkpoints at STEPS (as trainer.train saves them)
    in ``directory``; returns ({step: actor params saved at that step}, actor graphdef)."""
    config.run_dir = str(directory)
    (directory / "config.json").write_text(config.to_json(indent=2) + "\n")
    run, state = build_run(config)
    run, state = sharding.shard_run(run, state, sharding.make_mesh(config))
    ckpt = Checkpointer(str(directory / "checkpoints"), keep=config.trainer.keep_checkpoints)
    saved = {}
    for step in STEPS:
        state = state.replace(actor=_moved(state.actor, step))
        ckpt.save(step, state.tree(), {"step": step, "early_stop": {}, "seed_counter": step})
        saved[step] = jax.tree.map(np.asarray, state.actor)
    ckpt.close()
    assert state.critic is not None and state.actor_opt is not None  # a full PPO TrainState was saved
    return saved, run.actor_graphdef


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny-preset run (character tokenizer): (run_dir, {step: saved actor params}, actor graphdef)."""
    directory = tmp_path_factory.mktemp("run")
    saved, graphdef = _write_run(directory, small_config("frozen_lake"))
    return str(directory), saved, graphdef


def _logits_match_transformers(out_dir: str, graphdef, params, vocab: int, architecture: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, 12), 0, vocab), np.int32)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    model = nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, params))
    ours, _ = model(tokens, np.ones(tokens.shape, bool))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-4)


def test_restore_reads_the_actor_of_each_checkpoint(run_dir):
    directory, saved, _ = run_dir
    for step in (None, *STEPS):
        policy = restore_policy(directory, step)
        expected = saved[step or STEPS[-1]]
        assert policy.step == (step or STEPS[-1])
        got = jax.tree.leaves(nnx.state(policy.model))
        assert len(got) == len(jax.tree.leaves(expected))
        for a, b in zip(got, jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_cli_export_loads_in_transformers_with_equal_logits(run_dir, tmp_path, capsys):
    directory, saved, graphdef = run_dir
    out = tmp_path / "hf"
    assert main([directory, str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"exported step {STEPS[-1]}" in printed and "CharTokenizer" in printed
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # the char tokenizer has no files
    _logits_match_transformers(str(out), graphdef, saved[STEPS[-1]], 264, "Qwen2ForCausalLM")


def test_export_of_an_hf_path_run_carries_its_tokenizer(tmp_path_factory):
    """A run started from a local HF directory (model.hf_path, Llama layout, byte-level BPE tokenizer)."""
    source = tmp_path_factory.mktemp("hf_source")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["<think> go right </think><answer> Right || Up </answer> FrozenLake"] * 8, trainer)
    tok.save(str(source / "tokenizer.json"))
    cfg = get_preset("tiny", vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=16, qkv_bias=False, architecture="llama")
    save_hf_checkpoint(Transformer(cfg, rngs=nnx.Rngs(0)), source, tokenizer=HFTokenizer(source))

    config = small_config("frozen_lake")
    config.model.hf_path = str(source)
    config.model.tokenizer = "hf"
    config.model.overrides = {}
    directory = tmp_path_factory.mktemp("hf_run")
    saved, graphdef = _write_run(directory, config)
    out = export_hf(str(directory), str(directory / "exported"), verbose=False)
    assert (source / "tokenizer.json").read_bytes() == (directory / "exported" / "tokenizer.json").read_bytes()
    exported_tok, source_tok = HFTokenizer(out), HFTokenizer(source)
    assert (exported_tok.pad_id, exported_tok.eos_ids) == (source_tok.pad_id, source_tok.eos_ids)
    _logits_match_transformers(out, graphdef, saved[STEPS[-1]], 320, "LlamaForCausalLM")


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(run_dir, tmp_path, capsys):
    directory, saved, _ = run_dir
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    truncate_checkpoint(copy, STEPS[-1])
    policy = restore_policy(str(copy))
    assert policy.step == STEPS[-2]
    for a, b in zip(jax.tree.leaves(nnx.state(policy.model)), jax.tree.leaves(saved[STEPS[-2]])):
        np.testing.assert_array_equal(np.asarray(a), b)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"step {STEPS[-1]}" in warnings[0]
    for step in STEPS[:-1]:
        truncate_checkpoint(copy, step)
    with pytest.raises(ExportError) as e:
        restore_policy(str(copy))
    assert "restores" in str(e.value) and "\n" not in str(e.value)


def test_export_of_an_earlier_step(run_dir, tmp_path):
    directory, saved, _ = run_dir
    from safetensors.numpy import load_file

    out = export_hf(directory, str(tmp_path / "step1"), step=1, verbose=False)
    embed = load_file(os.path.join(out, "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(embed, saved[1]["embed"]["embedding"])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 2


def test_export_never_builds_the_warm_start(run_dir, tmp_path, monkeypatch):
    """A run with init=sft: the checkpoint holds the actor, so the warm start is neither built nor read."""
    import shutil

    import ragen_jax.sft.warm_start

    directory, saved, _ = run_dir
    copy = tmp_path / "sft_run"
    shutil.copytree(directory, copy)
    config = json.loads((copy / "config.json").read_text())
    config["init"] = "sft"
    (copy / "config.json").write_text(json.dumps(config))

    def refuse(*args, **kwargs):
        raise AssertionError("export must not build or load the supervised warm start")

    monkeypatch.setattr(ragen_jax.sft.warm_start, "build_warm_start", refuse)
    monkeypatch.setattr(ragen_jax.sft.warm_start, "load_warm_start", refuse)
    policy = restore_policy(str(copy))
    np.testing.assert_array_equal(np.asarray(policy.model.embed.embedding.get_value()),
                                  saved[STEPS[-1]]["embed"]["embedding"])


def test_errors_name_the_fix(run_dir, tmp_path, capsys):
    directory, _, _ = run_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError, match="config.json not found"):
        export_hf(str(empty), str(tmp_path / "a"))
    with open(os.path.join(directory, "config.json")) as f:
        (empty / "config.json").write_text(f.read())  # a run that never reached a checkpoint
    with pytest.raises(ExportError, match="train at least one step"):
        export_hf(str(empty), str(tmp_path / "b"))
    with pytest.raises(ExportError, match=r"no checkpoint for step 7 .* available steps: \[1, 2\]"):
        export_hf(directory, str(tmp_path / "c"), step=7)

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty; choose an empty OUT_DIR or pass --overwrite"):
        export_hf(directory, str(busy))
    assert main([directory, str(busy)]) == 2
    assert "error:" in capsys.readouterr().err
    assert main([directory, str(busy), "--overwrite"]) == 0
    assert (busy / "model.safetensors").exists() and (busy / "notes.txt").exists()
