"""Multi-host start-up (ragen_jax.parallel.distributed): when to initialise, and two real local JAX processes.

The two-process test runs 2 training steps of a tiny bandit config on a 4-device global mesh (2
processes x 2 CPU devices, gloo collectives, loopback coordinator), saves and restores an orbax
checkpoint from both processes, and checks that both saw the same metrics and only process 0 wrote logs.
"""

from __future__ import annotations

import json
import os

import pytest

from ragen_jax.parallel import distributed
from tests._subprocess import run_processes

JAX_ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}


def test_off_never_initialises():
    assert distributed.plan_initialize("off", JAX_ENV, on_tpu=True) is None


def test_auto_stays_single_process_without_a_cluster():
    assert distributed.plan_initialize("auto", {"HOME": "/root"}, on_tpu=False) is None
    assert distributed.plan_initialize("auto", {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, on_tpu=False) is None


def test_explicit_environment_gives_the_arguments():
    plan = distributed.plan_initialize("auto", JAX_ENV, on_tpu=False)
    assert plan.kwargs() == {"coordinator_address": "10.0.0.2:1234", "num_processes": 4, "process_id": 3}
    assert distributed.plan_initialize("on", JAX_ENV, on_tpu=True).kwargs()["process_id"] == 3


def test_cluster_detection_is_left_to_jax():
    slurm = distributed.plan_initialize("auto", {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}, on_tpu=False)
    assert slurm is not None and slurm.kwargs() == {} and "SLURM" in slurm.reason
    tpu = distributed.plan_initialize("auto", {}, on_tpu=True)
    assert tpu is not None and tpu.kwargs() == {} and "TPU" in tpu.reason
    assert distributed.plan_initialize("auto", {"TPU_WORKER_HOSTNAMES": "a,b"}, on_tpu=False) is not None
    assert distributed.plan_initialize("on", {}, on_tpu=False).kwargs() == {}


@pytest.mark.parametrize("env, message", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"),
    ({**JAX_ENV, "JAX_PROCESS_ID": "4"}, r"must be in \[0, JAX_NUM_PROCESSES=4\)"),
    ({**JAX_ENV, "JAX_NUM_PROCESSES": "two"}, "must be integers"),
    ({**JAX_ENV, "JAX_COORDINATOR_ADDRESS": "10.0.0.2"}, "host:port"),
])
def test_bad_environment_names_the_fix(env, message):
    with pytest.raises(ValueError, match=message):
        distributed.plan_initialize("auto", env, on_tpu=False)


def test_bad_mode_and_single_process_helpers():
    with pytest.raises(ValueError, match="config.mesh.distributed"):
        distributed.plan_initialize("yes", {}, on_tpu=False)
    from configs.base import get_config

    config = get_config()
    config.mesh.distributed = "off"
    assert distributed.maybe_initialize(config, environ=JAX_ENV) is None  # off wins over the environment
    assert distributed.is_main_process()
    assert distributed.process_rows(8) == slice(0, 8)


