"""The update at the batch's bucket width (and with remat) against the update at the rollout's static width.

A task config's update step (``train.loop.build_run``: the tiny preset, the config's rows, mini-batch and
micro-batch sizes, its estimator) runs on one batch of synthetic episodes, right-padded to the rollout's
static width (``Rollout.layout.cache_len``) as a rollout leaves them, with row lengths drawn uniformly from
``--lengths LO HI`` (default 700..1000: FrozenLake's warm-started rollouts hold 874 valid tokens per row on
average, the longest row ~1,000). Update steps on the same batch and parameters (``--variants``, default all);
all but the last with ``algorithm.pack_rows=False`` (one episode per row):
  static         ``algorithm.width_buckets=1``, ``attention_block=0``: the program runs over every slot of
                 the static width and keeps every block's [B, H, T, T] attention scores for the backward pass
  bucket         ``width_buckets=8`` (the default), ``attention_block=0``: rows cropped to the longest row
                 rounded up to a bucket width, attention scores still materialised
  bucket+blocks  also blockwise causal attention (``models/attention.causal_attention``)
  +remat         bucket+blocks and ``algorithm.remat``: each block recomputed in the backward pass
  micro2, micro8 bucket+blocks with ``algorithm.micro_batch_size`` 2 or 8 rows per forward / backward pass
  packed         the defaults: bucket+blocks with each mini-batch's rows packed (``rl/packing.py``), empty
                 micro-batches skipped
For each: from the compiled program (``jax.jit(...).lower(...).compile()``), XLA's temp memory
(``memory_analysis().temp_size_in_bytes``), ``cost_analysis()`` FLOPs and bytes accessed (XLA counts a
while loop's body once: they are one micro-batch's, and for the blockwise variants leave out all but one
attention block); then
the median wall time of ``--repeats`` calls, the sides alternating. Ratios first variant / each. Writes
benchmarks/results/update_width_<env>.json.

    .venv/bin/python benchmarks/update_width.py                                  # FrozenLake default
    .venv/bin/python benchmarks/update_width.py --config configs/sokoban.py
    .venv/bin/python benchmarks/update_width.py --variants bucket bucket+blocks   # without the slow static side
    .venv/bin/python benchmarks/update_width.py --variants bucket+blocks packed --lengths 150 1000
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

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ragen_jax import api  # noqa: E402
from ragen_jax.rollout.trajectories import finalize  # noqa: E402
from ragen_jax.rl.state import TrainState  # noqa: E402
from ragen_jax.rl.update import update_width  # noqa: E402
from ragen_jax.train.loop import build_run  # noqa: E402


def synthetic_batch(rows: int, width: int, turns: int, lengths: np.ndarray, vocab: int, seed: int):
    """Right-padded episodes of the given lengths: a prompt of 1/4 of each row, then alternating turns
    whose second halves are generated (loss) tokens; rewards vary within every group of 8."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((rows, width), np.int32)
    valid = np.zeros((rows, width), bool)
    loss = np.zeros((rows, width), bool)
    turn_ids = np.zeros((rows, width), np.int32)
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(8, vocab, n)
        valid[r, :n] = True
        edges = np.linspace(0, n, turns + 1).astype(int)
        for t in range(turns):
            a, b = edges[t], edges[t + 1]
            turn_ids[r, a:b] = t
            loss[r, (a + b) // 2:b] = True
    logprobs = np.where(loss, -rng.uniform(0.1, 4.0, (rows, width)), 0.0).astype(np.float32)
    rewards = rng.normal(size=(rows, 1)).astype(np.float32)
    z = lambda dtype: np.zeros((rows, turns), dtype)  # noqa: E731
    return finalize(
        tokens=jnp.asarray(tokens), valid=jnp.asarray(valid), loss_mask=jnp.asarray(loss),
        logprobs=jnp.asarray(logprobs), entropy=jnp.zeros((rows, width)), turn_ids=jnp.asarray(turn_ids),
        reasoning_mask=jnp.zeros((rows, width), bool), prompt_spans=jnp.zeros((rows, turns, 2), jnp.int32),
        turn_active=jnp.ones((rows, turns), bool), turn_rewards=jnp.asarray(np.pad(rewards, ((0, 0), (0, turns - 1)))),
        turn_penalties=jnp.asarray(z(np.float32)), turn_format_ok=jnp.ones((rows, turns), bool),
        turn_valid_actions=jnp.asarray(z(np.int32)), turn_executed=jnp.asarray(z(np.int32)),
        response_lengths=jnp.asarray(z(np.int32)), success=jnp.zeros(rows, bool),
        group_ids=jnp.arange(rows) // 8, seeds=jnp.arange(rows) // 8, episode_ids=jnp.arange(rows),
        sample_turn=jnp.full(rows, -1),
    )


ROWS = {"algorithm.pack_rows": False}
VARIANTS = {  # config overrides of each side; "attention_block" goes to model.overrides (a ModelConfig field)
    "static": {**ROWS, "algorithm.width_buckets": 1, "attention_block": 0},
    "bucket": {**ROWS, "attention_block": 0},
    "bucket+blocks": ROWS,
    "+remat": {**ROWS, "algorithm.remat": True},
    "micro2": {**ROWS, "algorithm.micro_batch_size": 2},
    "micro8": {**ROWS, "algorithm.micro_batch_size": 8},
    "packed": {},
}


def variant_config(name: str, preset: str, label: str):
    settings = dict(VARIANTS[label])
    block = settings.pop("attention_block", None)
    config = api.load_config(name, {"init": "random", "mi.enabled": False, **settings}, preset=preset or None)
    if block is not None:
        with config.unlocked():
            config.model.overrides.attention_block = block
    return config


def compiled_facts(step, state: TrainState, traj, key) -> dict:
    """Temp memory, FLOPs and bytes accessed of the program the step runs for ``traj``."""
    cropped = step.fit_width(traj)
    compiled = step.program.lower(state.trained(), state.ref, cropped, key, traj.seq_len).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    return {"width": cropped.seq_len, "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes), "flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="frozen_lake", help="a task name or configs/*.py file (file.py:preset)")
    parser.add_argument("--lengths", nargs=2, type=int, default=(700, 1000), metavar=("LO", "HI"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    name, _, preset = args.config.partition(":")
    runs = {}
    for label in args.variants:
        config = variant_config(name, preset, label)
        runs[label] = build_run(config)
    run, state = runs[args.variants[0]]
    width = run.rollout.layout.cache_len
    rows = run.rollout_cfg.batch
    lo, hi = args.lengths
    if not 0 < lo <= hi <= width:
        raise SystemExit(f"--lengths must satisfy 0 < LO <= HI <= the static width {width}")
    lengths = np.random.default_rng(0).integers(lo, hi + 1, rows)
    traj = synthetic_batch(rows, width, run.rollout_cfg.max_turns, lengths, run.tokenizer.vocab_size, 0)
    cfg = run.update_step.config
    steps = {label: r.update_step for label, (r, _) in runs.items()}
    key = jax.random.key(0)
    copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)  # noqa: E731
    facts = {label: compiled_facts(step, state, traj, key) for label, step in steps.items()}
    times = {label: [] for label in steps}
    for i in range(args.repeats + 1):
        for label, step in steps.items():
            s = state.replace(**copy(state.trained()))
            t0 = time.perf_counter()
            jax.block_until_ready(step(s, traj, key).metrics)
            if i:  # the first call of each side compiles
                times[label].append(time.perf_counter() - t0)
    for label in steps:
        facts[label]["steady_s"] = statistics.median(times[label])
        facts[label]["runs_s"] = times[label]
    first = args.variants[0]
    s = facts[first]
    ratios = {label: {k: s[k] / f[k] for k in ("temp_bytes", "flops", "bytes_accessed", "steady_s") if f[k]}
              for label, f in facts.items() if label != first}
    print(f"{config.env.name}: {rows} rows, static width {width}, row lengths {lo}..{hi} "
          f"(longest {int(lengths.max())}), bucket width "
          f"{update_width(int(lengths.max()), width, cfg.width_buckets)}")
    print(f"| {'':13} | width | temp GB | GFLOP | GB accessed | s/update | {first} / this |")
    print("|---|---|---|---|---|---|---|")
    for label, f in facts.items():
        ratio = "" if label == first else f"{ratios[label]['steady_s']:.2f}x"
        print(f"| {label:13} | {f['width']} | {f['temp_bytes'] / 1e9:.2f} | {f['flops'] / 1e9:.0f} | "
              f"{f['bytes_accessed'] / 1e9:.1f} | {f['steady_s']:.2f} | {ratio} |")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"update_width_{config.env.name}.json")
    out.write_text(json.dumps({
        "benchmark": "update_width", "config": args.config, "rows": rows, "static_width": width,
        "variant_settings": {label: VARIANTS[label] for label in args.variants},
        "lengths": [lo, hi], "longest": int(lengths.max()), "valid_tokens": int(lengths.sum()),
        "mini_batch_size": cfg.mini_batch_size, "micro_batch_size": cfg.micro_batch_size,
        "adv_estimator": cfg.adv_estimator, "variants": facts, "ratios_static_over": ratios,
        "backend": jax.default_backend(), "cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
        "jax_version": jax.__version__, "python": platform.python_version(),
    }, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
