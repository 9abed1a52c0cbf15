"""The command line: ``python -m ragen_jax.main --config=configs/countdown.py [--config.key=value ...]``.

Modes (``--config.mode``): ``train`` (default) trains and validates, ``eval`` runs the validation
rollouts of the latest checkpoint in the run directory, ``sft`` builds (or finds) the supervised warm
start that ``init=sft`` starts from and prints its metrics.
The resolved config is printed; a training run writes it to ``RUN_DIR/config.json`` once the run is
built and its resume checks passed, so a command that fails never replaces a run's config. Bad keys, bad
values, a missing ``hf_path`` and an unknown environment fail before any compilation with a one-line
reason (exit 2); so do a bad model file, a resume whose config changes the run (see
``trainer.RESUME_FREE_KEYS``; ``--config.trainer.allow_config_change=True`` accepts it) and a checkpoint
directory none of whose checkpoints restores. A full disk stops the run with one line (exit 1); the same
command resumes it from the newest complete checkpoint once there is space.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging as pylogging
import os
import sys
import traceback

from absl import app, logging
from ml_collections import config_flags

from ragen_jax.setup import runtime
from ragen_jax.setup.config_check import ConfigError, check_config, check_override_keys, run_dir_of

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
            "(ppo | grpo | drgrpo | dapo); --config.algorithm.name alone would only rename the run"
        )


def load_config_file(path: str):
    """``get_config()`` of a configs/*.py file (``get_config(arg)`` for "file.py:arg", as config_flags does).

    Raises ConfigError, in one line with the file and line, when the file does not compile, raises while
    it runs, defines no get_config, or rejects ``arg`` (an unknown algorithm preset).
    """
    file, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location(f"_ragen_config_{abs(hash(file))}", file)
    if spec is None:
        raise ConfigError(f"--config={path}: a config file is a Python file defining get_config() (configs/*.py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        get_config = getattr(module, "get_config", None)
        if not callable(get_config):
            raise ConfigError("the file defines no get_config(); it must return the run's ConfigDict "
                              "(see configs/countdown.py)")
        return get_config(arg) if arg else get_config()
    except ConfigError as e:
        raise ConfigError(f"--config={path}: {e}") from None
    except Exception as e:  # the config file is the user's code: its failure is a user error, located
        raise ConfigError(f"--config={path}: {_where(e, file)}") from None


def _where(e: BaseException, config_file: str) -> str:
    """'line N: Type: message' for an error raised by (or while compiling) a config file's code, with the
    file's name too when the line is in another file (e.g. configs/base.py, which task files call)."""
    if isinstance(e, SyntaxError):
        filename, lineno, message = e.filename, e.lineno, e.msg
    else:
        # The innermost frame with a real file is where the code failed (importlib's are "<frozen ...>").
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
        filename, lineno = (frames[-1].filename, frames[-1].lineno) if frames else (config_file, None)
        message = str(e)
    in_file = "" if os.path.abspath(filename) == os.path.abspath(config_file) else f"{filename} "
    return f"{in_file}line {lineno}: {type(e).__name__}: {message}"


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
    from envs.registry import REGISTRY  # deferred: imports JAX
    from ragen_jax.models.config import PRESETS

    try:
        check_config(config, env_names=REGISTRY, model_presets=PRESETS)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    runtime.use_compilation_cache(config)
    from ragen_jax.parallel import distributed

    distributed.maybe_initialize(config)
    run_dir = run_dir_of(config)
    if distributed.is_main_process():
        print(config)
    # RUN_DIR/config.json is written by trainer.train once the run is built and its resume checks pass:
    # a command that fails (a bad model file, a refused resume, eval, sft) never replaces it.
    try:
        if config.mode == "sft":
            from ragen_jax.sft.warm_start import build_warm_start, read_metrics

            path = build_warm_start(config)
            summary = {k: v for k, v in read_metrics(path).items() if k != "loss_curve"}
            print(json.dumps({"warm_start": path, **summary}, indent=2, default=float))
        elif config.mode == "eval":
            from ragen_jax.train.loop import evaluate

            print(json.dumps(evaluate(config, run_dir), indent=2))
        else:
            from ragen_jax.train.loop import train

            summary = train(config, run_dir)
            print(json.dumps(summary, indent=2))
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
    main()
