import os

import numpy as np
import pytest

from ragen_jax.train import plots
from ragen_jax.train.metrics import MetricsWriter, Progress, read_metrics


def test_jsonl_tensorboard_samples_and_plots(tmp_path):
    run = str(tmp_path / "run")
    w = MetricsWriter(run)
    for step in range(1, 5):
        w.write(step, {"val/success": np.float32(step / 10), "rollout/in_group_reward_std": step * 1.0,
                       "collapse_trajectory/mi_estimate": 0.5, "actor/entropy": float("nan"),
                       "vector/ignored": np.ones(3)})
    w.write_text(2, "sample 0", "Turn 1:\nState: ...")
    w.close()
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["val/success"] == pytest.approx(0.3) and rows[0]["actor/entropy"] is None
    assert "vector/ignored" not in rows[0]
    assert os.listdir(os.path.join(run, "tb"))
    assert "step 2: sample 0" in open(os.path.join(run, "samples.txt")).read()
    paths = plots.make_plots(run)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["mi_estimate.png", "overview.png", "reward_std.png", "success.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_resumed_steps_replace_earlier_rows_and_disabled_writer_writes_nothing(tmp_path):
    run = str(tmp_path / "run")
    w = MetricsWriter(run)
    w.write(1, {"a": 1.0}); w.write(2, {"a": 2.0}); w.write(2, {"a": 5.0}); w.close()
    assert [r["a"] for r in read_metrics(run)] == [1.0, 5.0]
    other = str(tmp_path / "other")
    MetricsWriter(other, enabled=False).write(1, {"a": 1.0})
    assert not os.path.exists(other)


def test_plots_cli_errors_clearly_without_metrics(tmp_path, capsys):
    assert plots.main(["plots", str(tmp_path)]) == 1
    assert "no metrics" in capsys.readouterr().err


def test_progress_line_shows_step_eta_and_keys():
    line = Progress(10, keys=("val/success",), enabled=False).update(3, {"val/success": 0.25})
    assert line.startswith("step 3/10") and "success=0.25" in line and "eta" in line
