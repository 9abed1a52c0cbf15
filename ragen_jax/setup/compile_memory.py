"""Hand the memory that XLA's compiler leaves in the allocator back to the operating system.

Compiling one of a run's programs (a multi-turn rollout, the update at a new bucket width, a validation
rollout) takes hundreds of MB for a moment: on Sokoban's CPU default each 5-turn rollout's compile
raised the resident memory by about 1 GB. The allocator keeps memory that is freed for reuse (tcmalloc
by design, and glibc's malloc because ``runtime.keep_freed_memory`` tells it to), so every compile's
working memory stayed in the process and the compiles' memory added up: the run's peak was the sum, not
the largest one. ``release_after_compiles()`` registers a JAX monitoring listener that returns the
allocator's free memory to the OS as soon as a compile of ``MIN_COMPILE_S`` or more has finished; steady
steps compile nothing, so they keep reusing their buffers without page faults.

    release_after_compiles()   # once per process (the trainer, the warm-start builder, the API call it)
"""

from __future__ import annotations

import ctypes

# What jax._src.dispatch records around every backend compile (or persistent-cache load) of a program.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Compiles shorter than this (small helper programs, loads from the persistent cache) leave little memory
# behind; releasing after them would only cost the next calls' page faults.
MIN_COMPILE_S = 0.5

_state = {"listening": False, "releases": 0}


def _on_event_duration(event: str, duration_secs: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT and duration_secs >= MIN_COMPILE_S and release_free_memory():
        _state["releases"] += 1


def release_after_compiles() -> None:
    """From now on, hand the allocator's free memory back after every compile of ``MIN_COMPILE_S`` or more
    (a JAX monitoring listener; registering twice does nothing)."""
    if not _state["listening"]:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_event_duration)
        _state["listening"] = True


def releases() -> int:
    """How many times the listener has released memory in this process."""
    return _state["releases"]


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
