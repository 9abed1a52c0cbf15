"""What a grid task's policy can do (Sokoban, FrozenLake): does it read the state off the prompt?

For each policy (the supervised warm start of the config, plus the latest checkpoint of every
``--runs`` directory) it runs validation episodes (seeds ``validation.seed + i``) at each temperature
and reports
  state copy: the compact prompt gives the state as a line of positions (Sokoban "P (r, c) X (r, c)
    O (r, c)", FrozenLake "P (r, c) G (r, c) O ...") and the warm start's demonstrations begin their
    reasoning by restating it (FrozenLake's: player and goal); ``copy_state`` = share of first turns
    whose reasoning restates all those positions correctly, ``copy_player`` = the player's position
    only. A policy that cannot read the positions off the prompt can only solve a level by chance.
  Sokoban also: success by the level's shortest solution length (``SokobanState.solution_length`` of
    the reset state): does the policy solve levels, or only those one push from done?

    .venv/bin/python benchmarks/grid_diagnosis.py --set sft.cache_dir=/tmp/ws --runs runs/sokoban-grpo-seed0
    .venv/bin/python benchmarks/grid_diagnosis.py --config configs/frozen_lake.py --sft-steps 120 360

Writes benchmarks/results/<env>_diagnosis.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The compact prompt's state line and the start of a demonstration's reasoning (ragen_jax/sft/demos.py):
# Sokoban "P (1, 1) X (2, 2) O (1, 2)" (player, box, target; "S" = player on a target), FrozenLake
# "P (3, 3) G (0, 2)" (player, goal; the prompt goes on with the holes, the reasoning does not).
STATE_LINES = {
    "sokoban": re.compile(r"[PS] \((\d+), (\d+)\) X \((\d+), (\d+)\) O \((\d+), (\d+)\)"),
    "frozen_lake": re.compile(r"P \((\d+), (\d+)\) G \((\d+), (\d+)\)"),
}


def first_turn_copy(tokenizer, traj, state_line: re.Pattern) -> tuple[float, float]:
    """(copy_state, copy_player): shares of episodes whose first response restates the state line of
    the last state given in its prompt (all three positions / the player's)."""
    import numpy as np

    t = traj.to_numpy()
    exact, player = [], []
    for row in range(t.tokens.shape[0]):
        response = t.loss_mask[row].astype(bool) & (t.turn_ids[row] == 0)
        first = int(np.argmax(response))
        prompt = tokenizer.decode(t.tokens[row, :first][t.valid[row, :first].astype(bool)].tolist())
        truth = state_line.findall(prompt)
        said = state_line.search(tokenizer.decode(t.tokens[row][response].tolist()))
        exact.append(bool(truth and said and said.groups() == truth[-1]))
        player.append(bool(truth and said and said.groups()[:2] == truth[-1][:2]))
    return float(np.mean(exact)), float(np.mean(player))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/sokoban.py")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--runs", nargs="*", default=[], help="RL run directories (their latest checkpoint)")
    parser.add_argument("--sft-steps", type=int, nargs="*", default=[],
                        help="also the warm starts built with these sft.steps (each built and cached if missing)")
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--out", default="", help="default: benchmarks/results/<env>_diagnosis.json")
    args = parser.parse_args()
    if len(set(args.runs)) != len(args.runs):
        raise SystemExit(f"--runs lists a directory twice: {args.runs}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)

    import jax
    import numpy as np
    from flax import nnx

    from ragen_jax.train.checkpoint import Checkpointer
    from ragen_jax.setup.config_file import load_config_file
    from ragen_jax.rollout.layout import env_keys
    from ragen_jax.rl.state import TrainState
    from ragen_jax.train.loop import build_run
    from ragen_jax.rollout.validation import run_validation
    from train_step import apply_overrides

    config = load_config_file(args.config)
    apply_overrides(config, args.set)
    env_name = config.env.name
    if env_name not in STATE_LINES or config.env.prompt_style != "compact":
        raise SystemExit("this diagnosis reads the compact prompt of configs/sokoban.py or configs/frozen_lake.py")
    run, state = build_run(config)
    seeds = config.validation.seed + np.arange(args.episodes)
    solution = np.zeros(args.episodes, np.int64)  # 0: no solution length (FrozenLake)
    if env_name == "sokoban":
        # The rollout resets every group from env_keys(seed); one vmapped reset gives each level's solution length.
        reset_lengths = jax.jit(jax.vmap(lambda s: run.env.reset(env_keys(s)[0], run.env_params)[1].solution_length))
        solution = np.asarray(reset_lengths(jax.numpy.asarray(seeds, jax.numpy.int32)))
    policies = {f"warm start ({config.sft.steps} SFT steps)": (state.actor, 0)}
    for steps in args.sft_steps:
        other = load_config_file(args.config)
        apply_overrides(other, [*args.set, f"sft.steps={steps}"])
        policies[f"warm start ({steps} SFT steps)"] = (build_run(other)[1].actor, 0)
    for run_dir in args.runs:
        ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
        tree, _, step = ckpt.restore(state.tree())
        ckpt.close()
        policies[f"{run_dir} step {step}"] = (TrainState.from_tree(tree).actor, step)

    results = []
    if env_name == "sokoban":
        print(f"levels by shortest solution length (1..): {np.bincount(solution)[1:].tolist()}")
    print("| policy | T | success | valid-action | copy state | copy player | success by solution length 1, 2, 3, 4, >=5 |")
    print("|---|---|---|---|---|---|---|")
    for name, (params, step) in policies.items():
        for temperature in args.temperatures:
            start = time.time()
            metrics, traj = run_validation(
                nnx.merge(run.actor_graphdef, params), run.tokenizer, run.env, run.rollout_cfg, params,
                jax.random.key(0), n_seeds=args.episodes, seeds_per_batch=min(64, args.episodes),
                greedy=False, temperature=temperature, env_params=run.env_params)
            success = traj.success.astype(np.float64)  # run_validation returns numpy
            by_length = {int(n): float(success[solution == n].mean()) for n in np.unique(solution) if n}
            bins = [success[solution == n] for n in (1, 2, 3, 4)] + [success[solution >= 5]]
            copy_state, copy_player = first_turn_copy(run.tokenizer, traj, STATE_LINES[env_name])
            results.append(dict(policy=name, step=step, temperature=temperature, metrics=metrics,
                                success_by_solution_length=by_length, copy_state=copy_state,
                                copy_player=copy_player, seconds=time.time() - start))
            print(f"| {name} | {temperature} | {metrics['success']:.3f} | {metrics['valid_action_rate']:.2f} | "
                  f"{copy_state:.3f} | {copy_player:.3f} | "
                  + ", ".join(f"{b.mean():.2f}" if b.size else "-" for b in bins) + " |", flush=True)
    out = dict(config=args.config, overrides=args.set, episodes=args.episodes,
               levels_by_solution_length={int(n): int(c) for n, c in enumerate(np.bincount(solution)) if c and n},
               results=results)
    path = Path(args.out or ROOT / f"benchmarks/results/{env_name}_diagnosis.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
