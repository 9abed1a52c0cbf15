"""Countdown env throughput: vmapped on-device episodes vs the same episodes in plain Python.

One Countdown episode is one turn: reset (generate the task), render the user turn, parse a response,
score it. On device, a batch of episodes runs as one jitted program (``reset_env`` + ``render_turn`` +
``parse`` + ``step_turn``, vmapped). The responses are per-episode token ids prepared on the host
from the solver's equation for that episode's task, with RAGEN-style variations (wrong equations,
malformed equations, broken format), so all three rewards occur.

The peer is RAGEN's implementation, re-written in plain Python: reset reads the task row (RAGEN reads
its dataset), the turn text is an f-string, the response ids are decoded with the tokenizer, parsed
with RAGEN's regex and scored with ``re.findall`` + ``eval``. Both sides must give identical rewards;
the script checks that before timing.

Run: ``python benchmarks/envs_countdown.py [--batch 1024]``; writes
``benchmarks/results/envs_countdown.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from envs.countdown import Countdown  # noqa: E402
from envs.countdown_solver import solve  # noqa: E402
from ragen_jax.models.tokenizers import CharTokenizer  # noqa: E402

RESPONSE_TOKENS = 96
PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
SPECIALS = ["<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"]


# ----- the plain-Python peer (RAGEN's CountdownEnv + ctx_manager parsing) ----------------------------
def python_turn_text(obs: str, left: int, max_tokens: int) -> str:
    return (
        f"\nTurn 1:\nState:\n{obs}\nYou have {left} actions left. Always output: <think> [Your thoughts] "
        "</think> <answer> [your answer] </answer> with no extra text. Strictly follow this format. "
        f"Max response length: {max_tokens} words (tokens).\n"
    )


def python_episode(task: tuple[list[int], int], response: str) -> float:
    nums, target = task  # reset: RAGEN reads the row of its dataset
    python_turn_text(f"Target: {target}, nums: {nums}", 1, 100)
    match = PATTERN.search("<think>" + response)
    if not match:
        return 0.0
    answer = match.group(2)
    for special in SPECIALS:
        answer = answer.replace(special, "").strip()
    actions = [a.strip() for a in answer.split("||") if a.strip()][:1]
    if not actions:
        return 0.0
    action = actions[0]
    if sorted(int(n) for n in re.findall(r"\d+", action)) != sorted(nums):
        return 0.0
    try:
        return 1.0 if abs(eval(action, {"__builtins__": None}, {}) - target) < 1e-5 else 0.1
    except Exception:
        return 0.1


# ----- episodes -------------------------------------------------------------------------------------
def make_responses(tasks: list[tuple[list[int], int]], seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for nums, target in tasks:
        eq = solve(nums, target)
        choice = rng.random()
        if choice < 0.4:
            answer = eq
        elif choice < 0.6:
            answer = " * ".join(map(str, nums))  # right numbers, wrong value
        elif choice < 0.7:
            answer = f"({eq}"  # malformed
        elif choice < 0.8:
            answer = f"{eq} = {target}"  # an extra number
        else:
            answer = f"{rng.choice(nums)} + {rng.randint(1, 99)}"
        fmt = rng.random()
        if fmt < 0.85:
            out.append(f" Let me try {nums}.</think><answer>{answer}</answer>")
        else:
            out.append(f" Let me try {nums}.</think>{answer}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "envs_countdown.json"))
    args = parser.parse_args()

    tokenizer = CharTokenizer()
    env = Countdown()
    params = env.default_params
    layer = env.text_layer(tokenizer, params, prompt_style="ragen", max_actions_per_turn=1)
    keys = jax.random.split(jax.random.PRNGKey(0), args.batch)

    _, states = jax.jit(jax.vmap(lambda k: env.reset_env(k, params)))(keys)
    numbers, counts, targets = (np.asarray(x) for x in (states.numbers, states.n_numbers, states.target))
    tasks = [(numbers[i, : counts[i]].tolist(), int(targets[i])) for i in range(args.batch)]
    responses = make_responses(tasks)
    tokens = np.full((args.batch, RESPONSE_TOKENS), tokenizer.pad_id, np.int32)
    lengths = np.zeros((args.batch,), np.int32)
    for i, text in enumerate(responses):
        ids = tokenizer.encode(text)[:RESPONSE_TOKENS]
        tokens[i, : len(ids)], lengths[i] = ids, len(ids)
    token_lists = [tokens[i, : lengths[i]].tolist() for i in range(args.batch)]

    def episode(key, response, length):
        _, state = env.reset_env(key, params)  # the tasks the responses were written for
        k_step = jax.random.fold_in(key, 1)
        turn, turn_len = layer.render_turn(state, jnp.int32(1))
        parsed = layer.parse(response, length)
        _, reward, _, info = layer.step_turn(k_step, state, parsed)
        return reward, turn_len + turn[0]

    run = jax.jit(jax.vmap(episode))
    args_device = (keys, jnp.asarray(tokens), jnp.asarray(lengths))
    start = time.perf_counter()
    device_rewards = np.asarray(jax.block_until_ready(run(*args_device))[0])
    compile_s = time.perf_counter() - start

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eval's SyntaxWarnings on malformed answers
        python_rewards = np.asarray(
            [python_episode(task, tokenizer.decode(ids)) for task, ids in zip(tasks, token_lists)], np.float32
        )
        if not np.array_equal(device_rewards, python_rewards):
            bad = np.flatnonzero(device_rewards != python_rewards)[:5]
            raise SystemExit(f"device and Python rewards differ at {bad.tolist()}: {[responses[i] for i in bad]}")

        reps, elapsed = 0, 0.0
        while elapsed < args.min_seconds or reps < 3:
            start = time.perf_counter()
            jax.block_until_ready(run(*args_device))
            elapsed, reps = elapsed + time.perf_counter() - start, reps + 1
        device_rate = reps * args.batch / elapsed

        reps, elapsed = 0, 0.0
        while elapsed < args.min_seconds or reps < 3:
            start = time.perf_counter()
            for task, ids in zip(tasks, token_lists):
                python_episode(task, tokenizer.decode(ids))
            elapsed, reps = elapsed + time.perf_counter() - start, reps + 1
        python_rate = reps * args.batch / elapsed

    ratio = device_rate / python_rate
    mix = {str(v): int(np.sum(python_rewards == v)) for v in (0.0, 0.1, 1.0)}
    print(f"{'env':<10} {'batch':>6} {'device episodes/s':>18} {'python episodes/s':>18} {'ratio':>7} {'compile s':>10}")
    print(f"{'countdown':<10} {args.batch:>6} {device_rate:>18.0f} {python_rate:>18.0f} {ratio:>7.2f} {compile_s:>10.1f}")
    print(f"reward mix (identical on both sides): {mix}")
    result = {
        "backend": jax.default_backend(),
        "batch": args.batch,
        "envs": {
            "countdown": {
                "device": {"turns_per_s": device_rate, "actions_per_s": device_rate, "compile_s": compile_s},
                "python": {"turns_per_s": python_rate, "actions_per_s": python_rate},
                "ratio_turns": ratio,
                "reward_mix": mix,
            }
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
