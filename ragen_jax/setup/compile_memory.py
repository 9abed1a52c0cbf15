"""Hand the memory that XLA's compiler leaves in the allocator back to the operating system.

Compiling one of a run's programs (a multi-turn rollout, the update at a new bucket width, a validation
rollout) takes hundreds of MB for a moment: on Sokoban's CPU default each 5-turn rollout's compile
raised the resident memory by about 1 GB. The allocator keeps memory that is freed for reuse (tcmalloc
by design, and glibc's malloc because ``runtime.keep_freed_memory`` tells it to), so every compile's
working memory stayed in the process and the compiles' memory added up: the run's peak was the sum, not
the largest one. ``release_if_compiled()``, which the trainer calls between the phases of a step, returns
the allocator's free memory to the OS when a program compiled since the last call, and does nothing
otherwise, so the steady steps keep reusing their buffers without page faults.

    watch_compiles()          # once per process: note every compile that takes MIN_COMPILE_S or more
    ...                       # a phase that may compile
    release_if_compiled()     # True when it released
"""

from __future__ import annotations

import ctypes

# What jax._src.dispatch records around every backend compile (or persistent-cache load) of a program.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Compiles shorter than this (small helper programs, loads from the persistent cache) leave little memory
# behind; releasing after them would only cost the next step's page faults.
MIN_COMPILE_S = 0.5

_state = {"watching": False, "compiled": False}


def _on_event_duration(event: str, duration_secs: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT and duration_secs >= MIN_COMPILE_S:
        _state["compiled"] = True


def watch_compiles() -> None:
    """Start noting compiles (a JAX monitoring listener; registering twice does nothing)."""
    if not _state["watching"]:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_event_duration)
        _state["watching"] = True


def release_free_memory() -> bool:
    """Return the allocator's free memory to the OS: tcmalloc's ``MallocExtension_ReleaseFreeMemory`` when
    tcmalloc is loaded, else glibc's ``malloc_trim(0)``. False when neither is there (nothing done)."""
    process = ctypes.CDLL(None)
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        release = getattr(process, name, None)
        if release is not None:
            release(*args)
            return True
    return False


def release_if_compiled() -> bool:
    """``release_free_memory()`` when a compile of ``MIN_COMPILE_S`` or more ran since the last call
    (after ``watch_compiles``); True when it released."""
    if not _state["compiled"]:
        return False
    _state["compiled"] = False
    return release_free_memory()
