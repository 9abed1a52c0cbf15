"""User errors on the command line exit 2 with one line ``error: <reason naming the fix>``, no traceback.

Each case breaks one thing (a size, a model file, the run directory, the config file, the preset, the
schedule) and must fail before any compilation and before anything is written. The CLI runs in-process
(``ragen_jax.main.main`` with ``sys.argv`` patched): absl keeps its flags in one global registry, so each
call removes the ``--config.*`` override flags that parsing the config file registered, and the next call
can register them again. One case also runs the real entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from absl import flags

from ragen_jax import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = "--config=tests/configs/small.py:frozen_lake"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths in argv are relative to the repository, as in the README


def _reset_flags() -> None:
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()


def run_cli(argv: list[str], capsys, monkeypatch) -> tuple[object, str]:
    """(exit code, stderr) of ``python -m ragen_jax.main *argv``, run in this process."""
    monkeypatch.setattr(sys, "argv", ["ragen_jax.main", *argv])
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as stop:
            cli.main()
    finally:
        _reset_flags()
    return stop.value.code, capsys.readouterr().err


def assert_one_line_error(code, stderr: str, words: tuple[str, ...]) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


# ------------------------------------------------------------------------------------------- files


def _hf_checkpoint(directory: Path) -> Path:
    """A valid 1-layer Qwen2 checkpoint with a tokenizer (so only the damage made by a case can fail)."""
    import tokenizers
    from flax import nnx

    from ragen_jax.models.config import ModelConfig
    from ragen_jax.models.hf_io import save_hf_checkpoint
    from ragen_jax.models.transformer import Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, tie_embeddings=True, qkv_bias=True, architecture="qwen2")
    save_hf_checkpoint(Transformer(cfg, rngs=nnx.Rngs(0)), directory)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_end|>"])  # the end-of-turn token generation stops at
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _gguf_file(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(64)
    writer.add_head_count(1)
    writer.add_block_count(0)
    writer.add_feed_forward_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _read_only_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "read_only"
    directory.mkdir()
    directory.chmod(0o555)
    if os.access(directory, os.W_OK):  # root ignores permission bits; a read-only mount still refuses it
        directory = Path("/proc/sys")
        if not directory.is_dir() or os.access(directory, os.W_OK):
            pytest.skip("running as root with no read-only directory to point run_dir at")
    return directory


# ------------------------------------------------------------------------------------------- cases


def _mini_batch(tmp):
    return [SMALL, f"--config.run_dir={tmp}/run", "--config.rollout.n_groups=2", "--config.rollout.group_size=4",
            "--config.algorithm.mini_batch_size=3", "--config.algorithm.micro_batch_size=1"]


def _hf_invalid_json(tmp):
    ckpt = _hf_checkpoint(tmp / "ckpt")
    (ckpt / "config.json").write_text('{"model_type": "qwen2",')
    return [SMALL, f"--config.run_dir={tmp}/run", f"--config.model.hf_path={ckpt}"]


def _hf_missing_field(tmp):
    ckpt = _hf_checkpoint(tmp / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    del config["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    return [SMALL, f"--config.run_dir={tmp}/run", f"--config.model.hf_path={ckpt}"]


def _truncated_safetensors(tmp):
    ckpt = _hf_checkpoint(tmp / "ckpt")
    _truncate(ckpt / "model.safetensors")
    return [SMALL, f"--config.run_dir={tmp}/run", f"--config.model.hf_path={ckpt}"]


def _truncated_gguf(tmp):
    file = _gguf_file(tmp / "model.gguf")
    _truncate(file, keep=0.6)
    return [SMALL, f"--config.run_dir={tmp}/run", f"--config.model.gguf_path={file}"]


def _gguf_directory(tmp):
    (tmp / "models").mkdir()
    _gguf_file(tmp / "models" / "model.gguf")
    return [SMALL, f"--config.run_dir={tmp}/run", f"--config.model.gguf_path={tmp}/models"]


def _run_dir_file(tmp):
    (tmp / "taken").write_text("not a directory")
    return [SMALL, f"--config.run_dir={tmp}/taken"]


def _run_dir_read_only(tmp):
    return [SMALL, f"--config.run_dir={_read_only_dir(tmp)}/run"]


def _config_file(tmp, text: str) -> str:
    (tmp / "task.py").write_text(text)
    return f"--config={tmp}/task.py"


def _syntax_error(tmp):
    return [_config_file(tmp, "def get_config(:\n    pass\n")]


def _raises_on_import(tmp):
    return [_config_file(tmp, "import ml_collections\nSTEPS = undefined_name\n")]


def _no_get_config(tmp):
    return [_config_file(tmp, "import ml_collections\nCONFIG = ml_collections.ConfigDict()\n")]


def _unknown_preset(tmp):
    return ["--config=configs/sokoban.py:ppx", f"--config.run_dir={tmp}/run"]


def _zero_steps(tmp):
    # Without validation a 0-step run has no metrics, and plotting them used to crash the run.
    return [SMALL, f"--config.run_dir={tmp}/run", "--config.trainer.total_steps=0", "--config.validation.every=0"]


CASES = {
    "mini_batch_not_dividing_batch": (_mini_batch, ("mini_batch_size (3)", "must divide", "(8)", "=2")),
    "hf_config_invalid_json": (_hf_invalid_json, ("hf_path", "config.json", "not valid JSON")),
    "hf_config_missing_field": (_hf_missing_field, ("hf_path", "config.json", "'hidden_size'")),
    "truncated_safetensors": (_truncated_safetensors, ("hf_path", "model.safetensors", "truncated")),
    "truncated_gguf": (_truncated_gguf, ("gguf_path", "model.gguf", "truncated")),
    "gguf_path_is_directory": (_gguf_directory, ("gguf_path", "is a directory", "expected a .gguf file",
                                                 "model.gguf")),
    "run_dir_is_file": (_run_dir_file, ("config.run_dir", "taken", "is a file")),
    "run_dir_read_only": (_run_dir_read_only, ("config.run_dir", "not writable")),
    "config_syntax_error": (_syntax_error, ("task.py: line 1: SyntaxError",)),
    "config_raises_on_import": (_raises_on_import, ("task.py: line 2: NameError", "undefined_name")),
    "config_without_get_config": (_no_get_config, ("task.py", "defines no get_config()",)),
    "unknown_algorithm_preset": (_unknown_preset, ("unknown algorithm preset 'ppx'", "grpo", "dapo")),
    "zero_total_steps": (_zero_steps, ("total_steps=0", "must be >= 1", "mode=eval")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_error_is_one_line_exit_2(case, tmp_path, capsys, monkeypatch):
    make_argv, words = CASES[case]
    code, stderr = run_cli(make_argv(tmp_path), capsys, monkeypatch)
    assert_one_line_error(code, stderr, words)
    assert not (tmp_path / "run").exists()  # nothing written before the check


def test_valid_files_pass_the_checks(tmp_path):
    """The checks above reject only the damage: the intact checkpoint and run directory pass."""
    from ragen_jax.setup.config_check import check_config
    from ragen_jax.models.config import PRESETS
    from ragen_jax.setup.build import build_tokenizer

    config = cli.load_config_file("tests/configs/small.py:frozen_lake")
    config.model.hf_path = str(_hf_checkpoint(tmp_path / "ckpt"))
    config.run_dir = str(tmp_path / "new" / "run")
    check_config(config, env_names=["frozen_lake"], model_presets=PRESETS)
    assert build_tokenizer(config).vocab_size == 64
    config.model.hf_path = ""
    config.mode, config.trainer.total_steps = "eval", 0  # eval does not train: 0 steps is fine there
    check_config(config, env_names=["frozen_lake"], model_presets=PRESETS)


def test_a_bug_keeps_its_traceback(capsys, monkeypatch, tmp_path):
    """Only user errors become one line: any other exception propagates."""
    def bug(*args, **kwargs):
        raise RuntimeError("a bug in the checks")

    monkeypatch.setattr(cli, "check_config", bug)
    monkeypatch.setattr(sys, "argv", ["ragen_jax.main", SMALL, f"--config.run_dir={tmp_path}/run"])
    try:
        with pytest.raises(RuntimeError, match="a bug in the checks"):
            cli.main()
    finally:
        _reset_flags()


def test_real_entry_point_prints_one_line():
    """The same through ``python -m ragen_jax.main`` (this case fails before JAX is imported: ~1 s)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "ragen_jax.main", "--config=configs/sokoban.py:ppx"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, ("unknown algorithm preset 'ppx'",))
