"""The command line: ``python -m ragen_jax.main --config=configs/countdown.py [--config.key=value ...]``.

Modes (``--config.mode``): ``train`` (default) trains and validates, ``eval`` runs the validation
rollouts of the latest checkpoint in the run directory, ``sft`` builds (or finds) the supervised warm
start that ``init=sft`` starts from and prints its metrics.
The resolved config is printed and written to ``RUN_DIR/config.json``. Bad keys, bad values, a missing
``hf_path`` and an unknown environment fail before any compilation with a one-line reason (exit 2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from absl import app, logging
from ml_collections import config_flags

from ragen_jax.setup.config_check import ConfigError, check_config, check_override_keys

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
    """``get_config()`` of a configs/*.py file (``get_config(arg)`` for "file.py:arg", as config_flags does)."""
    file, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location(f"_ragen_config_{abs(hash(file))}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def run_dir_of(config) -> str:
    if config.run_dir:
        return config.run_dir
    return os.path.join("runs", f"{config.env.name}-{config.algorithm.name}-seed{config.seed}")


def _main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax/JAX INFO lines would drown the progress line
    config = _CONFIG.value
    from envs.registry import REGISTRY  # deferred: imports JAX
    from ragen_jax.models.config import PRESETS

    try:
        check_config(config, env_names=REGISTRY, model_presets=PRESETS)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from ragen_jax.parallel import distributed

    distributed.maybe_initialize(config)
    run_dir = run_dir_of(config)
    if distributed.is_main_process():
        os.makedirs(run_dir, exist_ok=True)
        print(config)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
            f.write("\n")

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


def main() -> None:
    try:
        precheck_argv(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    app.run(_main)


if __name__ == "__main__":
    main()
