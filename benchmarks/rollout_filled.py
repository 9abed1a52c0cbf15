"""A task's default rollout over its filled slots against the same rollout over its static blocks.

Both sides run the task config's fused rollout (``train.loop.build_run``: its rows, turns, tokens per
turn, env) with the same weights, seeds and keys, in one process, alternating:
  static  ``attention_block=0`` (every prefill and decode step attends the cache's whole static width)
          and ``prefill_chunk=0`` (each prompt block runs at its static width, the longest render the
          env can produce): the compute of the rollout before it followed the real tokens
  filled  the defaults: attention walks key blocks up to the filled length, the cache is compacted
          before every turn, prompts run in chunks up to the last filled column
They attend the same keys, so the trajectories are the same up to float rounding; the script reports
whether the tokens came out identical. With ``--init sft`` (the default) the weights are the task's
cached warm start (built first when missing: minutes), whose real prompts and answers are what the
savings depend on; ``--init random`` is the worst case (no row answers, every row plays every turn).
Reports the median seconds of ``--repeats`` rollouts per side (first call of each side compiles) and
the valid tokens per row. Writes benchmarks/results/rollout_filled_<env>.json.

    .venv/bin/python benchmarks/rollout_filled.py                    # FrozenLake default, warm start
    .venv/bin/python benchmarks/rollout_filled.py --config sokoban
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ragen_jax import api  # noqa: E402
from ragen_jax.models.transformer import Transformer  # noqa: E402
from ragen_jax.rollout.fused import Rollout  # noqa: E402
from ragen_jax.train.loop import build_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="frozen_lake", help="a task name or configs/*.py file")
    parser.add_argument("--init", default="sft", choices=("sft", "random"))
    parser.add_argument("--sft-cache-dir", default=None, help="sft.cache_dir (default: the config's)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    overrides = {"init": args.init, "mi.enabled": False}
    if args.sft_cache_dir:
        overrides["sft.cache_dir"] = args.sft_cache_dir
    config = api.load_config(args.config, overrides)
    run, state = build_run(config)
    filled = run.rollout
    static_cfg = dataclasses.replace(filled.model_cfg, attention_block=0)
    static_graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(static_cfg, rngs=nnx.Rngs(0))))
    static = Rollout(static_graphdef, filled.tokenizer, filled.env,
                     dataclasses.replace(filled.config, prefill_chunk=0), filled.env_params, model_cfg=static_cfg)
    sides = {"static": static, "filled": filled}
    times = {label: [] for label in sides}
    tokens = {label: [] for label in sides}
    valid_tokens = []
    for i in range(args.repeats + 1):
        seeds = run.rollout_cfg.train_seeds(i)
        for label, rollout in sides.items():
            start = time.perf_counter()
            traj = jax.block_until_ready(rollout.run(state.actor, jax.random.key(i), seeds))
            if i:  # the first call of each side compiles
                times[label].append(time.perf_counter() - start)
            tokens[label].append(np.asarray(traj.tokens))
        valid_tokens.append(float(np.asarray(traj.valid).sum(axis=1).mean()))
    identical = all(np.array_equal(a, b) for a, b in zip(tokens["static"], tokens["filled"]))
    median = {label: statistics.median(t) for label, t in times.items()}
    layout = filled.layout
    print(f"{config.env.name} ({args.init}): {filled.config.batch} rows, {layout.max_turns} turns, static cache "
          f"{layout.cache_len} slots, {np.mean(valid_tokens):.0f} valid tokens per row; identical tokens: {identical}")
    for label in sides:
        print(f"  {label:6} {median[label]:7.2f} s per rollout  {times[label]}")
    print(f"  static / filled: {median['static'] / median['filled']:.2f}x")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"rollout_filled_{config.env.name}.json")
    out.write_text(json.dumps({
        "benchmark": "rollout_filled", "config": args.config, "init": args.init, "rows": filled.config.batch,
        "turns": layout.max_turns, "static_width": layout.cache_len, "valid_tokens_per_row": valid_tokens,
        "identical_tokens": identical, "seconds": times, "median_s": median,
        "static_over_filled": median["static"] / median["filled"],
        "backend": jax.default_backend(), "cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
        "jax_version": jax.__version__, "python": platform.python_version(),
    }, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
