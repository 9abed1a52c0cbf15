"""The command line: ``python -m ragen_jax.main --config=configs/countdown.py [--config.key=value ...]``.

Modes (``--config.mode``): ``train`` (default) trains and validates, ``eval`` runs the validation
rollouts of the latest checkpoint in the run directory, ``sft`` builds (or finds) the supervised warm
start that ``init=sft`` starts from and prints its metrics.
The resolved config is printed; a training run writes it to ``RUN_DIR/config.json`` once the run is
built and its resume checks passed, so a command that fails never replaces a run's config. Bad keys, bad
values, a missing ``hf_path`` and an unknown environment fail before any compilation with a one-line
reason (exit 2); so do a bad model file, a resume whose config changes the run (see
``train.resume.RESUME_FREE_KEYS``; ``--config.trainer.allow_config_change=True`` accepts it) and a checkpoint
directory none of whose checkpoints restores. A full disk stops the run with one line (exit 1); the same
command resumes it from the newest complete checkpoint once there is space.
"""

from __future__ import annotations

import errno
import json
import logging as pylogging
import os
import sys
import traceback

from absl import app, logging
from ml_collections import config_flags

from ragen_jax.setup import runtime
from ragen_jax.setup.config_check import CHOICES, ConfigError, check_config, check_override_keys, run_dir_of
from ragen_jax.setup.config_file import load_config_file

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def precheck_argv(argv: list[str]) -> None:
    """Validate ``--config.*`` override keys against the config file before absl parses them."""
    path = _config_path(argv)
    if path is None:
        raise ConfigError("missing --config=configs/<task>.py (e.g. --config=configs/countdown.py)")
    if not os.path.isfile(path.split(":", 1)[0]):
        raise ConfigError(f"config file {path!r} does not exist")
    config = load_config_file(path)
    check_override_keys(argv, config)
    if any(arg.startswith("--config.algorithm.name") for arg in argv):
        raise ConfigError(
            "choose an algorithm preset with the config string, e.g. --config=configs/sokoban.py:grpo "
            f"({' | '.join(CHOICES['algorithm.name'])}); --config.algorithm.name alone would only rename the run"
        )


def _causes(e: BaseException):
    """``e`` and the exceptions it was raised from or during."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def no_space_left(e: BaseException) -> bool:
    """Whether ``e`` comes from a full disk (an OSError ENOSPC, or orbax / tensorstore wrapping one)."""
    return any((isinstance(c, OSError) and c.errno == errno.ENOSPC) or "no space left on device" in str(c).lower()
               for c in _causes(e))


def run_error_line(e: BaseException, run_dir: str) -> tuple[str, int] | None:
    """(one-line message, exit status) for an error a user can fix, None for a bug (which keeps its
    traceback). A bad config or model file, a refused resume or a damaged checkpoint directory exit 2; a
    full disk exits 1 and says that the run resumes from its newest complete checkpoint."""
    from ragen_jax.train.checkpoint import CheckpointRestoreError
    from ragen_jax.models.gguf import GGUFError
    from ragen_jax.models.hf_io import CheckpointError

    if no_space_left(e):
        return (f"error: no space left on device while writing the run in {run_dir}; free space and run the "
                "same command again: it resumes from the newest complete checkpoint", 1)
    if isinstance(e, (ConfigError, GGUFError, CheckpointError, CheckpointRestoreError)):
        lines = str(e).strip().splitlines() or [type(e).__name__]
        return f"error: {lines[0]}", 2
    return None


class _NoBackgroundTracebacks(pylogging.Filter):
    """Drop the tracebacks of orbax's background save work: logged by orbax from its threads, or by
    asyncio ("Task exception was never retrieved") when one of orbax's write tasks is collected. The
    same exception is raised again in the main thread (``wait_until_finished``), where
    ``run_error_line`` reports a user-fixable one (a full disk) in one line and a bug keeps its
    traceback."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        orbax = f"{os.sep}orbax{os.sep}"
        frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info[2] is not None else []
        return not (orbax in record.pathname or any(orbax in f.filename for f in frames))


def _main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax/JAX INFO lines would drown the progress line
    logging.get_absl_logger().addFilter(_NoBackgroundTracebacks())
    pylogging.getLogger("asyncio").addFilter(_NoBackgroundTracebacks())
    config = _CONFIG.value
    from envs.registry import HOST_REGISTRY, REGISTRY  # deferred: imports JAX
    from ragen_jax.models.config import PRESETS

    try:
        check_config(config, env_names=REGISTRY, model_presets=PRESETS, host_envs=HOST_REGISTRY)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from ragen_jax.parallel import distributed

    distributed.maybe_initialize(config)
    run_dir = run_dir_of(config)
    if distributed.is_main_process():
        print(config)
    # RUN_DIR/config.json is written by trainer.train once the run is built and its resume checks pass:
    # a command that fails (a bad model file, a refused resume, eval, sft) never replaces it.
    try:
        from ragen_jax import api

        if config.mode == "sft":
            path, summary = api.warm_start(config)
            print(json.dumps({"warm_start": path, **summary}, indent=2, default=float))
        elif config.mode == "eval":
            print(json.dumps(api.evaluate(config), indent=2))
        else:
            print(json.dumps(api.train(config), indent=2))
    except Exception as e:
        known = run_error_line(e, run_dir)
        if known is None:
            raise
        print(known[0], file=sys.stderr, flush=True)
        sys.exit(known[1])


def main() -> None:
    try:
        precheck_argv(sys.argv[1:])
    except ConfigError as e:
        # One line even when the message quotes a multi-line one (an exception from a config file).
        print("error: " + " ".join(str(e).split("\n")), file=sys.stderr)
        sys.exit(2)
    app.run(_main)


if __name__ == "__main__":
    runtime.use_tcmalloc()  # re-executes this command once with tcmalloc preloaded, when installed
    runtime.keep_freed_memory()  # without tcmalloc: glibc keeps freed blocks (before JAX starts)
    main()
