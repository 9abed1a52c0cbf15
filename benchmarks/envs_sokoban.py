"""Sokoban throughput: vmapped on-device turns (render + parse + step_turn) vs a plain-Python env.

The structure of ``benchmarks/env_steps.py`` (whose episode loop and parser it uses): a batch of 1024
episodes runs all its 5 turns in one jitted program; every turn renders the user-turn tokens, parses
a response (token ids drawn from a pool of policy-like answers, 2 actions each) and applies it.
Two device variants: "generate" (the level is generated inside the jitted reset: room random walk
plus the exact state-space search) and "pool" (reset draws from a level pool built on device
beforehand, as the 8x8 variant does). The peer runs the same episodes (the same levels, copied to
the host, so its reset costs nothing) through a plain-Python implementation: string render in
RAGEN's grid_coord format, ``re`` parse, Python push/reward step. Reported: turns/s and env
actions/s of each, and the ratio device/python.

Run: ``python benchmarks/envs_sokoban.py [--batch 1024]``. Writes ``benchmarks/results/envs_sokoban.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.env_steps import encode_responses, python_parse, python_turn_text, time_device_episodes  # noqa: E402
from envs.sokoban import SokobanEnv  # noqa: E402
from envs.sokoban_generator import make_level_pool  # noqa: E402
from ragen_jax.models.tokenizers import CharTokenizer  # noqa: E402

TURNS = 5
MAX_ACTIONS = 10


class PySokoban:
    """Plain-Python Sokoban on given levels (gym_sokoban rules, RAGEN grid_coord text)."""

    LOOKUP = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    SYMBOLS = {0: "#", 1: "_", 2: "O"}

    def __init__(self, levels) -> None:
        self.levels = levels  # host Level batch

    def reset(self, seed: int) -> None:
        self.fixed = self.levels.fixed[seed].tolist()
        self.boxes = {tuple(b) for b in np.argwhere(self.levels.boxes[seed]).tolist()}
        self.player = tuple(self.levels.player[seed].tolist())
        self.targets = {(r, c) for r, row in enumerate(self.fixed) for c, v in enumerate(row) if v == 2}
        self.time, self.done = 0, False

    def render(self) -> str:
        rows, cols = len(self.fixed), len(self.fixed[0])
        fmt = lambda cells: ", ".join(f"({r}, {c})" for r, c in sorted(cells))  # noqa: E731
        lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed).", "Targets: " + fmt(self.targets)]
        off, on = self.boxes - self.targets, self.boxes & self.targets
        if off:
            lines.append("Boxes: " + fmt(off))
        if on:
            lines.append("Boxes on target: " + fmt(on))
        label = "Player on target" if self.player in self.targets else "Player"
        lines.append(f"{label}: " + fmt([self.player]))
        grid = []
        for r in range(rows):
            row = ""
            for c in range(cols):
                cell, target = (r, c), (r, c) in self.targets
                if cell == self.player:
                    row += "S" if target else "P"
                elif cell in self.boxes:
                    row += "√" if target else "X"
                else:
                    row += self.SYMBOLS[self.fixed[r][c]]
            grid.append(row)
        return "Coordinates: \n" + "\n".join(lines) + "\nGrid Map: \n" + "\n".join(grid)

    def _free(self, cell) -> bool:
        r, c = cell
        return 0 <= r < len(self.fixed) and 0 <= c < len(self.fixed[0]) and self.fixed[r][c] != 0

    def step_turn(self, response: str, seed: int) -> tuple[float, bool, int]:
        _, pieces = python_parse(response)
        reward, executed = 0.0, 0
        for piece in pieces:
            move = self.LOOKUP.get(piece.lower())
            if move is None or self.done or self.time >= MAX_ACTIONS:
                continue
            before = len(self.boxes & self.targets)
            nxt = (self.player[0] + move[0], self.player[1] + move[1])
            far = (nxt[0] + move[0], nxt[1] + move[1])
            if self._free(nxt) and nxt not in self.boxes:
                self.player = nxt
            elif self._free(nxt) and self._free(far) and far not in self.boxes:
                self.boxes = (self.boxes - {nxt}) | {far}
                self.player = nxt
            after = len(self.boxes & self.targets)
            self.done = after == len(self.boxes)
            reward += -0.1 + (after > before) - (after < before) + 10.0 * self.done
            self.time, executed = self.time + 1, executed + 1
        return reward, self.done or self.time >= MAX_ACTIONS, executed


def sokoban_responses(rng: random.Random) -> list[str]:
    names = ["Up", "Down", "Left", "Right", "up", "jump"]
    return [f"The box is next to me.</think><answer>{rng.choice(names)} || {rng.choice(names)}</answer>"
            for _ in range(64)]


def device_episodes(params, batch: int, tokenizer: CharTokenizer) -> dict:
    tokens, lengths = encode_responses(sokoban_responses(random.Random(0)), tokenizer)
    return time_device_episodes(SokobanEnv(), params, tokens, lengths, TURNS, batch, tokenizer)


def python_episodes(levels, episodes: int) -> dict:
    pool = sokoban_responses(random.Random(0))
    rng = random.Random(1)
    env = PySokoban(levels)
    start = time.perf_counter()
    actions = 0
    for seed in range(episodes):
        env.reset(seed)
        for turn in range(1, TURNS + 1):
            python_turn_text(env.render(), turn, MAX_ACTIONS - env.time)
            _, done, executed = env.step_turn(rng.choice(pool), seed)
            actions += executed
    elapsed = time.perf_counter() - start
    # As in the rollout, finished episodes still occupy their turn slots on device; count those too.
    return {"turns_per_s": episodes * TURNS / elapsed, "actions_per_s": actions / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "envs_sokoban.json"))
    args = parser.parse_args()
    tokenizer = CharTokenizer()
    env = SokobanEnv()
    base = env.default_params
    start = time.perf_counter()
    levels = jax.block_until_ready(make_level_pool(jax.random.PRNGKey(0), args.batch, base.spec, chunk_size=256))
    pool_build_s = time.perf_counter() - start
    host_levels = jax.tree.map(np.asarray, levels)
    results = {"backend": jax.default_backend(), "batch": args.batch, "pool_build_s": pool_build_s, "envs": {}}
    python = python_episodes(host_levels, args.batch)
    print(f"{'env':<18} {'device turns/s':>15} {'python turns/s':>15} {'ratio':>8} {'device actions/s':>17} {'compile s':>10}")
    for name, params in (("sokoban_generate", base), ("sokoban_pool", env.pool_params(levels, base.spec))):
        device = device_episodes(params, args.batch, tokenizer)
        ratio = device["turns_per_s"] / python["turns_per_s"]
        results["envs"][name] = {"device": device, "python": python, "ratio_turns": ratio}
        print(f"{name:<18} {device['turns_per_s']:>15.0f} {python['turns_per_s']:>15.0f} {ratio:>8.2f} "
              f"{device['actions_per_s']:>17.0f} {device['compile_s']:>10.1f}")
    print(f"level pool of {args.batch} built on device in {pool_build_s:.1f} s (compile included)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
