"""Launchers: the exact gcloud / srun / ssh command lines of --dry-run, argument errors, shellcheck."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(REPO, "launch", "tpu.sh")
GPU = os.path.join(REPO, "launch", "gpu_multinode.sh")

POD = ["--name", "ragen-pod", "--zone", "us-central2-b", "--accelerator-type", "v4-32", "--project", "my-proj"]
FLAGS = "--zone=us-central2-b --project=my-proj"
SSH_ALL = f"gcloud compute tpus tpu-vm ssh ragen-pod {FLAGS} --worker=all"
CREATE = (f"gcloud compute tpus tpu-vm create ragen-pod {FLAGS} --accelerator-type=v4-32 "
          "--version=tpu-ubuntu2204-base")
CLONE = (f"{SSH_ALL} --command='rm -rf ~/ragen_jax && git clone --depth 1 --branch main "
         "https://example.org/ragen_jax.git ~/ragen_jax'")
INSTALL = (f"{SSH_ALL} --command='cd ~/ragen_jax && python3 -m venv .venv && .venv/bin/pip install -q -U pip && "
           ".venv/bin/pip install -q -e \".[tpu]\"'")
TRAIN = ("cd ~/ragen_jax && .venv/bin/python -m ragen_jax.main --config=configs/countdown.py "
         "--config.mesh.distributed=on --config.trainer.total_steps=200")
RUN_FOREGROUND = f"{SSH_ALL} --command='{TRAIN}'"
RUN_DETACHED = (f"{SSH_ALL} --command='mkdir -p ~/ragen_jax/logs && ({TRAIN}) > ~/ragen_jax/logs/train.log 2>&1 "
                "< /dev/null & disown'")
DELETE = f"gcloud compute tpus tpu-vm delete ragen-pod {FLAGS} --quiet"


def dry_run(script: str, *args: str) -> list[str]:
    proc = subprocess.run(["bash", script, *args, "--dry-run"] if "--" not in args else
                          ["bash", script, *args[: args.index("--")], "--dry-run", *args[args.index("--"):]],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_tpu_create_v4_32():
    assert dry_run(TPU, "create", *POD) == [CREATE]
    spot = dry_run(TPU, "create", *POD, "--spot")
    assert spot == [CREATE + " --spot"]


def test_tpu_setup_clones_and_installs_on_every_worker():
    lines = dry_run(TPU, "setup", *POD, "--repo", "https://example.org/ragen_jax.git", "--branch", "main")
    assert lines == [CLONE, INSTALL]


def test_tpu_setup_copy_ships_the_tracked_files():
    lines = dry_run(TPU, "setup", *POD, "--copy")
    archive = "/tmp/ragen-pod-code.tar.gz"
    assert lines == [
        f"git -C {REPO} ls-files -z | tar -C {REPO} --null -T - -czf {archive}",
        f"gcloud compute tpus tpu-vm scp {archive} ragen-pod:/tmp/ {FLAGS} --worker=all",
        f"{SSH_ALL} --command='rm -rf ~/ragen_jax && mkdir -p ~/ragen_jax && tar -C ~/ragen_jax -xzf {archive}'",
        INSTALL,
    ]


def test_tpu_run_logs_delete():
    extra = ("--config", "configs/countdown.py", "--", "--config.trainer.total_steps=200")
    assert dry_run(TPU, "run", *POD, *extra) == [RUN_DETACHED]
    assert dry_run(TPU, "run", *POD, "--foreground", *extra) == [RUN_FOREGROUND]
    assert dry_run(TPU, "logs", *POD, "--log-worker", "2") == [
        f"gcloud compute tpus tpu-vm ssh ragen-pod {FLAGS} --worker=2 "
        "--command='tail -n +1 -F ~/ragen_jax/logs/train.log'"]
    assert dry_run(TPU, "delete", *POD) == [DELETE]


def test_tpu_all_is_create_setup_run_delete():
    lines = dry_run(TPU, "all", *POD, "--repo", "https://example.org/ragen_jax.git", "--branch", "main",
                    "--config", "configs/countdown.py", "--", "--config.trainer.total_steps=200")
    assert lines == [CREATE, CLONE, INSTALL, RUN_FOREGROUND, DELETE]
    kept = dry_run(TPU, "all", *POD, "--keep", "--repo", "https://example.org/ragen_jax.git", "--branch", "main",
                   "--config", "configs/countdown.py", "--", "--config.trainer.total_steps=200")
    assert kept == [CREATE, CLONE, INSTALL, RUN_FOREGROUND]


def test_tpu_extra_arguments_are_quoted_for_the_remote_shell():
    line = dry_run(TPU, "run", *POD, "--foreground", "--", "--config.model.hf_path=/data/my model")[0]
    assert line.endswith("--config.mesh.distributed=on --config.model.hf_path=/data/my\\ model'")


@pytest.mark.parametrize("args, message", [
    (["create", "--zone", "z"], "--name is required"),
    (["create", "--name", "n"], "--zone is required"),
    (["launch", "--name", "n", "--zone", "z"], "unknown subcommand launch"),
    (["create", "--name", "n", "--zone", "z", "--accelerator"], "unknown flag --accelerator"),
])
def test_tpu_errors_name_the_fix(args, message):
    proc = subprocess.run(["bash", TPU, *args, "--dry-run"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_gpu_ssh_sets_coordinator_count_and_id_per_host():
    lines = dry_run(GPU, "ssh", "--hosts", "gpu1,gpu2,gpu3", "--dir", "/shared/ragen_jax", "--port", "2222",
                    "--", "--config.trainer.total_steps=5")
    train = ("cd /shared/ragen_jax && .venv/bin/python -m ragen_jax.main --config=configs/sokoban.py "
             "--config.mesh.distributed=on --config.trainer.total_steps=5")
    assert lines == [
        f"ssh gpu{i + 1} 'export JAX_COORDINATOR_ADDRESS=gpu1:2222 JAX_NUM_PROCESSES=3 JAX_PROCESS_ID={i}; {train}'"
        for i in range(3)
    ]


def test_gpu_slurm_runs_one_task_per_node():
    lines = dry_run(GPU, "slurm", "--nodes", "4", "--dir", "/shared/ragen_jax")
    assert lines == [
        "srun --nodes=4 --ntasks-per-node=1 bash -c 'export JAX_COORDINATOR_ADDRESS=$(scontrol show hostnames "
        "\"$SLURM_JOB_NODELIST\" | head -n 1):12355 JAX_NUM_PROCESSES=4 JAX_PROCESS_ID=$SLURM_PROCID; "
        "cd /shared/ragen_jax && .venv/bin/python -m ragen_jax.main --config=configs/sokoban.py "
        "--config.mesh.distributed=on'"
    ]


def test_gpu_ssh_needs_hosts():
    proc = subprocess.run(["bash", GPU, "ssh", "--dry-run"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--hosts" in proc.stderr


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run([shellcheck, TPU, GPU], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
