"""Process set-up: the memory allocator (tcmalloc for the CLI, glibc's malloc told to keep freed memory
otherwise) and JAX's persistent compilation cache (the CLI and the Python API, ``ragen_jax.api``).

tcmalloc. With glibc's malloc about a third of JAX's CPU time on a 2-core machine went to page faults:
XLA:CPU maps and frees large temporaries (attention scores) at every step, and glibc hands them back to
the kernel each time; tcmalloc keeps them (measured on a 3.4M-parameter decoder sampling batch 64).
The allocator can only be chosen when the process starts, so ``python -m ragen_jax.main`` re-executes
itself once, before it imports JAX, with ``LD_PRELOAD`` naming the library when one is installed
(Debian / Ubuntu: ``apt-get install libtcmalloc-minimal4``, also pulled in by ``libgoogle-perftools4``)
and no tcmalloc is preloaded yet. ``RAGEN_JAX_TCMALLOC`` steers it:
unset (or ``1``) finds the library, ``0`` runs with the default allocator, a path preloads that file.

glibc's malloc without tcmalloc. The page faults come from XLA:CPU's per-execution temporary buffer (one
block of hundreds of MB for a training step: 477 MB for Countdown's warm-start step). JAX runs programs on
its own threads, and glibc serves a block that large from a thread's arena with a fresh ``mmap`` whatever
``M_MMAP_MAX`` says, then unmaps it when the step ends, so every step faults the whole buffer in again.
``keep_freed_memory`` (the CLI without tcmalloc, and notebooks, which cannot preload a library into a
running kernel) keeps that block in the main heap: no ``mmap`` for large blocks (``M_MMAP_MAX=0``), no
trimming of the heap (``M_TRIM_THRESHOLD``), one arena for threads started later (``M_ARENA_MAX=1``), and
JAX's CPU programs run on the calling thread (``jax_cpu_enable_async_dispatch`` off), so the block is
allocated from the main arena even where threads started earlier hold arenas of their own (a notebook
kernel's). Freed blocks stay mapped and the next step reuses them. Measured on Countdown's warm start
(60 steps, 2 cores): 43.6 s and 0.54M minor page faults against 53-57 s and 7.5M with glibc's defaults
(43.1 s with tcmalloc); with four threads that allocated before (as in a notebook kernel) 41.5 s against
51.3 s, where the arena setting alone gave 49.7 s. RL steps of the same task gained less (2.2 s against
2.3-2.5 s per step: their buffers are smaller). Like tcmalloc, the process then keeps the memory its
steps freed (``setup.compile_memory`` hands back what a compile leaves). It only works before JAX starts
(the first ``jax.devices()`` or computation) and then does nothing. ``RAGEN_JAX_TCMALLOC=0`` leaves
glibc's defaults too.

Compilation cache. Compiling the rollout, update and validation programs is most of a short run's
start-up; JAX can keep the compiled programs on disk and a second run with the same shapes loads them
instead. ``compile_cache.enabled`` (on by default), ``compile_cache.dir`` and
``compile_cache.min_compile_time_secs`` in configs/base.py set it up.
"""

from __future__ import annotations

import os
import platform
import sys
import sysconfig
from typing import Mapping

TCMALLOC_ENV = "RAGEN_JAX_TCMALLOC"
# Set in the re-executed process, so that it never re-executes again (whatever happened to LD_PRELOAD).
REEXECUTED_ENV = "_RAGEN_JAX_TCMALLOC_REEXECUTED"
_OFF = ("0", "false", "off", "no")
# tcmalloc_minimal first: the allocator without the heap profiler's hooks (what was measured).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
# tcmalloc prints a "large alloc" line with a stack for every allocation past this many bytes (1 GiB by
# default), which a real model's weights and caches pass all the time; 1 TiB keeps stderr readable.
_LARGE_ALLOC_REPORT_THRESHOLD = str(1 << 40)


def tcmalloc_search_dirs() -> list[str]:
    """Where distributions install shared libraries: Debian's multiarch directories, lib64, lib, and this
    Python's prefix (a conda environment's gperftools)."""
    arches = dict.fromkeys(a for a in (sysconfig.get_config_var("MULTIARCH"), f"{platform.machine()}-linux-gnu") if a)
    dirs = [f"{root}/{arch}" for arch in arches for root in ("/usr/lib", "/lib")]
    return dirs + ["/usr/lib64", "/usr/lib", "/usr/local/lib", os.path.join(sys.prefix, "lib")]


