"""Env throughput: vmapped on-device turns (render + parse + step_turn) vs a plain-Python env.

For each env, a batch of 1024 episodes runs all its turns in one jitted program: every turn renders
the user-turn tokens, parses a response (token ids drawn from a pool of policy-like answers) and
applies it. The peer runs the same episodes through a plain-Python implementation (string render,
``re`` parse, Python step). Reported: turns/s and env actions/s of each, and the ratio.

Add an env with one ``Entry`` in ``ENTRIES`` (a factory for the JAX env, the response pool, and the
plain-Python peer). Run: ``python benchmarks/env_steps.py [--batch 1024] [--envs frozen_lake,bandit]``.
Writes ``benchmarks/results/envs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from envs.bandit import ARM_NAMES, INIT_PROMPT, SPLITS  # noqa: E402
from envs.registry import make  # noqa: E402
from envs.solvers import frozen_lake_bfs  # noqa: E402
from ragen_jax.models.tokenizers import CharTokenizer  # noqa: E402

RESPONSE_TOKENS = 96
PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
SPECIALS = ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]


def python_parse(response: str, max_actions: int = 2) -> tuple[bool, list[str]]:
    match = PATTERN.search("<think>" + response)
    if not match:
        return False, []
    answer = match.group(2)
    for special in SPECIALS:
        answer = answer.replace(special, "").strip()
    return True, [a.strip() for a in answer.split("||") if a.strip()][:max_actions]


class PyFrozenLake:
    """Plain-Python FrozenLake (deterministic), RAGEN grid_coord text."""

    LOOKUP = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    turns = 5

    def reset(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while True:
            board = rng.choice(["F", "H"], (4, 4), p=[0.9, 0.1])
            start, goal = tuple(rng.integers(4, size=2)), tuple(rng.integers(4, size=2))
            if start == goal:
                continue
            board[start], board[goal] = "S", "G"
            path = frozen_lake_bfs(["".join(r) for r in board], start, goal)
            if path is not None and len(path) <= 10:
                break
        self.board, self.pos, self.time, self.done = board, start, 0, False

    def render(self) -> str:
        cells = [(r, c) for r in range(4) for c in range(4)]
        fmt = lambda rc: f"({rc[0]}, {rc[1]})"  # noqa: E731
        tile = self.board[self.pos]
        label = "Player on goal" if tile == "G" else "Player in hole" if tile == "H" else "Player"
        lines = ["Board size: 4 rows x 4 cols (zero-indexed).",
                 "Start: " + fmt(next(rc for rc in cells if self.board[rc] == "S")),
                 "Goal: " + fmt(next(rc for rc in cells if self.board[rc] == "G")),
                 f"{label}: {fmt(self.pos)}"]
        holes = [fmt(rc) for rc in cells if self.board[rc] == "H"]
        if holes:
            lines.append("Holes: " + ", ".join(holes))
        sym = {"F": "_", "S": "_", "H": "O", "G": "G"}
        rows = []
        for r in range(4):
            row = ""
            for c in range(4):
                if (r, c) == self.pos:
                    row += "X" if tile == "H" else "\u221a" if tile == "G" else "P"
                else:
                    row += sym[self.board[r, c]]
            rows.append(row)
        return "Coordinates: \n" + "\n".join(lines) + "\nGrid Map: \n" + "\n".join(rows)

    def step_turn(self, response: str, seed: int) -> tuple[float, bool, int]:
        _, pieces = python_parse(response)
        reward, executed = 0.0, 0
        for piece in pieces:
            move = self.LOOKUP.get(piece.lower())
            if move is None or self.done or self.time >= 10:
                continue
            r = min(max(self.pos[0] + move[0], 0), 3)
            c = min(max(self.pos[1] + move[1], 0), 3)
            self.pos, self.time, executed = (r, c), self.time + 1, executed + 1
            tile = self.board[self.pos]
            reward += float(tile == "G")
            self.done = tile in "GH"
        return reward, self.done or self.time >= 10, executed


class PyBandit:
    turns = 1

    def reset(self, seed: int) -> None:
        rng = random.Random(seed)
        first, count = SPLITS["train"]
        pair = first + rng.randrange(count)
        low, high = ARM_NAMES[2 * pair], ARM_NAMES[2 * pair + 1]
        self.arms = [high, low] if rng.random() < 0.5 else [low, high]
        self.high, self.rng, self.done = high, rng, False

    def render(self) -> str:
        return INIT_PROMPT.format(name_a=self.arms[0], name_b=self.arms[1])

    def step_turn(self, response: str, seed: int) -> tuple[float, bool, int]:
        _, pieces = python_parse(response)
        names = {a.lower(): a for a in self.arms}
        valid = [names[p.lower()] for p in pieces if p.lower() in names]
        if not valid:
            return 0.0, False, 0
        arm = valid[0]
        reward = (1.0 if self.rng.random() < 0.25 else 0.0) if arm == self.high else 0.1
        self.done = True
        return reward, True, 1


def python_turn_text(obs: str, turn: int, left: int) -> str:
    return (f"\nTurn {turn}:\nState:\n{obs}\nYou have {left} actions left. Always output: <think> [Your thoughts] "
            "</think> <answer> [your answer] </answer> with no extra text. Strictly follow this format. "
            "Max response length: 120 words (tokens).\n")


def frozen_lake_responses(rng: random.Random) -> list[str]:
    names = ["Left", "Down", "Right", "Up", "up", "jump"]
    return [f"I am at the start.</think><answer>{rng.choice(names)} || {rng.choice(names)}</answer>" for _ in range(64)]


def bandit_responses(rng: random.Random) -> list[str]:
    return [f"Pick the bold one.</think><answer>{rng.choice(ARM_NAMES[:24])}</answer>" for _ in range(64)]


@dataclass(frozen=True)
class Entry:
    name: str
    responses: Callable[[random.Random], list[str]]
    python_env: Callable[[], object]
    turns: int


ENTRIES = {
    "frozen_lake": Entry("frozen_lake", frozen_lake_responses, PyFrozenLake, 5),
    "bandit": Entry("bandit", bandit_responses, PyBandit, 1),
}


def encode_responses(pool: list[str], tokenizer: CharTokenizer) -> tuple[jax.Array, jax.Array]:
    """The response pool as token ids: (int32[P, RESPONSE_TOKENS], int32[P] lengths)."""
    tokens = np.zeros((len(pool), RESPONSE_TOKENS), np.int32)
    lengths = np.zeros((len(pool),), np.int32)
    for i, text in enumerate(pool):
        ids = tokenizer.encode(text)[:RESPONSE_TOKENS]
        tokens[i, : len(ids)], lengths[i] = ids, len(ids)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def time_device_episodes(env, params, tokens: jax.Array, lengths: jax.Array, turns: int, batch: int,
                         tokenizer: CharTokenizer) -> dict:
    """``batch`` vmapped episodes of ``turns`` turns (render, parse a random pool response, step) in one
    jitted program; turns/s and actions/s over >= 2 s of repeats, and the first call's compile time."""
    layer = env.text_layer(tokenizer, params)

    def episode(key):
        k_reset, k_turns = jax.random.split(key)
        _, state = env.reset_env(k_reset, params)

        def one_turn(carry, inputs):
            state, checksum = carry
            turn, k = inputs
            k_pick, k_step = jax.random.split(k)
            obs, obs_len = layer.render_turn(state, turn)
            pick = jax.random.randint(k_pick, (), 0, tokens.shape[0])
            parsed = layer.parse(tokens[pick], lengths[pick], state)
            new_state, reward, done, info = layer.step_turn(k_step, state, parsed)
            checksum = checksum + obs_len + obs[0] + reward
            return (new_state, checksum), info["n_executed"]

        (_, checksum), executed = jax.lax.scan(
            one_turn, (state, jnp.float32(0)), (jnp.arange(1, turns + 1), jax.random.split(k_turns, turns)))
        return checksum, jnp.sum(executed)

    run = jax.jit(jax.vmap(episode))
    keys = jax.random.split(jax.random.PRNGKey(0), batch)
    start = time.perf_counter()
    jax.block_until_ready(run(keys))
    compile_s = time.perf_counter() - start
    reps, elapsed, actions = 0, 0.0, 0
    while elapsed < 2.0 or reps < 3:
        keys = jax.random.split(jax.random.PRNGKey(reps + 1), batch)
        start = time.perf_counter()
        _, executed = jax.block_until_ready(run(keys))
        elapsed += time.perf_counter() - start
        reps, actions = reps + 1, actions + int(executed.sum())
    return {"turns_per_s": reps * batch * turns / elapsed, "actions_per_s": actions / elapsed,
            "compile_s": compile_s}


