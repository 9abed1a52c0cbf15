"""No run is damaged by a later command: config.json, config changes on resume, damaged checkpoints,
exploded updates, metrics after resumes, a full disk and SIGKILLs (trainer.py's module docstring).

One short run (tests/configs/small.py, 2 steps, no validation or MI, so it compiles two programs) is
trained once per module; each test works on a copy of it.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from ragen_jax.train.checkpoint import Checkpointer, CheckpointRestoreError
from ragen_jax.train.loop import build_run, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "tests", "configs", "small.py")
sys.path.insert(0, os.path.join(ROOT, "tests", "configs"))
from small import get_config as small_config  # noqa: E402
from tests._damage import truncate_checkpoint  # noqa: E402

# The CLI flags that give the same config as ``_config()``.
CLI_FLAGS = (f"--config={SMALL}:frozen_lake", "--config.validation.every=0", "--config.mi.enabled=False",
             "--config.trainer.sample_every=1")


def _config(total_steps: int = 2, **trainer):
    c = small_config("frozen_lake")
    c.validation.every = 0
    c.mi.enabled = False
    c.trainer.sample_every = 1
    c.trainer.total_steps = total_steps
    c.trainer.update(trainer)
    return c


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run (checkpoints 1 and 2, metrics rows 1 and 2)."""
    run_dir = str(tmp_path_factory.mktemp("trained") / "run")
    assert train(_config(), run_dir)["stop_reason"] == "completed"
    return run_dir


def _copy(run_dir, tmp_path) -> str:
    out = str(tmp_path / "run")
    shutil.copytree(run_dir, out)
    return out


