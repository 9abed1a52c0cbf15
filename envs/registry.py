"""``make(name, **params) -> (env, params)``, like ``gymnax.make``: the env and its ``EnvParams`` with
the given fields replaced. Registered: "frozen_lake", "bandit", "sokoban", "countdown"."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from envs.bandit import Bandit
from envs.base import TextEnv
from envs.countdown import Countdown
from envs.frozen_lake import FrozenLake
from envs.sokoban import SokobanEnv

REGISTRY: dict[str, Callable[[], TextEnv]] = {
    "frozen_lake": FrozenLake,
    "bandit": Bandit,
    "sokoban": SokobanEnv,
    "countdown": Countdown,
}


def make(name: str, **params: Any) -> tuple[TextEnv, Any]:
    if name not in REGISTRY:
        raise ValueError(f"unknown env {name!r}; registered envs: {sorted(REGISTRY)}")
    env = REGISTRY[name]()
    defaults = env.default_params
    fields = {f.name for f in dataclasses.fields(defaults)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"{name} has no parameter(s) {unknown}; its parameters are {sorted(fields)}")
    return env, defaults.replace(**params)
