"""MI cross-scoring at the rollout's static widths against the real (bucketed) widths, from the compiled programs.

The trainer packs MI pairs at prompt_len = the rollout's cache length and reasoning_len = max_new_tokens
(``train.loop.mi_pairs``); ``cross_score`` crops them to their real extents rounded up to a bucket width
(``cross_scoring.real_widths``). For both strategies at FrozenLake's default shapes (tiny preset; 4 groups
of 8 episodes, mi.num_samples = 16: first-turn 16 rows x 4 columns, trajectory 16 x 16; cache length
2,186, 96 new tokens per turn) this compiles the jitted scorer at the static and at the bucket widths and
reads XLA's memory_analysis (temp bytes) and cost_analysis (flops), then times ``--repeats`` calls of each
after a first one. The real extents are arguments (defaults: what a FrozenLake rollout's rows hold, about
1,000 real tokens in the longest row, so a last-turn prompt under that, and up to 96 reasoning tokens).

    .venv/bin/python benchmarks/mi_width.py
    .venv/bin/python benchmarks/mi_width.py --trajectory-prompt 1500 --reasoning 60 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-len", type=int, default=2186, help="static prompt width")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="static reasoning width")
    parser.add_argument("--samples", type=int, default=16, help="mi.num_samples")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--first-turn-prompt", type=int, default=200, help="longest real first-turn prompt")
    parser.add_argument("--trajectory-prompt", type=int, default=1000, help="longest real trajectory prompt")
    parser.add_argument("--reasoning", type=int, default=90, help="longest real reasoning")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="", help="write the numbers as JSON here (nothing by default)")
    return parser.parse_args()


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import jax
    import numpy as np
    from flax import nnx

    from ragen_jax.diagnostics import cross_scoring
    from ragen_jax.models.config import get_preset
    from ragen_jax.models.transformer import Transformer

    cfg = get_preset("tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    temperature = np.float32(1.0)
    strategies = {"first_turn": (args.groups, args.first_turn_prompt),
                  "trajectory": (args.samples, args.trajectory_prompt)}
    results = {}
    for name, (cols, prompt_extent) in strategies.items():
        rows = args.samples
        x = rng.integers(8, cfg.vocab_size, (cols, args.cache_len)).astype(np.int32)
        x_valid = np.zeros((cols, args.cache_len), bool)
        for j in range(cols):  # right-aligned prompts, the longest of `prompt_extent` tokens
            x_valid[j, args.cache_len - (prompt_extent if j == 0 else rng.integers(1, prompt_extent + 1)):] = True
        z = rng.integers(8, cfg.vocab_size, (rows, args.max_new_tokens)).astype(np.int32)
        z_valid = np.zeros((rows, args.max_new_tokens), bool)
        for m in range(rows):  # left-aligned reasonings, the longest of `reasoning` tokens
            z_valid[m, : args.reasoning if m == 0 else rng.integers(1, args.reasoning + 1)] = True
        full = (x, x_valid, z, z_valid)
        cropped = cross_scoring.crop_to_real_widths(*full)
        results[name] = {}
        outputs = {}
        for label, inputs in (("static", full), ("bucket", cropped)):
            inputs = tuple(jax.numpy.asarray(a) for a in inputs)
            compiled = cross_scoring._cross_score_jit.lower(
                graphdef, state, *inputs, temperature, columns_per_step=1, row_sharding=None).compile()
            memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            call = lambda: jax.block_until_ready(compiled(state, *inputs, temperature))  # noqa: E731
            start = time.perf_counter()
            outputs[label] = call()
            first = time.perf_counter() - start
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            results[name][label] = {
                "prompt_width": int(inputs[0].shape[1]), "reasoning_width": int(inputs[2].shape[1]),
                "temp_bytes": int(memory.temp_size_in_bytes), "flops": float(cost.get("flops", float("nan"))),
                "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
                "first_s": first, "steady_s": statistics.median(times),
            }
        results[name]["max_abs_difference"] = float(max(
            np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(outputs["static"], outputs["bucket"])))

    print(f"MI cross-scoring, tiny preset, {jax.default_backend()} ({os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}); static widths {args.cache_len} x {args.max_new_tokens}")
    print(f"{'strategy':<12}{'widths':<14}{'widths (Lx x Lz)':>18}{'temp MiB':>11}{'GFLOP':>10}{'steady s':>10}")
    for name, sides in results.items():
        for label in ("static", "bucket"):
            r = sides[label]
            print(f"{name:<12}{label:<14}{r['prompt_width']:>10} x {r['reasoning_width']:<5}"
                  f"{r['temp_bytes'] / 2**20:>11.1f}{r['flops'] / 1e9:>10.2f}{r['steady_s']:>10.3f}")
        print(f"{'':<12}max |static - bucket| = {sides['max_abs_difference']:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