def _cli(run_dir, *extra, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "ragen_jax.main", *CLI_FLAGS, f"--config.run_dir={run_dir}", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    return proc, errors


def _raw_steps(run_dir) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def _raw_rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _checkpoint_scales(config, run_dir) -> dict[int, float]:
    """{step: largest |actor parameter|} of every checkpoint (each must restore and be finite)."""
    _, state = build_run(config)
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    out = {}
    for step in ckpt.all_steps():
        tree, _, _ = ckpt.restore(state.tree(), step)
        leaves = [np.asarray(x) for x in jax.tree.leaves(tree["actor"])]
        assert all(np.isfinite(x).all() for x in leaves), step
        out[step] = max(float(np.abs(x).max()) for x in leaves)
    ckpt.close()
    return out


def test_a_failing_command_leaves_the_runs_config_json_alone(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    before = open(os.path.join(run_dir, "config.json")).read()
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    proc, errors = _cli(run_dir, f"--config.model.gguf_path={bad}")
    assert proc.returncode == 2 and len(errors) == 1 and "GGUF" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert open(os.path.join(run_dir, "config.json")).read() == before


def test_every_checkpoint_holds_its_config(trained):
    meta, step = Checkpointer(os.path.join(trained, "checkpoints")).newest_meta()
    assert step == 2 and meta["config"]["optim"]["actor_lr"] == _config().optim.actor_lr
    with open(os.path.join(trained, "config.json")) as f:
        assert json.load(f) == meta["config"]


def test_resume_with_a_run_altering_change_is_refused_in_one_line(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    before = open(os.path.join(run_dir, "config.json")).read()
    proc, errors = _cli(run_dir, "--config.optim.actor_lr=0.001", "--config.trainer.total_steps=3")
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "optim.actor_lr" in errors[0] and "allow_config_change" in errors[0]
    assert "trainer.total_steps" not in errors[0]  # extending a run is no change of the run
    assert "Traceback" not in proc.stderr
    assert open(os.path.join(run_dir, "config.json")).read() == before
    assert Checkpointer(os.path.join(run_dir, "checkpoints")).all_steps() == [1, 2]


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(trained, tmp_path, capfd):
    run_dir = _copy(trained, tmp_path)
    truncate_checkpoint(run_dir, 2)
    summary = train(_config(total_steps=3), run_dir)
    out, err = capfd.readouterr()
    warnings = [line for line in err.splitlines() if "does not restore" in line]
    assert len(warnings) == 1 and "step 2" in warnings[0] and "trying step 1" in warnings[0], err[-3000:]
    assert "resuming from checkpoint step 1" in out
    assert summary["stop_reason"] == "completed"
    assert _raw_steps(run_dir) == [1, 2, 3]
    assert Checkpointer(os.path.join(run_dir, "checkpoints")).all_steps() == [1, 2, 3]
    assert os.listdir(os.path.join(run_dir, "checkpoints_damaged"))[0].startswith("2-")


def test_no_checkpoint_restoring_is_one_clear_error(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    truncate_checkpoint(run_dir, 1)
    truncate_checkpoint(run_dir, 2)
    with pytest.raises(CheckpointRestoreError, match="none of the checkpoints"):
        train(_config(total_steps=3), run_dir)
    assert Checkpointer(os.path.join(run_dir, "checkpoints")).all_steps() == [1, 2]  # nothing moved or written


def test_an_exploding_update_never_reaches_a_checkpoint(trained, tmp_path, capfd):
    run_dir = _copy(trained, tmp_path)
    scales = _checkpoint_scales(_config(), run_dir)
    config = _config(total_steps=8, allow_config_change=True)
    config.optim.actor_lr = 1e9  # the first update is finite and blows every weight up to ~1e9
    summary = train(config, run_dir)
    out, err = capfd.readouterr()
    assert "optim.actor_lr" in err and "allow_config_change" in err  # accepted, with a warning
    assert summary["stop_reason"] == "parameter_explosion", out[-2000:]
    assert "early stop at step 3: parameter_explosion" in out
    # Nothing was saved after the explosion; the good checkpoints are untouched.
    assert _checkpoint_scales(_config(), run_dir) == scales
    row = _raw_rows(run_dir)[-1]
    assert row["step"] == 3 and row["checkpoint/param_growth"] > 1e6


def test_skipped_updates_log_nan_and_the_last_good_checkpoint_survives_rotation(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    # No explosion limit: the ruined step-3 weights are saved, then every update is non-finite and skipped.
    config = _config(total_steps=8, allow_config_change=True, max_param_growth=float("inf"))
    config.optim.actor_lr = 1e9
    summary = train(config, run_dir)
    assert summary["stop_reason"] == "nonfinite_updates"
    rows = {r["step"]: r for r in _raw_rows(run_dir)}
    # Step 3's first mini-batch trained (finite, exploding), its second was skipped; then every mini-batch
    # of steps 4 and 5 was skipped: three non-finite steps in a row stop the run.
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        assert rows[step]["actor/nonfinite_skipped"] > 0
    assert rows[3]["actor/nonfinite_skipped"] < rows[3]["update/minibatches_used"]
    assert rows[3]["actor/entropy"] is not None  # an average over the mini-batch that trained
    for step in (4, 5):
        assert rows[step]["actor/nonfinite_skipped"] == rows[step]["update/minibatches_used"]
        for key in ("actor/entropy", "actor/grad_norm", "actor/pg_loss"):
            assert rows[step][key] is None, (step, key)  # NaN in JSON, not a 0 that reads as collapse
    # keep_checkpoints=3 keeps 3, 4, 5; step 2 (whose parameters then trained a finite mini-batch at
    # step 3) is the last good checkpoint and survives the rotation.
    scales = _checkpoint_scales(_config(), run_dir)
    assert sorted(scales) == [2, 3, 4, 5] and scales[2] < 10 and scales[5] > 1e6


def test_metrics_hold_one_row_per_step_after_two_resumes(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    for total in (3, 4):
        # A kill after the metrics row of the last step but before its checkpoint: the run resumes from
        # the step before, and the half-written line of the kill is on the end of the file.
        shutil.rmtree(os.path.join(run_dir, "checkpoints", str(total - 1)))
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write('{"step": 9, "trai')
        assert train(_config(total_steps=total), run_dir)["stop_reason"] == "completed"
    assert _raw_steps(run_dir) == [1, 2, 3, 4]
    with open(os.path.join(run_dir, "samples.txt")) as f:
        headers = [line.split(":")[0] for line in f if line.startswith("===== step ")]
    assert headers == [f"===== step {s}" for s in (1, 1, 2, 2, 3, 3, 4, 4)]


def _mount_tmpfs(directory, megabytes: int, remount: bool = False) -> None:
    os.makedirs(directory, exist_ok=True)
    options = f"remount,size={megabytes}M" if remount else f"size={megabytes}M"
    args = ["mount", "-o", options, str(directory)] if remount else ["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                                                                      str(directory)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_previous_checkpoint_resumes(tmp_path):
    # A checkpoint of this config takes about 2.3 MB: 6 MB hold the first two, the third does not fit, and
    # Checkpointer refuses it before writing (free space below the newest checkpoint's size).
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 6)
    try:
        run_dir = str(disk / "run")
        proc, errors = _cli(run_dir, "--config.trainer.total_steps=4")
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
        assert "no space left on device" in errors[0] and "Traceback" not in proc.stderr
        ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
        steps = ckpt.all_steps()
        assert steps and steps[-1] < 4
        _, state = build_run(_config())
        _, meta, step, damaged = ckpt.restore_newest(state.tree())
        ckpt.close()
        assert step == steps[-1] and damaged == []
        _mount_tmpfs(disk, 64, remount=True)  # space freed
        proc, errors = _cli(run_dir, "--config.trainer.total_steps=4")
        assert proc.returncode == 0 and not errors, proc.stderr[-3000:]
        assert f"resuming from checkpoint step {step}" in proc.stdout
        assert _raw_steps(run_dir) == [1, 2, 3, 4]
        assert Checkpointer(os.path.join(run_dir, "checkpoints")).latest_step() == 4
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow
def test_a_short_chaos_run_equals_the_uninterrupted_one(tmp_path):
    """benchmarks/chaos.py with 3 SIGKILLs (no warm start): final state and metrics bit for bit equal."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import chaos

    out = tmp_path / "chaos.json"
    rc = chaos.main(["--kills", "3", "--steps", "4", "--no-warm-start", "--work", str(tmp_path / "work"),
                     "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, {k: v for k, v in result.items() if k != "kill_log"}
    assert result["kills"] == 3 and result["state_equal"] and result["metrics_equal"] and result["rows_one_per_step"]
