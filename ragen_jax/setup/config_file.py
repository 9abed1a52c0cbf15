"""Reading a config file: ``get_config()`` of a ``configs/*.py`` file, its failures as one-line errors.

Imports no JAX: the CLI reads and checks the config before anything starts a backend.
"""

from __future__ import annotations

import importlib.util
import os
import traceback

from ragen_jax.setup.config_check import ConfigError


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
