"""Run a Python script in a fresh interpreter with N forced CPU devices (or as one of several JAX processes).

The pytest process has already initialised JAX with one CPU device, and XLA reads
``--xla_force_host_platform_device_count`` only at start-up, so multi-device tests run their body in a
subprocess. The script prints one JSON object on its last stdout line; ``run_script`` returns it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prepended to every script: CPU only, exact float32 matmuls (as tests/conftest.py), quiet logs.
PRELUDE = """
import os
import jax
jax.config.update("jax_default_matmul_precision", "highest")
"""


def device_env(num_devices: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID"):
        env.pop(key, None)  # a test decides itself whether the child is part of a multi-process run
    env.update(extra or {})
    return env


def _last_json(stdout: str, stderr: str, returncode: int) -> dict:
    if returncode != 0:
        raise AssertionError(f"subprocess failed (exit {returncode}):\n--- stdout\n{stdout[-4000:]}\n"
                             f"--- stderr\n{stderr[-8000:]}")
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"subprocess printed nothing; stderr:\n{stderr[-8000:]}")
    return json.loads(lines[-1])


def run_script(script: str, num_devices: int = 8, timeout: float = 600, env: dict[str, str] | None = None) -> dict:
    """Run ``script`` (dedented) with ``num_devices`` forced CPU devices; return its last-line JSON."""
    code = PRELUDE + textwrap.dedent(script)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=device_env(num_devices, env),
                          capture_output=True, text=True, timeout=timeout)
    return _last_json(proc.stdout, proc.stderr, proc.returncode)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(script: str, num_processes: int = 2, devices_per_process: int = 1, timeout: float = 600,
                  env: dict[str, str] | None = None) -> list[dict]:
    """Run ``script`` as ``num_processes`` JAX processes on a loopback coordinator (gloo CPU collectives).

    Each child gets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID in its environment (the
    script calls ``ragen_jax.parallel.distributed.maybe_initialize``). Returns the JSON of each process, by id.
    """
    code = PRELUDE + 'jax.config.update("jax_cpu_collectives_implementation", "gloo")\n' + textwrap.dedent(script)
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for pid in range(num_processes):
        extra = {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(num_processes),
                 "JAX_PROCESS_ID": str(pid), **(env or {})}
        child_env = device_env(devices_per_process)
        child_env.update(extra)
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=child_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(_last_json(out, err, proc.returncode))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results
