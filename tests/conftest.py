"""Shared pytest settings: CPU only, exact float32 matmuls, and a persistent compilation cache.

The cache (``.jax_cache/`` in the repository, git-ignored) is shared by every test module and by the
training subprocesses the trainer tests start (they inherit these environment variables; the CLI's
``compile_cache.dir=""`` means $JAX_COMPILATION_CACHE_DIR, see ragen_jax/setup/runtime.py), so a program
that several tests build with the same shapes compiles once per test session. The 0.5 s threshold is
configs/base.py's ``compile_cache.min_compile_time_secs``.

XLA:CPU's LLVM backend runs at optimisation level 0 here (``--xla_backend_optimization_level=0``, added to
$XLA_FLAGS unless it names a level already; subprocesses inherit it). The suite's programs are small models
compiled once and run a few steps, so compiling is most of its time: level 0 halves the compile of a small
config's rollout (22 s -> 12.5 s) and took tests/test_trainer.py + tests/test_sft.py from 728 s to 604 s
from an empty cache, while a step of those programs runs ~4x slower. The HLO is the same; the machine code
rounds some float operations differently (up to 1e-6 relative on log-probs and parameters after an update), which
every numeric tolerance of the suite, derived from float32 rounding, already covers.
"""

import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join([*os.environ.get("XLA_FLAGS", "").split(), "--xla_backend_optimization_level=0"])

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
