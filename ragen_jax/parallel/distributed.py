"""Multi-host start-up and per-host data: the same program runs on every host (JAX multi-controller).

    from ragen_jax.parallel import distributed
    distributed.maybe_initialize(config)          # first thing, before any other JAX call
    mesh = sharding.make_mesh(config)             # over the devices of all processes
    ...
    writer = MetricsWriter(run_dir, enabled=distributed.is_main_process())

When to call ``jax.distributed.initialize`` (``config.mesh.distributed``):
  off   never (one process, whatever the environment says);
  on    always: explicit coordinator from the environment when given (below), otherwise JAX's own
        cluster detection (Cloud TPU pods, SLURM, Open MPI, Kubernetes);
  auto  when the environment asks for it: JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID
        (launch/gpu_multinode.sh, tests), a SLURM step with more than one task, or a Cloud TPU VM
        (TPU devices present: /dev/accel* or /dev/vfio/<n>, or the TPU_WORKER_* variables). On a
        single-host TPU VM this gives one process, which is harmless.
Nothing else needs to change for several hosts: orbax coordinates checkpoint writes across processes
(every process calls save/restore), and only process 0 writes metrics, plots and progress.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ragen_jax.parallel.sharding import batch_spec

MODES = ("auto", "on", "off")
ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
TPU_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE", "CLOUD_TPU_TASK_ID")


@dataclasses.dataclass(frozen=True)
class InitPlan:
    """How to call ``jax.distributed.initialize``: explicit arguments, or None each for JAX's detection."""

    reason: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in (("coordinator_address", self.coordinator_address),
                                  ("num_processes", self.num_processes), ("process_id", self.process_id))
                if v is not None}


def tpu_present() -> bool:
    """A Cloud TPU VM: TPU device files (v2-v4: /dev/accel*, v5+: /dev/vfio/<n>)."""
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _explicit(environ: Mapping[str, str]) -> InitPlan | None:
    given = [k for k in (ENV_ADDRESS, ENV_COUNT, ENV_ID) if environ.get(k)]
    if not given:
        return None
    if len(given) != 3:
        missing = sorted({ENV_ADDRESS, ENV_COUNT, ENV_ID} - set(given))
        raise ValueError(f"{', '.join(given)} set but {', '.join(missing)} missing: set all three "
                         "(coordinator host:port, number of processes, this process's id) or none")
    try:
        count, pid = int(environ[ENV_COUNT]), int(environ[ENV_ID])
    except ValueError as err:
        raise ValueError(f"{ENV_COUNT} and {ENV_ID} must be integers; got {environ[ENV_COUNT]!r}, "
                         f"{environ[ENV_ID]!r}") from err
    if not 0 <= pid < count:
        raise ValueError(f"{ENV_ID}={pid} must be in [0, {ENV_COUNT}={count})")
    if ":" not in environ[ENV_ADDRESS]:
        raise ValueError(f"{ENV_ADDRESS}={environ[ENV_ADDRESS]!r} must be host:port (e.g. 10.0.0.2:12355)")
    return InitPlan("JAX_* environment", environ[ENV_ADDRESS], count, pid)


def plan_initialize(mode: str, environ: Mapping[str, str], on_tpu: bool) -> InitPlan | None:
    """The decision of ``maybe_initialize`` as data (None = stay single-process). Pure: tests call it."""
    if mode not in MODES:
        raise ValueError(f"config.mesh.distributed must be one of {MODES}; got {mode!r}")
    if mode == "off":
        return None
    explicit = _explicit(environ)
    if explicit is not None:
        return explicit
    if mode == "on":
        return InitPlan("mesh.distributed='on' (JAX cluster auto-detection)")
    if int(environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in environ:
        return InitPlan("SLURM step with several tasks")
    if on_tpu or any(environ.get(k) for k in TPU_ENV):
        return InitPlan("Cloud TPU VM")
    return None


def maybe_initialize(config: Any = None, environ: Mapping[str, str] | None = None) -> InitPlan | None:
    """Call ``jax.distributed.initialize`` when ``config.mesh.distributed`` and the environment ask for it.

    Must run before anything touches JAX's devices. Idempotent (returns None when already initialised).
    Returns the plan it followed, or None when the run stays single-process.
    """
    mode = "auto"
    if config is not None:
        mesh_cfg = config.mesh if hasattr(config, "mesh") else config
        mode = str(mesh_cfg.get("distributed", "auto") if hasattr(mesh_cfg, "get") else mesh_cfg.distributed)
    environ = os.environ if environ is None else environ
    plan = plan_initialize(mode, environ, tpu_present())
    if plan is None or jax.distributed.is_initialized():
        return None
    jax.distributed.initialize(**plan.kwargs())
    return plan


def is_main_process() -> bool:
    """Process 0 writes logs, plots, sample texts and progress; every process saves checkpoints."""
    return jax.process_index() == 0


def process_rows(global_rows: int) -> slice:
    """The rows [start, stop) this process owns when ``global_rows`` split evenly over the processes."""
    count, index = jax.process_count(), jax.process_index()
    if global_rows % count:
        raise ValueError(f"{global_rows} rows do not split evenly over {count} processes; make the batch a "
                         f"multiple of the process count")
    per = global_rows // count
    return slice(index * per, (index + 1) * per)


def host_local_to_global(batch: Any, mesh: Mesh, spec: PartitionSpec | None = None) -> Any:
    """Assemble per-host rows into global arrays: leaf [R_local, ...] on each process -> [R_local * P, ...].

    Process p's rows become global rows [p * R_local, (p + 1) * R_local) (``process_rows``), sharded by
    ``spec`` (default: rows over ('data', 'fsdp')). Uses ``jax.make_array_from_process_local_data``;
    with one process it is a plain placement. Scalars must be equal on every process (replicated).
    """
    rows = NamedSharding(mesh, spec if spec is not None else PartitionSpec(batch_spec(mesh)))
    rep = NamedSharding(mesh, PartitionSpec())

    def one(x):
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.make_array_from_process_local_data(rep, x, x.shape)
        global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        return jax.make_array_from_process_local_data(rows, x, global_shape)

    return jax.tree.map(one, batch)


def to_host(tree: Any) -> Any:
    """numpy copies of (possibly multi-process, sharded) arrays, the full value on every process."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


@functools.lru_cache(maxsize=None)
def _all_finite_on(mesh: Mesh):
    """all(isfinite(x)) as a replicated scalar on ``mesh`` (one jitted function per mesh)."""
    import jax.numpy as jnp

    return jax.jit(lambda x: jnp.all(jnp.isfinite(x)), out_shardings=NamedSharding(mesh, PartitionSpec()))


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of the floating-point leaves holding a NaN or infinity, for arrays of any sharding.

    A jitted all-reduce per leaf with a replicated scalar result, so it works on arrays spread over
    several processes (``np.asarray`` cannot fetch those). Same contract as train/checkpoint.py's check.
    """
    import jax.numpy as jnp

    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            finite = _all_finite_on(leaf.sharding.mesh)(leaf)
        else:
            finite = np.all(np.isfinite(np.asarray(leaf)))
        if not bool(finite):
            bad.append(jax.tree_util.keystr(path))
    return bad


__all__ = ["MODES", "InitPlan", "tpu_present", "plan_initialize", "maybe_initialize", "is_main_process",
           "process_rows", "host_local_to_global", "to_host",
           "nonfinite_leaves"]