TWO_PROCESS_SCRIPT = """
import json, os, sys
from ragen_jax.parallel import distributed
plan = distributed.maybe_initialize(None)      # JAX_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID
import jax, jax.numpy as jnp, numpy as np
from ragen_jax.parallel import sharding
from ragen_jax.train.checkpoint import Checkpointer
from ragen_jax.train.metrics import MetricsWriter
from ragen_jax.models.config import PRESETS, ModelConfig
PRESETS["sharding-test"] = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=False, max_position_embeddings=4096)
from configs.bandit import get_config
from ragen_jax.rl.state import TrainState
from ragen_jax.train.loop import build_run

run_dir = os.environ["RUN_DIR"]
c = get_config("ppo")
c.init = "random"  # no supervised warm start for this test model
c.model.preset = "sharding-test"
c.rollout.n_groups, c.rollout.group_size, c.rollout.max_new_tokens = 2, 4, 8
c.algorithm.mini_batch_size, c.algorithm.micro_batch_size = 8, 4
out = {"plan": plan.reason if plan else None, "process": jax.process_index(), "processes": jax.process_count(),
       "devices": jax.device_count(), "local_devices": jax.local_device_count()}
mesh = sharding.make_mesh((2, 2, 1))            # data across the two processes, fsdp within each
run, state = build_run(c)
run, state = sharding.shard_run(run, state, mesh)
writer = MetricsWriter(run_dir, enabled=distributed.is_main_process(), tensorboard=False)
base = jax.random.key(c.seed)
metrics = []
for step in (1, 2):
    k_roll, _, k_upd = jax.random.split(jax.random.fold_in(base, step), 3)
    traj = run.rollout.run(state.actor, k_roll, run.rollout_cfg.train_seeds(step - 1))
    res = run.update_step(state, traj, k_upd)
    state = res.state
    row = {k: float(v) for k, v in res.metrics.items()}
    row["train/success"] = float(np.asarray(traj.success).mean())
    metrics.append(writer.write(step, row))
writer.close()
q = state.actor["layers"][0]["attn"]["q_proj"]["kernel"][...]
out["q_spec"] = str(q.sharding.spec)
out["q_fully_addressable"] = bool(q.is_fully_addressable)

# orbax from every process (checkpoint.py as it is: here each process holds whole leaves, see
# test_nonfinite_check_on_rows_split_over_processes for leaves that it does not).
ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=2)
ckpt.save(2, state.tree(), {"step": 2})
saved = distributed.to_host(state.tree())
tree, meta, step = ckpt.restore(state.tree())
restored = distributed.to_host(tree)
ckpt.close()
out["restored_step"] = step
out["restored_equal"] = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)))
restored_q = TrainState.from_tree(tree).actor["layers"][0]["attn"]["q_proj"]["kernel"][...]
out["restored_q_spec"] = str(restored_q.sharding.spec)
out["actor_checksum"] = float(sum(np.abs(x).sum() for x in jax.tree.leaves(saved["actor"])))
out["metrics"] = metrics
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_agree(tmp_path):
    results = run_processes(TWO_PROCESS_SCRIPT, num_processes=2, devices_per_process=2, timeout=900,
                            env={"RUN_DIR": str(tmp_path)})
    p0, p1 = results
    assert [p0["process"], p1["process"]] == [0, 1]
    assert p0["processes"] == 2 and p0["devices"] == 4 and p0["local_devices"] == 2
    assert p0["plan"] == "JAX_* environment"
    assert p0["q_spec"] == "P('fsdp', None)" and not p0["q_fully_addressable"]  # a global, sharded array
    assert p0["metrics"] == p1["metrics"]  # the same replicated numbers on both processes
    assert p0["actor_checksum"] == p1["actor_checksum"]
    assert p0["metrics"][0]["actor/grad_norm"] > 0
    for p in results:
        assert p["restored_step"] == 2 and p["restored_equal"] and p["restored_q_spec"] == "P('fsdp', None)"
    # Only process 0 wrote the log: one row per step (two writers would have written four).
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["actor/pg_loss"] == pytest.approx(p0["metrics"][1]["actor/pg_loss"])
    assert os.path.isdir(tmp_path / "checkpoints" / "2")


NONFINITE_SCRIPT = """
import json
from ragen_jax.parallel import distributed
distributed.maybe_initialize(None)
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from ragen_jax.parallel import sharding
mesh = sharding.make_mesh((2, 2, 1))
rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))      # each process holds half of the rows
bad = np.ones((4, 3), np.float32)
bad[3, 1] = np.nan                                                   # on the last process's rows
tree = sharding.shard_state({"good": np.ones((4, 3), np.float32), "bad": bad, "step": np.int32(3)},
                            {"good": rows, "bad": rows, "step": sharding.replicated(mesh)})
try:
    np.asarray(tree["bad"])                                          # the naive host-side check
    numpy_check = "ok"
except RuntimeError as err:
    numpy_check = "RuntimeError" if "non-addressable" in str(err) else str(err)
print(json.dumps({"sharded_check": distributed.nonfinite_leaves(tree), "numpy_check": numpy_check}))
"""


def test_nonfinite_check_on_rows_split_over_processes():
    # A leaf split over processes cannot be fetched with np.asarray; distributed.nonfinite_leaves
    # (the check checkpoint.py runs before saving) reduces it on the mesh and finds the NaN on every process.
    for result in run_processes(NONFINITE_SCRIPT, num_processes=2, devices_per_process=2, timeout=300):
        assert result["sharded_check"] == ["['bad']"]
        assert result["numpy_check"] == "RuntimeError"