def device_episodes(entry: Entry, batch: int, tokenizer: CharTokenizer) -> dict:
    env, params = make(entry.name)
    tokens, lengths = encode_responses(entry.responses(random.Random(0)), tokenizer)
    return time_device_episodes(env, params, tokens, lengths, entry.turns, batch, tokenizer)


def python_episodes(entry: Entry, episodes: int) -> dict:
    pool = entry.responses(random.Random(0))
    rng = random.Random(1)
    env = entry.python_env()
    start = time.perf_counter()
    turns = actions = 0
    for seed in range(episodes):
        env.reset(seed)
        for turn in range(1, entry.turns + 1):
            python_turn_text(env.render(), turn, 10)
            _, done, executed = env.step_turn(rng.choice(pool), seed)
            turns, actions = turns + 1, actions + executed
    elapsed = time.perf_counter() - start
    # As in the rollout, finished episodes still occupy their turn slots on device; count those too.
    return {"turns_per_s": episodes * entry.turns / elapsed, "actions_per_s": actions / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--envs", default=",".join(ENTRIES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "envs.json"))
    args = parser.parse_args()
    tokenizer = CharTokenizer()
    results = {"backend": jax.default_backend(), "batch": args.batch, "envs": {}}
    print(f"{'env':<12} {'device turns/s':>15} {'python turns/s':>15} {'ratio':>8} {'device actions/s':>17} {'compile s':>10}")
    for name in args.envs.split(","):
        if name not in ENTRIES:
            raise SystemExit(f"unknown env {name!r}; benchmarked envs: {sorted(ENTRIES)}")
        entry = ENTRIES[name]
        device = device_episodes(entry, args.batch, tokenizer)
        python = python_episodes(entry, args.batch)
        ratio = device["turns_per_s"] / python["turns_per_s"]
        results["envs"][name] = {"device": device, "python": python, "ratio_turns": ratio}
        print(f"{name:<12} {device['turns_per_s']:>15.0f} {python['turns_per_s']:>15.0f} {ratio:>8.1f} "
              f"{device['actions_per_s']:>17.0f} {device['compile_s']:>10.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
