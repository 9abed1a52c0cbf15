"""The supervised warm-start step of a task config: seconds per step by micro-batch size and attention block.

Builds the task's demonstrations and a fresh preset model as ``--config.mode=sft`` does
(``sft.warm_start.build_parts`` / ``write_demos``), then for every ``MICRO:BLOCK`` variant compiles the
step (``make_train_step``: ``MICRO`` episodes per forward / backward pass, ``model.overrides.attention_block
= BLOCK``, 0 = one block) and times ``--steps`` steps after one warm-up step, each ending when its loss is
on the host (as the warm start's loop does). Every variant trains from the same initial weights on the
same batches. Reports the median seconds per step and the valid tokens per second; writes
benchmarks/results/sft_step_<env>.json.

    .venv/bin/python benchmarks/sft_step.py                                    # countdown, 5 variants
    .venv/bin/python benchmarks/sft_step.py --config configs/frozen_lake.py --variants 4:128 4:512
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
from flax import nnx

from ragen_jax.setup.build import build_preset_model
from ragen_jax.setup.config_file import load_config_file
from ragen_jax.sft import warm_start as W

ROOT = Path(__file__).resolve().parents[1]


def time_variant(config, parts, demos, settings, micro: int, block: int, steps: int) -> dict:
    """Seconds of each of ``steps`` timed steps (after one warm-up step) of one variant."""
    config.model.overrides.attention_block = block
    graphdef, params = nnx.split(build_preset_model(config, parts.tokenizer, settings.seed))
    tx = W.make_optimizer(settings.lr, settings.steps)
    opt_state = tx.init(params)
    step = W.make_train_step(graphdef, tx, micro)
    batches = W.DemoBatches(demos, settings.batch_size, parts.tokenizer.pad_id, settings.seed, settings.bucket)
    start = time.perf_counter()
    params, opt_state, loss, _ = step(params, opt_state, *batches.next())
    float(loss)
    compile_s = time.perf_counter() - start
    seconds, tokens = [], 0
    for _ in range(steps):
        tokens_b, valid, mask = batches.next()
        start = time.perf_counter()
        params, opt_state, loss, _ = step(params, opt_state, tokens_b, valid, mask)
        float(loss)
        seconds.append(time.perf_counter() - start)
        tokens += int(valid.sum())
    return {"micro_batch_size": micro, "attention_block": block, "first_step_s": compile_s,
            "median_step_s": statistics.median(seconds), "step_s": seconds,
            "valid_tokens_per_s": tokens / sum(seconds), "width": int(tokens_b.shape[1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/countdown.py")
    p.add_argument("--variants", nargs="+", default=["4:128", "4:0", "8:0", "16:0", "16:128"],
                   metavar="MICRO:BLOCK")
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    variants = [tuple(int(x) for x in v.split(":")) for v in a.variants]
    config = load_config_file(str(ROOT / a.config))
    parts = W.build_parts(config)
    settings = W.SFTSettings.from_config(config)
    demos = W.write_demos(parts, settings, settings.seed)
    rows = []
    for micro, block in variants:
        row = time_variant(config, parts, demos, settings, micro, block, a.steps)
        rows.append(row)
        print(f"micro-batch {micro:3d}  attention block {block:4d}: {row['median_step_s']:.3f} s/step  "
              f"{row['valid_tokens_per_s']:.0f} valid tok/s  (first step {row['first_step_s']:.1f} s)", flush=True)
    env = config.env.name
    result = {"config": a.config, "platform": platform.platform(), "processor": platform.processor(),
              "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()[0], "jax": jax.__version__,
              "batch_size": settings.batch_size, "steps": a.steps, "variants": rows}
    out = ROOT / "benchmarks" / "results" / f"sft_step_{env}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
