"""The CLI's process set-up (ragen_jax/setup/runtime.py): when it re-executes with tcmalloc preloaded (only
with a library found, never twice), and where the compilation cache goes (or that it is off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from ragen_jax.setup.config_check import ConfigError, _check_compile_cache
from ragen_jax.setup.runtime import (REEXECUTED_ENV, TCMALLOC_ENV, compilation_cache_dir, find_tcmalloc,
                                     keep_freed_memory, tcmalloc_reexec_environ)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def _touch(path) -> str:
    path.write_bytes(b"")
    return str(path)


def test_find_tcmalloc_prefers_minimal_and_returns_none_without_one(tmp_path):
    empty, both = tmp_path / "empty", tmp_path / "both"
    empty.mkdir()
    both.mkdir()
    _touch(both / "libtcmalloc.so.4")
    minimal = _touch(both / "libtcmalloc_minimal.so.4")
    assert find_tcmalloc({}, [str(empty)]) is None
    assert find_tcmalloc({}, [str(empty), str(both)]) == minimal


def test_find_tcmalloc_takes_the_named_file_only_if_it_exists(tmp_path):
    lib = _touch(tmp_path / "libtcmalloc_custom.so")
    assert find_tcmalloc({TCMALLOC_ENV: lib}, []) == lib
    assert find_tcmalloc({TCMALLOC_ENV: str(tmp_path / "missing.so")}, [str(tmp_path)]) is None


def test_reexec_preloads_the_library_and_keeps_other_preloads():
    env = tcmalloc_reexec_environ({"PATH": "/bin", "LD_PRELOAD": "/x/libother.so"}, LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:/x/libother.so"
    assert env["PATH"] == "/bin" and env[REEXECUTED_ENV] == "1"
    assert tcmalloc_reexec_environ({}, LIB)["LD_PRELOAD"] == LIB


def test_no_reexec_without_a_library_or_when_turned_off():
    assert tcmalloc_reexec_environ({}, None) is None
    for off in ("0", "false", "OFF", "no"):
        assert tcmalloc_reexec_environ({TCMALLOC_ENV: off}, LIB) is None
    assert tcmalloc_reexec_environ({TCMALLOC_ENV: "1"}, LIB) is not None


def test_reexec_happens_at_most_once():
    env = tcmalloc_reexec_environ({}, LIB)
    assert tcmalloc_reexec_environ(env, LIB) is None  # the re-executed process runs on
    # ... even if something dropped LD_PRELOAD on the way, and never when a tcmalloc is already preloaded
    assert tcmalloc_reexec_environ({k: v for k, v in env.items() if k != "LD_PRELOAD"}, LIB) is None
    assert tcmalloc_reexec_environ({"LD_PRELOAD": "/opt/lib/libtcmalloc.so.4"}, LIB) is None


def test_large_alloc_reports_quiet_unless_the_user_set_them():
    assert int(tcmalloc_reexec_environ({}, LIB)["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    env = tcmalloc_reexec_environ({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "100"}, LIB)
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "100"


def _cache_config(enabled=True, directory="", min_time=0.5):
    return ml_collections.ConfigDict({"compile_cache": {"enabled": enabled, "dir": directory,
                                                        "min_compile_time_secs": min_time}})


def test_compilation_cache_dir_precedence():
    xdg = {"XDG_CACHE_HOME": "/xdg"}
    assert compilation_cache_dir(_cache_config(enabled=False), xdg) is None
    assert compilation_cache_dir(_cache_config(directory="/mine"), {**xdg, "JAX_COMPILATION_CACHE_DIR": "/e"}) == "/mine"
    assert compilation_cache_dir(_cache_config(), {**xdg, "JAX_COMPILATION_CACHE_DIR": "/e"}) == "/e"
    assert compilation_cache_dir(_cache_config(), xdg) == "/xdg/ragen_jax/jax_compilation_cache"
    home = os.path.expanduser("~")
    assert compilation_cache_dir(_cache_config(), {}) == f"{home}/.cache/ragen_jax/jax_compilation_cache"
    assert compilation_cache_dir(_cache_config(directory="~/c"), {}) == f"{home}/c"


def test_use_compilation_cache_sets_jax_config(tmp_path):
    """In a fresh interpreter (this one's JAX config belongs to the test session): on, off, and a
    directory that cannot be created (off, one warning line)."""
    blocked = _touch(tmp_path / "a_file")
    script = f"""
import json, jax, ml_collections
from ragen_jax.setup.runtime import use_compilation_cache
out = []
for enabled, directory in ((True, {str(tmp_path / 'cache')!r}), (False, ""), (True, {blocked + '/sub'!r})):
    jax.config.update("jax_enable_compilation_cache", True)
    use_compilation_cache(ml_collections.ConfigDict({{"compile_cache": {{
        "enabled": enabled, "dir": directory, "min_compile_time_secs": 0.25}}}}))
    out.append([jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir,
                jax.config.jax_persistent_cache_min_compile_time_secs])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    on, off, blocked_run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert on == [True, str(tmp_path / "cache"), 0.25] and os.path.isdir(tmp_path / "cache")
    assert off[0] is False and blocked_run[0] is False
    assert [line for line in proc.stderr.splitlines() if "compilation cache off" in line] != []


def test_use_tcmalloc_is_only_called_by_the_cli_entry_point():
    """exec replaces the calling process: main() (which tests call in-process) must not re-execute."""
    with open(os.path.join(REPO, "ragen_jax", "main.py")) as f:
        source = f.read()
    entry = source.split('if __name__ == "__main__":', 1)
    assert source.count("use_tcmalloc()") == 1 and "use_tcmalloc()" in entry[1]


def test_config_check_refuses_bad_compile_cache_values(tmp_path):
    _check_compile_cache(_cache_config(directory=str(tmp_path / "new")))
    for bad in (_cache_config(min_time=-1.0), _cache_config(directory=_touch(tmp_path / "f"))):
        with pytest.raises(ConfigError, match="compile_cache"):
            _check_compile_cache(bad)
    _check_compile_cache(_cache_config(enabled=False, directory=str(tmp_path / "f")))  # off: the dir is unused


def test_keep_freed_memory_leaves_tcmalloc_and_the_off_switch_alone():
    assert not keep_freed_memory({"LD_PRELOAD": LIB})
    assert not keep_freed_memory({TCMALLOC_ENV: "0"})


_FAULTS_SCRIPT = """
import json, resource, sys, threading
import numpy as np
# threads that allocated before JAX starts and stay alive hold arenas of their own (a notebook kernel's)
ready, done = threading.Barrier(4), threading.Event()
def hold():
    np.ones(1 << 16)
    ready.wait()
    done.wait()
threads = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
[t.start() for t in threads]
ready.wait()
from ragen_jax.setup import runtime
applied = runtime.keep_freed_memory()
import jax, jax.numpy as jnp
x = jnp.ones((4096, 256), jnp.float32)
step = jax.jit(lambda x: jnp.cumsum(x @ x.T, axis=0)[-1])  # 128 MB of [4096, 4096] temporaries per call
step(x).block_until_ready()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults, "again": runtime.keep_freed_memory(),
                  "async_dispatch": jax.config.read("jax_cpu_enable_async_dispatch")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="glibc on Linux")
def test_keep_freed_memory_reuses_the_temporary_buffer_instead_of_faulting_it_in():
    """In a fresh interpreter with threads that hold arenas of their own: set before JAX starts, a
    program's 128 MB of temporaries (32,768 pages) are reused from the heap on later calls, so at least half
    of 8 calls fault in far fewer pages than the buffers have (with glibc's defaults every call faults all
    of them in); once JAX has started, the call does nothing (False)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.pop(TCMALLOC_ENV, None)
    proc = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["applied"] is True and out["again"] is False and out["async_dispatch"] is False
    # Now and then one call's temporary comes fresh from the OS even so (about one call in eight here, at
    # any position): most calls, not every call, reuse it.
    assert sorted(out["faults"])[3] < 32768 // 4, out["faults"]


_RELEASE_SCRIPT = """
import json, os
from ragen_jax.setup import compile_memory, runtime
kept = runtime.keep_freed_memory()  # glibc: keep freed memory, as the CLI does without tcmalloc
import jax, jax.numpy as jnp
compile_memory.MIN_COMPILE_S = 0.0  # these small programs compile in well under the CLI's threshold
def rss_mb():
    return int(dict(l.split(":", 1) for l in open("/proc/self/status"))["VmRSS"].split()[0]) / 1024
x = jnp.ones((4096, 256), jnp.float32)
step = jax.jit(lambda x: jnp.cumsum(x @ x.T, axis=0)[-1])  # 128 MB of [4096, 4096] temporaries per call
step(x).block_until_ready()
compile_memory.release_after_compiles()
compile_memory.release_after_compiles()  # a second registration does nothing
step(x).block_until_ready()  # no compile: the kept temporary is reused
unreleased = compile_memory.releases()
before = rss_mb()
jax.jit(lambda x: x * 2.0)(x).block_until_ready()  # a compile: what the allocator keeps goes back
print(json.dumps({"kept": kept, "unreleased": unreleased, "releases": compile_memory.releases(),
                  "drop_mb": before - rss_mb()}))
"""


@pytest.mark.parametrize("allocator", ["tcmalloc", "glibc"])
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="glibc on Linux")
def test_a_compile_hands_the_kept_temporary_back_once(allocator):
    """A call whose 128 MB of temporaries the allocator keeps, then another program's compile: the listener
    returns the free memory to the OS once (the resident size drops by at least a quarter of that, though
    the new program's 4 MB input and output are allocated after it); a call that compiles nothing
    releases nothing."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.pop(TCMALLOC_ENV, None)
    if allocator == "tcmalloc":
        if not os.path.isfile(LIB):
            pytest.skip(f"{LIB} is not installed")
        env["LD_PRELOAD"] = LIB
    proc = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kept"] is (allocator == "glibc")
    assert out["unreleased"] == 0 and out["releases"] == 1, out
    assert out["drop_mb"] > 32, out
