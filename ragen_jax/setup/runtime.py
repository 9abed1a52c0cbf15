"""The CLI's process set-up: tcmalloc as the memory allocator, and JAX's persistent compilation cache.

tcmalloc. With glibc's malloc about a third of JAX's CPU time on a 2-core machine went to page faults:
XLA:CPU maps and frees large temporaries (attention scores) at every step, and glibc hands them back to
the kernel each time; tcmalloc keeps them (measured on a 3.4M-parameter decoder sampling batch 64).
The allocator can only be chosen when the process starts, so ``python -m ragen_jax.main`` re-executes
itself once, before it imports JAX, with ``LD_PRELOAD`` naming the library when one is installed
(Debian / Ubuntu: ``apt-get install libtcmalloc-minimal4``, also pulled in by ``libgoogle-perftools4``)
and no tcmalloc is preloaded yet. ``RAGEN_JAX_TCMALLOC`` steers it:
unset (or ``1``) finds the library, ``0`` runs with the default allocator, a path preloads that file.

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
