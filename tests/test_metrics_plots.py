import os
import time

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


def _tensorboard_series(tb_dir: str, tag: str) -> dict[int, list[float]]:
    """{step: values} of ``tag`` as TensorBoard shows it (a step written twice is drawn twice): event files in write order, each TFRecord
    (u64 length, u32 crc, payload, u32 crc) an Event; a SessionLog START at step s drops the earlier
    values of steps >= s (TensorBoard's purge of a restarted run)."""
    import struct

    from tensorboardX.proto import event_pb2

    series: dict[int, list[float]] = {}
    for name in sorted(os.listdir(tb_dir)):  # events.out.tfevents.<unix time>.<host>
        data = open(os.path.join(tb_dir, name), "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                series = {s: v for s, v in series.items() if s < event.step}
            for value in event.summary.value:
                if value.tag == tag:
                    series.setdefault(event.step, []).append(value.simple_value)
    return series


def test_a_resumed_writer_replaces_the_repeated_steps_in_tensorboard(tmp_path):
    run = str(tmp_path / "run")
    w = MetricsWriter(run, first_step=0)
    for step in range(0, 5):
        w.write(step, {"a": float(step)})
    w.close()
    started = int(time.time())
    while int(time.time()) == started:  # an event file is named by the second it was opened in
        time.sleep(0.05)
    w = MetricsWriter(run, first_step=3)  # resumed from the checkpoint of step 2
    for step in (3, 4, 5):
        w.write(step, {"a": 10.0 * step})
    w.close()
    assert _tensorboard_series(os.path.join(run, "tb"), "a") == {0: [0.0], 1: [1.0], 2: [2.0], 3: [30.0], 4: [40.0],
                                                                  5: [50.0]}


def test_the_trainer_does_not_import_pytorch():
    """tensorboardX's writer imports PyTorch whenever it is installed (about 0.4 GB resident); the
    trainer's modules import tensorboardX without it, and a process that imported torch itself keeps it."""
    import subprocess
    import sys

    script = ("import sys, importlib.util, ragen_jax.main, ragen_jax.api, ragen_jax.train.metrics as m; "
              "print(m.SummaryWriter is not None, any(k.split('.')[0] == 'torch' for k in sys.modules), "
              "importlib.util.find_spec('torch') is not None)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    writer, imported, installed = out.stdout.split()
    assert writer == "True" and imported == "False", out.stdout
    if installed == "True":
        script = "import torch, ragen_jax.train.metrics as m; print(m.SummaryWriter is not None, 'torch' in __import__('sys').modules)"
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
        assert out.stdout.split() == ["True", "True"], out.stdout
