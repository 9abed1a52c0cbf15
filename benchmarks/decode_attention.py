"""A decode step's attention on CPU: the library's per-head products against the one batched dot.

One query per row attends a KV buffer of S slots (``models.attention.masked_attention``; the tiny
preset's heads: 2 key/value heads of 2 query heads each, head size 64; 32 rows, a FrozenLake rollout's
batch). ``dot`` is the same attention with the scores as one [G, D] x [D, S] dot per (row, key head),
what accelerators run; ``library`` is ``masked_attention`` itself, which on XLA:CPU computes the scores
as G matrix-vector products (``query_key_scores``). ``walk`` is ``prefix_attention``'s block walk up to
``--filled`` slots of the largest buffer. Reports the best mean of ``--repeats`` rounds per width, the
ratio, and the largest difference of the outputs. Writes benchmarks/results/decode_attention.json.

    .venv/bin/python benchmarks/decode_attention.py
    .venv/bin/python benchmarks/decode_attention.py --widths 640 2186 --query-heads 7
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ragen_jax.models.attention import MASKED, masked_attention, prefix_attention  # noqa: E402


def one_dot_attention(q, k, v, mask):
    """masked_attention with the scores as one batched dot (the formulation accelerators run)."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None, None], scores, MASKED)
    return jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(scores, axis=-1), v)


def best_ms(fn, *args, calls: int, repeats: int) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / calls * 1e3)
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--query-heads", type=int, default=2, help="query heads per key/value head (G)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 640, 1152, 2186])
    parser.add_argument("--filled", type=int, default=900, help="filled slots for the block walk")
    parser.add_argument("--block", type=int, default=128, help="the walk's key block (attention_block)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_attention.json"))
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    b, kh, g, d = args.rows, args.kv_heads, args.query_heads, args.head_dim
    rows = {}
    for s in args.widths:
        q = jnp.asarray(rng.normal(size=(b, kh, g, 1, d)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(b, kh, s, d)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(b, kh, s, d)), jnp.float32)
        mask = jnp.asarray(rng.random((b, 1, s)) < 0.9)
        dot = best_ms(one_dot_attention, q, k, v, mask, calls=args.calls, repeats=args.repeats)
        ours = best_ms(masked_attention, q, k, v, mask, calls=args.calls, repeats=args.repeats)
        diff = float(jnp.max(jnp.abs(masked_attention(q, k, v, mask) - one_dot_attention(q, k, v, mask))))
        rows[str(s)] = {"dot_ms": dot, "library_ms": ours, "speedup": dot / ours, "max_abs_diff": diff}
        print(f"{s:5d} slots: dot {dot:6.2f} ms  library {ours:6.2f} ms  {dot / ours:4.2f}x  (max |diff| {diff:.1e})")

    s, filled = max(args.widths), min(args.filled, max(args.widths))
    slot_valid = jnp.asarray(rng.random((b, s)) < 0.9)
    query_slot = jnp.array([filled - 1])

    def walk(q, k, v):
        return prefix_attention(q, k, v, slot_valid, query_slot, jnp.int32(filled), args.block)

    walked = best_ms(walk, q, k, v, calls=args.calls, repeats=args.repeats)
    print(f"prefix_attention, {filled} of {s} slots filled, blocks of {args.block}: {walked:6.2f} ms")

    result = {
        "benchmark": "decode attention (one query per row)", "rows": b, "kv_heads": kh, "query_heads": g,
        "head_dim": d, "widths": rows, "prefix_attention": {"width": s, "filled": filled, "block": args.block,
                                                             "ms": walked},
        "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0], "jax": jax.__version__,
        "backend": jax.default_backend(), "platform": platform.platform(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
