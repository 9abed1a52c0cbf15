"""Training on a plain-Python host env (HOST_REGISTRY + rollout.mode=host): config checks, a 2-step run
whose metrics count the host errors, and the command line."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import ml_collections
import pytest

from _host_envs import GuessNumber
from ragen_jax.models.config import PRESETS
from ragen_jax.setup.config_check import ConfigError, check_config
from ragen_jax.train.loop import train
from ragen_jax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "configs", "host_guess.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "configs"))
from host_guess import get_config  # noqa: E402

ENVS = ["frozen_lake", "sokoban"]
HOST = {"guess_number": GuessNumber}


def check(config):
    check_config(config, env_names=ENVS, model_presets=PRESETS, host_envs=HOST)


@pytest.mark.parametrize("change, message", [
    ({"rollout.mode": "fused"}, "host environment .* runs with --config.rollout.mode=host, not fused"),
    ({"env.name": "guess_nuber"}, "did you mean 'guess_number'"),
    ({"rollout.max_user_tokens": 0}, "needs config.rollout.max_user_tokens >= 1"),
    ({"env.params": ml_collections.ConfigDict({"hihg": 5})}, "takes no parameter 'hihg'; did you mean 'high'"),
    ({"init": "sft"}, "no solver demonstrations"),
    ({"rollout.host_workers": -1}, "host_workers=-1 must be >= 0"),
    ({"rollout.host_step_timeout_s": 0.0}, "host_step_timeout_s=0.0 must be > 0"),
])
def test_config_check_names_the_fix(change, message, tmp_path):
    config = get_config()
    config.run_dir = str(tmp_path)
    check(config)
    for key, value in change.items():
        parent, leaf = key.rsplit(".", 1) if "." in key else ("", key)
        node = config[parent] if parent else config
        node[leaf] = value
    with pytest.raises(ConfigError, match=message) as e:
        check(config)
    assert "\n" not in str(e.value)


def test_two_step_run_counts_host_errors_and_closes_its_workers(tmp_path):
    config = get_config(workers="2")
    # MI reads the same Trajectories fields either way (fused == host-stepped: test_host_pool.py); its
    # compile is half of this test's time, test_trainer.py runs it.
    config.mi.enabled = False
    summary = train(config, str(tmp_path))
    assert summary["stop_reason"] == "completed"
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Step 1's first group (seed 10000, 2 samples) raises in its first step; step 2 has no error.
    assert rows[1]["rollout/host_errors"] == 2 and rows[1]["rollout/host_errors/exception"] == 2
    assert rows[2]["rollout/host_errors"] == 0 and rows[2]["rollout/host_errors/timeout"] == 0
    assert rows[0]["val/host_errors"] == 0 and "val/success" in rows[2]
    for key in ("actor/pg_loss", "filter/kept_ratio", "train/success"):
        assert key in rows[1], key
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("host-env-worker")]


@pytest.mark.slow  # a fresh interpreter compiles everything again: about a minute on 2 cores
def test_command_line_trains_a_host_env(tmp_path):
    cmd = [sys.executable, "-m", "ragen_jax.main", f"--config={CONFIG}", f"--config.run_dir={tmp_path}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(str(tmp_path))
    assert rows[1]["rollout/host_errors"] == 2
    bad = subprocess.run(cmd + ["--config.rollout.mode=fused"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: env 'guess_number'")


def test_unknown_name_suggests_a_host_env():
    config = get_config()
    config.env.name = "guess_numbr"
    with pytest.raises(ConfigError, match="known: frozen_lake, guess_number, sokoban; did you mean 'guess_number'"):
        check(config)


@pytest.mark.slow  # a CLI run to its first step: about a minute on 2 cores
def test_sigterm_checkpoints_and_stops_the_workers(tmp_path):
    import signal
    import time

    from ragen_jax.train.checkpoint import Checkpointer

    cmd = [sys.executable, "-m", "ragen_jax.main", f"--config={CONFIG}", f"--config.run_dir={tmp_path}",
           "--config.trainer.total_steps=1000", "--config.trainer.checkpoint_every=1000", "--config.mi.enabled=False"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(read_metrics(str(tmp_path))) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-3000:]
        time.sleep(0.5)
    workers = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
    pids = [int(p) for p in workers.stdout.split()]
    assert len(pids) >= 2  # the pool's workers (the spawn resource tracker may be one more)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out.decode()[-3000:]
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() >= 1
    time.sleep(1.0)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read()]
    assert not alive, alive
