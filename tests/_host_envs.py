"""Plain-Python host envs for the host-env bridge tests (imported by the pool's worker processes, so
this module imports nothing heavy: no JAX, no test module)."""

from __future__ import annotations

import os
import random
import re
import time

from envs.host import HostStep

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class GuessNumber:
    """Guess a number in [1, high]; the reply says higher / lower. Reward 1 for the right guess (done);
    a response without "<answer>N</answer>" is a format error. The target is a function of the seed."""

    def __init__(self, high: int = 9, max_turns: int = 3) -> None:
        self.high, self.max_turns = high, max_turns

    def system_text(self) -> str:
        return f"Guess the number in 1..{self.high}."

    def reset(self, seed: int) -> str:
        self.seed, self.turn = seed, 1
        self.target = random.Random(seed).randint(1, self.high)
        return "\nTurn 1:\nGuess.\n"

    def step(self, response_text: str) -> HostStep:
        match = ANSWER.search(response_text)
        guess = match.group(1).strip() if match else ""
        valid = guess.isdigit()
        right = valid and int(guess) == self.target
        self.turn += 1
        hint = "right" if right else ("higher" if valid and int(guess) < self.target else "lower" if valid else "?")
        return HostStep(reward=float(right), done=right or self.turn > self.max_turns, success=right,
                        format_ok=valid, n_valid=int(valid), n_executed=int(valid),
                        next_user_text=f"Reward:\n{float(right)}\n\nTurn {self.turn}:\n{hint}\n")


class FaultyGuess(GuessNumber):
    """GuessNumber whose episode of seed s misbehaves at turn t for each (s, (kind, t)) in ``faults``:
    "hang" (sleeps for an hour), "raise", "exit" (os._exit: the worker dies) or "reset_raise" (at reset)."""

    def __init__(self, faults: dict | None = None, **kw) -> None:
        super().__init__(**kw)
        self.faults = dict(faults or {})

    def reset(self, seed: int) -> str:
        if self.faults.get(seed, ("", 0))[0] == "reset_raise":
            raise RuntimeError(f"cannot reset seed {seed}")
        return super().reset(seed)

    def step(self, response_text: str) -> HostStep:
        kind, turn = self.faults.get(self.seed, ("", 0))
        if turn == self.turn:
            if kind == "hang":
                time.sleep(3600)
            if kind == "raise":
                raise ValueError("the sandbox broke")
            if kind == "exit":
                os._exit(3)
        return super().step(response_text)
