"""Shared pytest settings: CPU only, exact float32 matmuls, and a persistent compilation cache.

The cache (``.jax_cache/`` in the repository, git-ignored) is shared by every test module and by the
training subprocesses the trainer tests start (they inherit these environment variables; the CLI's
``compile_cache.dir=""`` means $JAX_COMPILATION_CACHE_DIR, see ragen_jax/setup/runtime.py), so a program
that several tests build with the same shapes compiles once per test session. The 0.5 s threshold is
configs/base.py's ``compile_cache.min_compile_time_secs``.
"""

import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
