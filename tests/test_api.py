"""The Python API (ragen_jax/api.py): the README's "Use from Python" block runs as written (on a
test-sized config), load_config refuses bad input in one line, and the API turns on the config's
compilation cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from ragen_jax import api
from ragen_jax.setup.config_check import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "tests", "configs", "small.py")


def readme_python_block() -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Use from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_block_runs(tmp_path, monkeypatch, capsys):
    # Task configs shrunk to test size: the README's lines, unchanged, on tests/configs/small.py's
    # version of each task (2 layers, 2 x 2 episodes), and at most 2 training steps.
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "frozen_lake.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('_small', {SMALL!r})\n"
        "small = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(small)\n\n\n"
        "def get_config(algorithm=''):\n    return small.get_config('frozen_lake')\n")
    monkeypatch.setattr(api, "CONFIG_DIR", configs)
    load = api.load_config

    def load_small(task, overrides=None, *, preset=""):
        overrides = dict(overrides or {}, **{"trainer.total_steps": 2, "validation.every": 2})
        return load(task, overrides)

    monkeypatch.setattr(api, "load_config", load_small)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(readme_python_block(), namespace)

    assert namespace["summary"]["stop_reason"] == "completed"
    assert len(namespace["curve"]) == 3  # step 0 (validation before training), 1, 2
    assert namespace["curve"][0] is None and all(0.0 <= v <= 1.0 for v in namespace["curve"][1:])
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "fl" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    policy, scores = namespace["policy"], namespace["scores"]
    assert policy.step == 2
    m, n = scores.log_prob.shape
    assert scores.true_col.shape == (m,) and scores.col_valid.shape == (n,)
    assert np.all(np.isfinite(scores.log_prob[scores.row_valid][:, scores.col_valid]))
    assert np.isfinite(scores.metrics["mi_estimate"])
    assert (tmp_path / "exported" / "fl" / "config.json").is_file()
    out = capsys.readouterr().out
    assert "<think>" in out or "Assistant" in out or len(out.splitlines()) > 3

    # The same run read as an init="sft" run from elsewhere: its checkpoint replaces every parameter, so
    # the warm start is neither loaded nor built (here sft.cache_dir points at no cache at all).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    as_sft = load_small("frozen_lake", {"run_dir": str(tmp_path / "runs" / "fl"), "init": "sft"})
    reread = api.load_policy(as_sft)
    assert reread.step == 2 and not (elsewhere / "runs").exists()
    for a, b in zip(jax.tree.leaves(policy.state.actor), jax.tree.leaves(reread.state.actor)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_config_applies_overrides_and_presets():
    config = api.load_config(SMALL, {"trainer.total_steps": 7, "rollout.temperature": 0.5}, preset="sokoban")
    assert config.env.name == "sokoban" and config.trainer.total_steps == 7 and config.rollout.temperature == 0.5
    assert api.load_config("countdown", preset="ppo").algorithm.name == "ppo"
    rloo = api.load_config("countdown", preset="rloo").algorithm
    assert (rloo.name, rloo.adv_estimator) == ("rloo", "rloo")
    bandit = api.load_config("bandit")  # RLOO unless a preset is named
    assert bandit.algorithm.adv_estimator == "rloo"
    assert api.load_config("bandit", preset="grpo").algorithm.adv_estimator == "grpo"


@pytest.mark.parametrize("task, overrides, preset, words", [
    ("chess", None, "", "no config file for task 'chess'"),
    ("countdown", {"trainer.total_step": 3}, "", "unknown config key 'trainer.total_step'"),
    ("countdown", {"nosuch.key": 3}, "", "unknown config key 'nosuch.key'"),
    ("countdown", {"trainer.total_steps": "many"}, "", "trainer.total_steps"),
    ("countdown", {"trainer.total_steps": 0}, "", "total_steps"),
    ("countdown", {"algorithm.name": "ppo"}, "", "preset="),
    ("countdown", None, "sarsa", "sarsa"),
])
def test_load_config_refuses_bad_input_in_one_line(task, overrides, preset, words):
    with pytest.raises(ConfigError) as e:
        api.load_config(task, overrides, preset=preset)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_api_writes_the_configs_compilation_cache(tmp_path):
    """A notebook calls the API, not the CLI: load_policy + a rollout in a fresh interpreter (no
    $JAX_COMPILATION_CACHE_DIR) write their programs to the config's compile_cache.dir."""
    cache = tmp_path / "cache"
    script = f"""
from ragen_jax import api
config = api.load_config({SMALL!r}, {{"compile_cache.dir": {str(cache)!r}, "compile_cache.min_compile_time_secs": 0.0,
                                      "run_dir": {str(tmp_path / 'run')!r}}})
api.sample_conversations(api.load_policy(config), n=1)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert cache.is_dir() and len(os.listdir(cache)) > 0
