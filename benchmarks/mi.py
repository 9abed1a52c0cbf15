"""Cross-scoring of the MI proxies: prefix-reusing KV caches against naive full-sequence scoring.

The trajectory strategy of RAGEN-2 (64 draws, one column each: a 64 x 64 matrix) on the ``tiny``
preset, on CPU. A synthetic multi-turn batch (observation, <think>, reasoning, </think>, answer per
turn) is sampled with ``sample_trajectory_pairs``; then both scorers compute the same [M, N]
matrices from the same packed prompts and reasonings:
  prefix reuse: N prompt prefills + M * N reasoning continuations on cached prefixes;
  naive:        M * N full forwards over [x_j ; z_m] (what RAGEN's loop over columns does).
Both loop over columns with ``lax.map`` (``--columns-per-step`` vmapped per step) inside one jit.
The first call of each includes compilation (reported separately); the median of ``--repeats``
later calls is the steady-state time. Writes benchmarks/results/mi.json.

    .venv/bin/python benchmarks/mi.py                          # 64 x 64, prompt <= 64, reasoning <= 16
    .venv/bin/python benchmarks/mi.py --prompt-len 128 --reasoning-len 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64, help="draws = rows = columns")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64, help="static prompt bound (tokens)")
    parser.add_argument("--reasoning-len", type=int, default=16, help="static reasoning bound")
    parser.add_argument("--columns-per-step", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per side (median kept)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "mi.json"))
    return parser.parse_args()


def synthetic_batch(rng, num_traj: int, turns: int, prompt_len: int, reasoning_len: int, vocab: int):
    """A multi-turn batch whose contexts fit prompt_len; per turn: obs, <think>, z, </think>, answer."""
    import numpy as np

    think, end_think = 3, 4
    # The last turn's context: (turns - 1) whole turns + its observation + <think> <= prompt_len.
    per_turn = (prompt_len - 1 - (turns - 1) * (reasoning_len + 4)) // turns
    if per_turn < 2:
        raise SystemExit(f"prompt_len {prompt_len} is too short for {turns} turns of reasoning "
                         f"{reasoning_len}; raise --prompt-len or lower --turns.")
    length = turns * (per_turn + reasoning_len + 4) + 8
    tokens = np.zeros((num_traj, length), np.int32)
    reasoning = np.zeros((num_traj, length), bool)
    turn_ids = np.full((num_traj, length), -1, np.int32)
    for b in range(num_traj):
        pos = 0
        for t in range(turns):
            obs = rng.integers(8, vocab, rng.integers(per_turn // 2, per_turn + 1))
            z = rng.integers(8, vocab, rng.integers(reasoning_len // 2, reasoning_len + 1))
            answer = rng.integers(8, vocab, 2)
            segment = [*obs, think, *z, end_think, *answer]
            tokens[b, pos : pos + len(segment)] = segment
            turn_ids[b, pos : pos + len(segment)] = t
            start = pos + len(obs) + 1
            reasoning[b, start : start + len(z)] = True
            pos += len(segment)
    return tokens, tokens > 0, reasoning, turn_ids


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import jax
    import numpy as np
    from flax import nnx

    from ragen_jax.diagnostics.cross_scoring import cross_score, naive_cross_score
    from ragen_jax.diagnostics.mi import mi_metrics
    from ragen_jax.diagnostics.mi_sampling import sample_trajectory_pairs
    from ragen_jax.models.config import get_preset
    from ragen_jax.models.transformer import Transformer

    cfg = get_preset("tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batch = synthetic_batch(rng, args.trajectories, args.turns, args.prompt_len, args.reasoning_len,
                            cfg.vocab_size)
    sample = jax.jit(sample_trajectory_pairs,
                     static_argnames=("num_samples", "max_turns", "prompt_len", "reasoning_len"))
    pairs = sample(jax.random.key(0), *batch, num_samples=args.samples, max_turns=args.turns,
                   prompt_len=args.prompt_len, reasoning_len=args.reasoning_len)
    if int(pairs.num_truncated):
        raise SystemExit(f"{int(pairs.num_truncated)} pairs do not fit the static bounds; raise them.")
    inputs = (pairs.x_tokens, pairs.x_valid, pairs.z_tokens, pairs.z_valid)
    rows, cols = pairs.z_tokens.shape[0], pairs.x_tokens.shape[0]
    prompt_tokens = int(np.asarray(pairs.x_valid).sum())
    reasoning_tokens = int(np.asarray(pairs.z_valid).sum())

    def timed(fn):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(model, *inputs, 1.0, columns_per_step=args.columns_per_step))
        first = time.perf_counter() - start
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = jax.block_until_ready(fn(model, *inputs, 1.0, columns_per_step=args.columns_per_step))
            times.append(time.perf_counter() - start)
        steady = statistics.median(times)
        return out, {"first_call_s": first, "compile_s_approx": max(first - steady, 0.0),
                     "steady_s": steady, "runs_s": times}

    prefix_out, prefix = timed(cross_score)
    naive_out, naive = timed(naive_cross_score)
    max_diff = float(max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(prefix_out, naive_out)))
    metrics = mi_metrics(*prefix_out, pairs.true_col, pairs.col_signature,
                         row_valid=pairs.row_valid, col_valid=pairs.col_valid)
    ratio = naive["steady_s"] / prefix["steady_s"]

    print(f"cross-scoring {rows} x {cols} (trajectory strategy), tiny preset, CPU "
          f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    print(f"prompt slots {args.prompt_len} ({prompt_tokens / cols:.1f} real tokens/column), "
          f"reasoning slots {args.reasoning_len} ({reasoning_tokens / rows:.1f} real tokens/row)")
    print(f"{'scorer':<14}{'steady (s)':>12}{'first call (s)':>16}{'token positions':>18}")
    print(f"{'prefix reuse':<14}{prefix['steady_s']:>12.3f}{prefix['first_call_s']:>16.3f}"
          f"{cols * args.prompt_len + rows * cols * args.reasoning_len:>18d}")
    print(f"{'naive':<14}{naive['steady_s']:>12.3f}{naive['first_call_s']:>16.3f}"
          f"{rows * cols * (args.prompt_len + args.reasoning_len):>18d}")
    print(f"speed-up (naive / prefix reuse): {ratio:.2f}x   max |difference|: {max_diff:.2e}")
    print(f"mi_estimate {float(metrics['mi_estimate']):.4f}  retrieval_accuracy "
          f"{float(metrics['retrieval_accuracy']):.3f}  (random weights: near chance expected)")

    result = {
        "benchmark": "mi_cross_scoring",
        "preset": "tiny",
        "rows": rows, "columns": cols,
        "prompt_len": args.prompt_len, "reasoning_len": args.reasoning_len,
        "columns_per_step": args.columns_per_step,
        "real_prompt_tokens_per_column": prompt_tokens / cols,
        "real_reasoning_tokens_per_row": reasoning_tokens / rows,
        "prefix_reuse": prefix, "naive": naive,
        "speedup_naive_over_prefix": ratio,
        "max_abs_difference": max_diff,
        "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "jax": jax.__version__, "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