def find_tcmalloc(environ: Mapping[str, str], search_dirs: list[str] | None = None) -> str | None:
    """The tcmalloc library to preload: ``RAGEN_JAX_TCMALLOC``'s file when it names a path (None when
    that file does not exist), else the first of TCMALLOC_NAMES in ``search_dirs``; None when not found."""
    choice = environ.get(TCMALLOC_ENV, "")
    if os.sep in choice:
        return choice if os.path.isfile(choice) else None
    for folder in tcmalloc_search_dirs() if search_dirs is None else search_dirs:
        for name in TCMALLOC_NAMES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None


def tcmalloc_reexec_environ(environ: Mapping[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to re-execute the CLI with so that ``library`` is preloaded, or None to run on in
    this process: when ``RAGEN_JAX_TCMALLOC`` turns it off, when no library was found, when a tcmalloc is
    already preloaded, and in the re-executed process itself (so it re-executes at most once)."""
    if (library is None or environ.get(TCMALLOC_ENV, "").strip().lower() in _OFF or REEXECUTED_ENV in environ
            or "tcmalloc" in environ.get("LD_PRELOAD", "")):
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    env[REEXECUTED_ENV] = "1"
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", _LARGE_ALLOC_REPORT_THRESHOLD)
    return env


def use_tcmalloc() -> None:
    """Re-execute this command (``sys.orig_argv``: the same interpreter, options and arguments) with
    tcmalloc preloaded when tcmalloc_reexec_environ says so; otherwise return and let the run go on.
    Only for ``python -m ragen_jax.main``'s own process: exec replaces the calling process."""
    if not sys.platform.startswith("linux"):  # LD_PRELOAD is the Linux loader's
        return
    library = find_tcmalloc(os.environ)
    if library is None and os.sep in os.environ.get(TCMALLOC_ENV, ""):
        print(f"warning: {TCMALLOC_ENV}={os.environ[TCMALLOC_ENV]} is not a file; running with the default "
              "memory allocator", file=sys.stderr)
    env = tcmalloc_reexec_environ(os.environ, library)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Make glibc's malloc keep freed memory for reuse and run JAX's CPU programs on the calling thread
    (see the module docstring); True when it was set.

    Does nothing (False) off Linux / glibc, with a tcmalloc in ``LD_PRELOAD``, with ``RAGEN_JAX_TCMALLOC``
    off, and once JAX's backends are started (too late: their threads have their own arenas)."""
    environ = os.environ if environ is None else environ
    if (not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"
            or "tcmalloc" in environ.get("LD_PRELOAD", "")
            or environ.get(TCMALLOC_ENV, "").strip().lower() in _OFF):
        return False
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not (libc.mallopt(_M_ARENA_MAX, 1) and libc.mallopt(_M_MMAP_MAX, 0)
            and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)):
        return False
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def default_compilation_cache_dir(environ: Mapping[str, str]) -> str:
    """$XDG_CACHE_HOME/ragen_jax/jax_compilation_cache, ~/.cache/ragen_jax/jax_compilation_cache without it."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ragen_jax", "jax_compilation_cache")


def compilation_cache_dir(config, environ: Mapping[str, str]) -> str | None:
    """The directory of the run's compilation cache, None when ``compile_cache.enabled`` is off:
    ``compile_cache.dir``, else $JAX_COMPILATION_CACHE_DIR (the test suite points every run it starts at
    one shared cache this way), else default_compilation_cache_dir."""
    if not config.compile_cache.enabled:
        return None
    path = config.compile_cache.dir or environ.get("JAX_COMPILATION_CACHE_DIR") or default_compilation_cache_dir(environ)
    return os.path.expanduser(path)


def use_compilation_cache(config) -> None:
    """Point JAX's persistent compilation cache at compilation_cache_dir, or turn it off. A directory that
    cannot be created or written turns it off with one warning line (JAX would warn at every compile)."""
    import jax  # here, not at the top: the CLI checks the config before anything imports JAX

    path = compilation_cache_dir(config, os.environ)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            print(f"warning: compilation cache off: cannot create {path!r} ({e.strerror}); set "
                  "--config.compile_cache.dir or --config.compile_cache.enabled=False", file=sys.stderr)
            path = None
        else:
            if not os.access(path, os.W_OK | os.X_OK):
                print(f"warning: compilation cache off: {path!r} is not writable; set --config.compile_cache.dir "
                      "or --config.compile_cache.enabled=False", file=sys.stderr)
                path = None
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(config.compile_cache.min_compile_time_secs))
