"""Fused (one jitted program) vs host-stepped rollouts: trajectories/s and generated tokens/s on CPU.

Same model (the ``tiny`` preset, random weights, character tokenizer), same envs (Sokoban, FrozenLake),
same seeds and keys in both modes; the two produce identical trajectories (tests/test_rollout.py), so
the comparison is pure engine overhead. A random policy never answers in format, so every row plays
every turn: the worst case for both paths. Compilation is excluded (one warm-up run per mode).

FrozenLake also runs host-stepped through the host-env bridge (``rollout/host_pool.py``): the same
``TextEnvHost`` rows in 2 spawned worker processes ("pool2"), against the in-process host path ("host")
and the fused program, the cost of stepping envs out of process (IPC, one worker's JAX per process).

The host path's time is split into prefill, decode and env (rendering, tokenizing, parsing and
stepping on the host) by timing each phase; the fused program cannot be split from the outside, so
its env share is estimated as its total minus the host path's prefill + decode (the same compiled
sampler work).

    python benchmarks/rollout.py [--groups 2 --group-size 4 --turns 3 --new-tokens 48 --repeats 3 --workers 2]
Writes benchmarks/results/rollout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from envs.frozen_lake import FrozenLake  # noqa: E402
from envs.sokoban import SokobanEnv  # noqa: E402
from ragen_jax.models.config import get_preset  # noqa: E402
from ragen_jax.models.tokenizers import CharTokenizer  # noqa: E402
from ragen_jax.models.transformer import Transformer  # noqa: E402
from ragen_jax.rollout.fused import Rollout  # noqa: E402
from ragen_jax.rollout.host_envs import TextEnvHostFactory  # noqa: E402
from ragen_jax.rollout.host_pool import HostEnvPool  # noqa: E402
from ragen_jax.rollout.layout import RolloutConfig  # noqa: E402


def measure(rollout: Rollout, params, seeds, repeats: int, mode: str) -> dict[str, float]:
    timer: dict[str, float] | None = None
    start = time.perf_counter()
    jax.block_until_ready(rollout.run(params, jax.random.key(0), seeds, mode=mode))  # compile + warm up
    compile_s = time.perf_counter() - start
    total, tokens, rows = 0.0, 0, 0
    timer = {} if mode == "host" else None
    for r in range(repeats):
        start = time.perf_counter()
        traj = rollout.run(params, jax.random.key(r + 1), seeds, mode=mode, timer=timer)
        jax.block_until_ready(traj)
        total += time.perf_counter() - start
        tokens += int(np.asarray(traj.loss_mask).sum())
        rows += traj.num_rows
    out = {"seconds_per_rollout": total / repeats, "trajectories_per_s": rows / total,
           "generated_tokens_per_s": tokens / total, "first_call_s": compile_s}
    if timer is not None:
        for phase in ("prefill", "decode", "env"):
            out[f"{phase}_s"] = timer.get(phase, 0.0) / repeats
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the FrozenLake pool row")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "rollout.json"))
    args = parser.parse_args()

    cfg = get_preset("tiny")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    _, params = nnx.split(model)
    tokenizer = CharTokenizer()
    config = RolloutConfig(n_groups=args.groups, group_size=args.group_size, max_turns=args.turns,
                           max_new_tokens=args.new_tokens, prompt_style="compact")
    seeds = config.train_seeds(0)
    results = {"device": jax.devices()[0].device_kind, "platform": platform.platform(), "model": "tiny",
               "batch": config.batch, "max_turns": config.max_turns, "max_new_tokens": config.max_new_tokens,
               "envs": {}}
    print(f"{'env':<11}{'mode':<7}{'traj/s':>9}{'gen tok/s':>11}{'s/rollout':>11}{'prefill':>9}{'decode':>9}{'env':>9}")
    for name, env in (("sokoban", SokobanEnv()), ("frozen_lake", FrozenLake())):
        rollout = Rollout(model, tokenizer, env, config)
        fused = measure(rollout, params, seeds, args.repeats, "fused")
        host = measure(rollout, params, seeds, args.repeats, "host")
        model_s = host["prefill_s"] + host["decode_s"]
        fused["env_s_estimate"] = max(fused["seconds_per_rollout"] - model_s, 0.0)
        speedup = fused["trajectories_per_s"] / host["trajectories_per_s"]
        results["envs"][name] = {"fused": fused, "host": host, "fused_over_host": speedup,
                                 "cache_len": rollout.cache_len, "kv_cache_bytes": rollout.memory_bytes()}
        for mode, r in (("fused", fused), ("host", host)):
            split = (f"{r['prefill_s']:>9.3f}{r['decode_s']:>9.3f}{r['env_s']:>9.3f}" if mode == "host"
                     else f"{'':>9}{'':>9}{r['env_s_estimate']:>8.3f}~")
            print(f"{name:<11}{mode:<7}{r['trajectories_per_s']:>9.2f}{r['generated_tokens_per_s']:>11.1f}"
                  f"{r['seconds_per_rollout']:>11.3f}{split}")
        print(f"{name:<11}fused / host throughput ratio: {speedup:.2f}x")
        if name == "frozen_lake" and args.workers > 0:
            factory = TextEnvHostFactory(name, tokenizer, {}, config.prompt_style, config.max_actions_per_turn,
                                         config.max_new_tokens)
            with HostEnvPool(factory, args.workers, timeout_s=120.0) as pool:
                pooled = Rollout(model, tokenizer, env, config, host_envs=pool)
                r = measure(pooled, params, seeds, args.repeats, "host")
            label = f"pool{args.workers}"
            results["envs"][name][label] = r
            results["envs"][name][f"{label}_over_host"] = r["trajectories_per_s"] / host["trajectories_per_s"]
            results["envs"][name][f"fused_over_{label}"] = fused["trajectories_per_s"] / r["trajectories_per_s"]
            print(f"{name:<11}{label:<7}{r['trajectories_per_s']:>9.2f}{r['generated_tokens_per_s']:>11.1f}"
                  f"{r['seconds_per_rollout']:>11.3f}{r['prefill_s']:>9.3f}{r['decode_s']:>9.3f}{r['env_s']:>9.3f}")
            print(f"{name:<11}{label} / host (in-process) throughput ratio: "
                  f"{results['envs'][name][f'{label}_over_host']:.2f}x; fused / {label}: "
                  f"{results['envs'][name][f'fused_over_{label}']:.2f}x")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
