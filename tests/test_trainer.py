"""End-to-end training runs of every task config (shrunk) and SIGTERM; resume after SIGKILLs is
tests/test_run_safety.py's chaos run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ragen_jax.train.checkpoint import Checkpointer
from ragen_jax.train.metrics import read_metrics
from ragen_jax.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "tests", "configs", "small.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "configs"))
from small import get_config as small_config  # noqa: E402

# FrozenLake's run is in the fast selection, so that `pytest` alone exercises the training loop (MI at
# steps 1 and 2, validation at 0 and 3, checkpoints, early-stop bookkeeping, plots).
@pytest.mark.parametrize("task", ["frozen_lake"] + [pytest.param(t, marks=pytest.mark.slow)
                                                    for t in ("sokoban", "countdown", "bandit", "math_qa")])
def test_three_step_run_of_every_task_writes_metrics_checkpoint_and_plots(task, tmp_path):
    config = small_config(task)
    summary = train(config, str(tmp_path))
    assert summary["stop_reason"] == "completed"
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in ("train/success", "rollout/in_group_reward_std", "filter/kept_ratio", "actor/pg_loss",
                "timing/rollout_s", "throughput/generated_tokens_per_s"):
        assert key in rows[1], key
    assert "collapse_trajectory_sample/mi_estimate" in rows[2]  # MI at step 1 and every 2 steps
    assert "val/success" in rows[0] and "val/success" in rows[3]
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 3
    assert os.path.exists(tmp_path / "plots" / "overview.png")
    assert os.path.getsize(tmp_path / "samples.txt") > 0
    # Every jitted program compiled once for the whole run.
    traces = summary["traces"]
    assert traces["rollout"] == 1 and traces["validation_rollout"] == 1 and traces["update"] == 1


def _run_cli(run_dir, *extra, **popen):
    cmd = [sys.executable, "-m", "ragen_jax.main", f"--config={SMALL}:frozen_lake",
           f"--config.run_dir={run_dir}", "--config.trainer.total_steps=4", *extra]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


def _wait_for_step(run_dir, step, proc, timeout=900):
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = read_metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
        if rows and rows[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run exited early ({proc.returncode}): {proc.stdout.read().decode()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def _finished_checkpoints(run_dir) -> list[int]:
    """Steps whose checkpoint is complete (orbax writes into a temporary name and renames when done)."""
    directory = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []


def test_a_sigterm_while_a_step_is_recorded_still_ends_with_the_promised_checkpoint(tmp_path):
    """The signal lands after the step decided not to checkpoint (on_step runs while the step's metrics
    row is written): the run goes on to the next step, checkpoints it and stops there."""
    config = small_config("frozen_lake")
    config.trainer.total_steps, config.trainer.checkpoint_every, config.validation.every = 5, 100, 0
    config.mi.enabled = False

    def on_step(step, metrics):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    summary = train(config, str(tmp_path), on_step=on_step)
    assert summary["stop_reason"] == "preempted"
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    assert _finished_checkpoints(str(tmp_path)) == [2]
    assert signal.getsignal(signal.SIGTERM) == handler  # the guard put the previous handler back


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_exits_zero(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = _run_cli(run_dir, "--config.trainer.total_steps=50", "--config.trainer.checkpoint_every=100")
    _wait_for_step(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=600)[0].decode()
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: checkpoint written" in out
    steps = _finished_checkpoints(run_dir)
    assert len(steps) == 1 and 1 <= steps[0] < 50, (steps, out[-3000:])
    assert read_metrics(run_dir)[-1]["step"] == steps[0]
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    assert ckpt.all_steps() == steps, (ckpt.all_steps(), steps, out[-3000:])
    ckpt.close()


def _cli_error(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "ragen_jax.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    return proc.returncode, lines


def test_bad_key_missing_hf_path_and_unknown_env_fail_fast_with_one_line(tmp_path):
    rc, lines = _cli_error("--config=configs/countdown.py", "--config.trainer.total_step=5")
    assert rc == 2 and lines == ["error: unknown config key 'trainer.total_step'; did you mean 'trainer.total_steps'?"]
    rc, lines = _cli_error("--config=configs/countdown.py", f"--config.model.hf_path={tmp_path}/missing")
    assert rc == 2 and len(lines) == 1 and "does not exist" in lines[0] and "hf_path" in lines[0]
    rc, lines = _cli_error("--config=configs/countdown.py", "--config.env.name=sokobann")
    assert rc == 2 and len(lines) == 1 and "did you mean 'sokoban'" in lines[0]
    rc, lines = _cli_error("--config=configs/nope.py")
    assert rc == 2 and lines == ["error: config file 'configs/nope.py' does not exist"]
    assert not os.path.exists(os.path.join(ROOT, "runs", "sokobann-ppo-seed0"))


def test_config_checks_name_the_fix():
    from ragen_jax.setup.config_check import ConfigError, check_config
    from ragen_jax.models.config import PRESETS

    config = small_config("sokoban")
    config.algorithm.mini_batch_size = 3
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        check_config(config, env_names=["sokoban"], model_presets=PRESETS)
    config = small_config("sokoban")
    config.model.overrides = {"num_layer": 2}
    with pytest.raises(ConfigError, match="did you mean 'num_layers'"):
        check_config(config, env_names=["sokoban"], model_presets=PRESETS)
    config = small_config("sokoban")
    config.filter.top_p_mode = "soft"
    with pytest.raises(ConfigError, match="top_p_mode='soft' is not one of linear, softmax"):
        check_config(config, env_names=["sokoban"], model_presets=PRESETS)
